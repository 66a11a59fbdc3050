"""Where a `stability fit` spends its time, by phase: start-up (from the command to the first training step), the
training steps, validation's forward passes, each callback's own work (the measurements at an epoch's end, the
checkpoint, the logs), and the test after fit — wall-clock seconds and this process's CPU seconds (which another job
on the same cores inflates less).

    python benchmarks/epoch_phases.py                                   # configs/vit_mnist.yaml, 1 epoch, the CPU
    python benchmarks/epoch_phases.py --device cuda --epochs 2          # on a GPU (the device synchronised per phase)
    python benchmarks/epoch_phases.py --config configs/vit_digits.yaml -- --trainer.max_epochs 3

`stability fit` is built exactly as the command builds it (StabilityCLI: the config, the default callbacks and the
monitors with their defaults); a first callback times every hook of the others (each callback's share) and the
module's steps. Arguments after ``--`` go to `stability fit`.
"""
from __future__ import annotations

import functools
import sys
import tempfile
import time
from collections import defaultdict

import lightning as L
import torch
from common import CUT, arguments, markdown, write

STARTED_WALL, STARTED_CPU = time.perf_counter(), time.process_time()

from stability.cli import StabilityCLI  # noqa: E402  (start-up counts the imports)

FORWARD = "training steps: forward and loss"  # runs inside optimizer_step (Lightning's closure)
HOOKS = ("on_train_epoch_start", "on_train_epoch_end", "on_validation_epoch_start", "on_validation_epoch_end",
         "on_validation_end", "on_train_end", "on_fit_end", "on_test_epoch_end", "on_test_end", "on_save_checkpoint",
         "on_train_batch_end", "on_train_batch_start", "on_before_optimizer_step", "on_validation_batch_end")


class PhaseClock(L.Callback):
    """Times the module's steps and every other callback's hooks; the rest of the fit is the loop's own work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.first_step: tuple[float, float] | None = None
        self.steps = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._sync()
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.process_time() - cpu
        return wrapper

    def setup(self, trainer, pl_module, stage: str) -> None:
        for callback in trainer.callbacks:
            if callback is self:
                continue
            name = type(callback).__name__
            for hook in HOOKS:
                own = getattr(type(callback), hook, None)
                if own is not None and own is not getattr(L.Callback, hook):
                    setattr(callback, hook, self.timed(f"callback {name}", getattr(callback, hook)))
        for step, label in (("training_step", FORWARD),
                            ("optimizer_step", "training steps: backward, optimizer, projections"),
                            ("validation_step", "validation: forward passes"), ("test_step", "test: forward passes")):
            setattr(pl_module, step, self.timed(label, getattr(pl_module, step)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first_step is None:
            self._sync()
            self.first_step = (time.perf_counter() - STARTED_WALL, time.process_time() - STARTED_CPU)
        self.steps += 1


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/vit_mnist.yaml")
    p.add_argument("--epochs", type=int, default=1)
    argv, extra = (sys.argv[1:], [])
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = PhaseClock(device)
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    cli_args = ["--config", args.config, "--trainer.max_epochs", str(args.epochs), "--trainer.accelerator",
                accelerator, "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.logger", "false", "--trainer.default_root_dir", tempfile.mkdtemp(prefix="epoch_phases_"),
                "--timing.enabled", "true", *extra]  # its config.yaml and checkpoints go to a scratch folder
    cli = StabilityCLI(cli_args, run=False)
    cli.trainer.callbacks.insert(0, clock)
    clock.setup(cli.trainer, cli.model, "fit")  # before Lightning calls any hook: every later one is timed
    clock.setup = lambda *a, **k: None
    try:
        cli.trainer.fit(cli.model, cli.datamodule)
    except (KeyboardInterrupt, SystemExit) as cut:  # cut at a time limit (Lightning exits on SIGINT)
        if isinstance(cut, SystemExit) and not cli.trainer.interrupted:
            raise
        if clock.first_step is None:
            raise SystemExit("epoch_phases: interrupted before the first training step; nothing written") from None
        CUT.append(f"interrupted during epoch {min(cli.trainer.current_epoch + 1, args.epochs)} of {args.epochs}, "
                   f"in the run's training step {clock.steps} (or after it): the phases until then")
    total_wall, total_cpu = time.perf_counter() - STARTED_WALL, time.process_time() - STARTED_CPU
    backward = "training steps: backward, optimizer, projections"
    clock.wall[backward] -= clock.wall[FORWARD]  # the closure's forward ran inside the optimizer step
    clock.cpu[backward] -= clock.cpu[FORWARD]
    rows = [["start-up (imports, building, data, until the first training step)", *clock.first_step]]
    rows += [[name, clock.wall[name], clock.cpu[name]] for name in sorted(clock.wall, key=clock.wall.get,
                                                                          reverse=True)]
    accounted_wall = clock.first_step[0] + sum(clock.wall.values())
    accounted_cpu = clock.first_step[1] + sum(clock.cpu.values())
    rows.append(["the loop's own work (Lightning, data loading, logging)", total_wall - accounted_wall,
                 total_cpu - accounted_cpu])
    rows.append(["command to exit", total_wall, total_cpu])
    rows = [[name, wall, cpu, f"{100 * wall / total_wall:.0f}%"] for name, wall, cpu in rows]
    body = (f"`stability fit --config {args.config} --trainer.max_epochs {args.epochs}` "
            f"({' '.join(extra) or 'no other options'}): {clock.steps} training steps on {device.type}, "
            f"{torch.get_num_threads()} CPU threads. Wall-clock and this process's CPU seconds by phase "
            f"(callbacks: each one's hooks, the measurements at the end of an epoch and at test among them).\n\n"
            + markdown(["phase", "wall s", "CPU s", "share of wall"], rows))
    write("epoch_phases", args, device, "A fit, by phase", body)
    if CUT:
        raise SystemExit(130)  # the table holds what finished; the exit status says it was cut


if __name__ == "__main__":
    main()
