"""Where a fit's host time goes: torch.profiler over training steps 40..80 of a short `stability fit` (the operators by
their own host time; kernel launches, copies and reads back per step), and on CUDA the synchronisations of those
steps (CUDA's sync check), each with the lines of the suite and of Lightning that made it.

    python benchmarks/host_profile.py --device cuda                       # configs/vit_mnist.yaml
    python benchmarks/host_profile.py --device cuda --config configs/vit_cifar10.yaml -- --trainer.precision bf16-mixed

The measurements at an epoch's end are off (they are not training steps); arguments after ``--`` go to
`stability fit`. On the CPU the same table shows the CPU's path (per-parameter AdamW, no launches).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stability.cli import StabilityCLI  # noqa: E402

COUNTED = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaStreamSynchronize",
           "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize", "aten::item",
           "aten::_local_scalar_dense", "aten::copy_", "aten::to")


SHOW_WARNING = warnings.showwarning


class Report:
    """Lines written to ``out`` as they come (a run cut short keeps them)."""

    def __init__(self, out: Path) -> None:
        self.out, self.lines = out, []
        out.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        self.out.write_text("\n".join(self.lines) + "\n")


class StepProfile(L.Callback):
    """Profiles training steps [first, last) and, on CUDA, records where they synchronise."""

    def __init__(self, first: int, last: int, device: str, say: Report, title: str) -> None:
        self.first, self.last, self.device, self.say, self.title = first, last, device, say, title
        self.profiler = None
        self.sync_sites: collections.Counter = collections.Counter()
        self.started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.last - 1 or self.profiler is None:
            return
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        steps = self.last - self.first
        averages = self.profiler.key_averages()
        self.say(f"== {self.title}: training steps {self.first}..{self.last} on {self.device}: "
                 f"{1e3 * wall / steps:.2f} ms a step (profiled)")
        self.say(averages.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60))
        counts = {e.key: e.count for e in averages}
        for key in COUNTED:
            if key in counts:
                self.say(f"{key}: {counts[key] / steps:.1f} a step")
        if self.device == "cuda":
            self.say(f"synchronisations in those steps (CUDA's sync check), by site: {sum(self.sync_sites.values())}")
            for site, n in self.sync_sites.most_common(12):
                self.say(f"--- {n}×\n{site}")
        self.profiler = None

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        """``warnings.showwarning`` during the fit: CUDA's sync check warns at every synchronisation (counted here, by
        site; the stack walk adds host time to the profiled steps); every other warning is shown as usual."""
        if "synchroniz" not in str(message):
            SHOW_WARNING(message, category, filename, lineno, file, line)
            return
        stack = [f for f in traceback.extract_stack()[:-1]
                 if ("/stability/" in f.filename or "/lightning/" in f.filename) and "host_profile" not in f.filename]
        self.sync_sites["".join(traceback.format_list(stack[-6:]))] += 1


def main() -> None:
    argv, extra = sys.argv[1:], []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--config", default="configs/vit_mnist.yaml")
    parser.add_argument("--first", type=int, default=40, help="the first profiled training step (warm-up before)")
    parser.add_argument("--steps", type=int, default=40, help="profiled training steps")
    parser.add_argument("--quick", action="store_true", help="configs/vit_digits.yaml, steps 2..4 (tests)")
    parser.add_argument("--out", default=None, help="default results/benchmarks/host_profile_<device>.txt")
    args = parser.parse_args(argv)
    if args.quick:
        args.config, args.first, args.steps = "configs/vit_digits.yaml", 2, 2
    out = Path(args.out) if args.out else ROOT / "results" / "benchmarks" / f"host_profile_{args.device}.txt"
    say = Report(out)
    probe = StepProfile(args.first, args.first + args.steps, args.device, say, " ".join([args.config, *extra]))
    warnings.showwarning = probe.record
    warnings.simplefilter("always")
    accelerator = ["--trainer.accelerator", "gpu", "--trainer.devices", "1"] if args.device == "cuda" else \
        ["--trainer.accelerator", "cpu"]
    cli = StabilityCLI(["--config", args.config, *accelerator, "--trainer.max_epochs", "1",
                        "--trainer.limit_train_batches", str(probe.last + 10), "--trainer.limit_val_batches", "2",
                        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                        "--trainer.default_root_dir", tempfile.mkdtemp(), "--run_dir", tempfile.mkdtemp(),
                        "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0", *extra], run=False)
    cli.trainer.callbacks.insert(0, probe)
    started = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    if probe.profiler is not None or not probe.say.lines:
        say(f"the fit ended before training step {probe.last}: nothing profiled (fewer batches than --first + --steps)")
    say(f"fit of {probe.last + 10} steps: {time.perf_counter() - started:.1f} s; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
