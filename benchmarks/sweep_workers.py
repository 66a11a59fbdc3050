"""How much faster a sweep of small runs goes with K of them at once (``stability sweep --workers K``): the same runs
(a config's seeds) swept with K = 1, 2, 4, timed from command to exit, on this machine's CPU cores or its GPU (every
run shares the one GPU; each gets its share of the CPU cores for its host work, as the sweep gives it).

    python benchmarks/sweep_workers.py                       # 4 runs of configs/vit_digits.yaml, 3 epochs each
    python benchmarks/sweep_workers.py --device cuda --workers 1,2,4,8 --runs 8

Small models leave a GPU mostly waiting on one process's host work, so several runs at once fill it; on a CPU the
runs share the cores, and the gain is what one run's threads leave unused.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, arguments, markdown, write


def sweep_seconds(workers: int, runs: int, epochs: int, config: str, device: str, root: Path,
                  extra: list[str]) -> float:
    """Wall-clock seconds of one sweep of ``runs`` seeds with ``workers`` at a time, in a fresh directory."""
    command = [sys.executable, "-m", "stability", "sweep", "--name", f"workers_{workers}", "--config", config,
               "--seeds", ",".join(str(s) for s in range(runs)), "--sweeps_dir", str(root / f"k{workers}"),
               "--workers", str(workers),
               "--set", f"trainer.max_epochs={epochs}", "--set", "test_after_fit=false",
               "--set", "lipschitz.every_n_epochs=0", "--set", "robustness.every_n_epochs=0",
               "--set", "trainer.enable_progress_bar=false",
               "--set", f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"sweep with --workers {workers} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/vit_digits.yaml")
    p.add_argument("--workers", default="1,2,4", help="K values, comma-separated")
    p.add_argument("--runs", type=int, default=4, help="runs in each sweep (seeds 0, 1, …)")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    extra: list[str] = []
    if args.quick:
        args.workers, args.runs, args.epochs = "1,2", 2, 1
        extra = ["--set", "model.backbone_options={embed_dim: 16, depth: 1, num_heads: 2}",
                 "--set", "trainer.limit_train_batches=4", "--set", "trainer.limit_val_batches=1"]
    counts = [int(k) for k in args.workers.split(",")]
    config = str(ROOT / args.config)
    with tempfile.TemporaryDirectory() as tmp:
        seconds = {k: sweep_seconds(k, args.runs, args.epochs, config, args.device, Path(tmp), extra)
                   for k in counts}
    base = seconds[counts[0]]
    rows = [[k, s, 60 * args.runs / s, f"{base / s:.2f}"] for k, s in seconds.items()]
    body = (f"{args.runs} runs of `{args.config}` ({args.epochs} epochs each, no measurements, no test) swept with "
            f"`--workers K`; time from command to exit.\n\n"
            + markdown(["K", "seconds", "runs / min", f"speed-up over K = {counts[0]}"], rows))
    write("sweep_workers", args, __import__("torch").device(args.device), "Sweep workers", body)


if __name__ == "__main__":
    main()
