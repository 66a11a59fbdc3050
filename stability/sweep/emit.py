"""Emitting a sweep for other machines: one ``stability sweep FILE --only RUN`` command per run
(the same bookkeeping wherever it runs) and a SLURM job-array script."""
from __future__ import annotations

import sys
from pathlib import Path

from .spec import Run


def write_commands(root: Path, runs: list[Run], spec_path: Path) -> Path:
    """``commands.txt``: one ``stability sweep SPEC --only RUN`` line per run."""
    root.mkdir(parents=True, exist_ok=True)
    lines = [" ".join([sys.executable, "-m", "stability", "sweep", str(spec_path), "--sweeps_dir",
                       str(root.parent), "--only", _quote(run.name)]) for run in runs]
    commands = root / "commands.txt"
    commands.write_text("\n".join(lines) + "\n")
    return commands


def write_slurm_array(root: Path, name: str, runs: list[Run], spec_path: Path, slurm_options: list[str]) -> Path:
    """``slurm_array.sh``: a job array running one line of ``commands.txt`` per task."""
    commands = write_commands(root, runs, spec_path)
    logs = root / "slurm"
    logs.mkdir(exist_ok=True)
    script = root / "slurm_array.sh"
    options = "".join(f"#SBATCH {o}\n" for o in slurm_options)
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name={name}\n"
        f"#SBATCH --array=0-{len(runs) - 1}\n"
        f"#SBATCH --output={logs.resolve()}/%A_%a.out\n"
        f"{options}"
        f"# one run of sweep {name} per array task; rerunning a task skips a complete run\n"
        f"cd {Path.cwd()}\n"
        f'sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {commands.resolve()} | bash\n')
    script.chmod(0o755)
    return script


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
