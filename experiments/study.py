"""Run one study end to end: its sweep (configs/experiments/<study>.yaml), then its report.

    python experiments/study.py lipsformer_no_warmup            # → runs/sweeps/<name>/, results/<name>/
    python experiments/study.py mnist/jasmin_specformer --workers 2
    python experiments/study.py jasmin_specformer --workers 2
    python experiments/study.py paper/jasmin_specformer_cifar10 --devices 0,1,2,3

Rerunning continues an interrupted sweep (complete runs are skipped) and rewrites the report.
Extra arguments go to ``stability sweep`` (``--workers``, ``--devices``, ``--submit slurm``, ...).
"""
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        studies = sorted(str(p.relative_to(ROOT / "configs/experiments"))[:-5]
                         for p in (ROOT / "configs/experiments").rglob("*.yaml"))
        print(f"usage: python experiments/study.py STUDY [sweep options]; studies: {studies}", file=sys.stderr)
        return 2
    study, extra = argv[0], argv[1:]
    spec = ROOT / "configs" / "experiments" / f"{study}.yaml"
    if not spec.is_file():
        print(f"no study {study!r}: {spec} does not exist", file=sys.stderr)
        return 2
    sweep = subprocess.run([sys.executable, "-m", "stability", "sweep", str(spec.relative_to(ROOT)), *extra],
                           cwd=ROOT)
    if any(flag in extra for flag in ("--emit", "--dry_run", "--submit")):
        return sweep.returncode
    name = yaml.safe_load(spec.read_text())["name"]  # the sweep's directory and the report's
    report = subprocess.run([sys.executable, "-m", "stability", "report", f"runs/sweeps/{name}",
                             "--study", name, "--out", f"results/{name}"], cwd=ROOT)
    return sweep.returncode or report.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
