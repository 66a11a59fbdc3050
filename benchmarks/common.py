"""Shared by the benchmark scripts: building a model exactly as a run does, one training step,
interleaved timing (CPU wall clock, or CUDA events after synchronising), memory, and the table
written under results/benchmarks/ with the command that made it."""
from __future__ import annotations

import argparse
import math
import shlex
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.time()  # the table says how long its run took
CUT: list[str] = []  # what an interrupt (SIGINT: Ctrl-C, `timeout -s INT`) left unmeasured; the table says so
# a cut reaches Python even where the launcher ignores SIGINT (a script's background job, a pytest-xdist worker)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, str(ROOT))

from stability.classifier import ImageClassifier  # noqa: E402
from stability.machine import describe  # noqa: E402
from stability.testing.profiling import saved_for_backward, train_step  # noqa: E402


def arguments(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cpu", help="cpu or cuda (timed with CUDA events after synchronising)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per case (interleaved)")
    p.add_argument("--quick", action="store_true", help="a tiny configuration that runs in seconds (tests)")
    p.add_argument("--out", default=None, help="output Markdown file (default results/benchmarks/<name>_<device>.md)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def setup(args: argparse.Namespace) -> torch.device:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    return device


def build_module(backbone: str, size: str, stabilizer: str, options: dict | None = None, *, image_size: int,
                 device: torch.device, backbone_options: dict | None = None, lr: float = 1e-3,
                 seed: int = 0, in_chans: int = 3, compile: bool = False,
                 stabilizer_options: dict[str, dict] | None = None) -> tuple[ImageClassifier, torch.optim.Optimizer]:
    """The module and optimizer a ``stability fit`` with these settings trains (10 classes), on
    ``device``, seeded (``compile``: as ``--model.compile true``). ``options`` are the first stabilizer's;
    ``stabilizer_options`` any stabilizer's by name (a composition's muon, say; for the first, merged over
    ``options``)."""
    torch.manual_seed(seed)
    names = stabilizer.split(",")
    unknown = sorted(set(stabilizer_options or {}) - set(names))
    if unknown:
        raise ValueError(f"stabilizer_options for {unknown}, which are not in {names}")
    by_name = dict(stabilizer_options or {})
    if options:  # the first stabilizer's options, merged with (and overridden by) any given for it by name
        by_name[names[0]] = {**options, **(by_name.get(names[0]) or {})}
    module = ImageClassifier(backbone=backbone, size=size, backbone_options=backbone_options or {},
                             stabilizer=names, stabilizer_options=by_name or None,
                             num_classes=10, in_chans=in_chans, image_size=image_size, mean=[0.5] * in_chans,
                             std=[0.25] * in_chans,
                             lr=lr, compile=compile)
    module.to(device).train()
    return module, module.build_optimizer()


def digits(image_size: int, batch: int, device: torch.device):
    """Digits (the suite's embedded data) upsampled to ``image_size``: the training loader and one
    fixed validation batch on ``device``."""
    from stability.data import Digits

    data = Digits(image_size=image_size, batch_size=batch)
    data.setup("fit")
    images, labels = next(iter(data.val_dataloader()))
    return data.train_dataloader(), images.to(device), labels.to(device)


def train_epochs(module, optimizer, loader, epochs: int, device: torch.device) -> None:
    step = 0
    for _ in range(epochs):
        for images, labels in loader:
            train_step(module, optimizer, images.to(device), labels.to(device), step=step)
            step += 1


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (CUDA: between events, after synchronising)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(cases: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                warmup: int = 2, keep_cut_rounds: bool = False) -> dict[str, float]:
    """Median seconds per call of each case; the cases take turns (the order rotating every round)
    so that drifts of the machine hit all of them alike. With ``keep_cut_rounds``, an interrupt (SIGINT) after
    at least one whole round returns the medians of the whole rounds and notes the cut in :data:`CUT`."""
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds = 0
    try:
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                samples[name].append(time_once(cases[name], device))
            rounds += 1
    except KeyboardInterrupt:  # cut at a time limit: keep the rounds every case finished, or nothing
        if rounds == 0 or not keep_cut_rounds:
            raise
        CUT.append(f"interrupted after {rounds} of {repeats} timed rounds: medians of those {rounds}")
        samples = {name: values[:rounds] for name, values in samples.items()}
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_memory(fn: Callable[[], Any], device: torch.device) -> float:
    """Bytes of one call of ``fn`` after a warm-up call (caches, optimizer state and persistent buffers exist by
    then, as in a running job): on CUDA the peak allocated above what was allocated before; on CPU (which keeps
    no such count) the tensors saved for backward (``profiling.saved_for_backward``: each storage once), the part a
    stabilizer adds to."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    return float(saved_for_backward(fn))


def memory_label(device: torch.device) -> str:
    return "peak allocated" if device.type == "cuda" else "saved for backward"


def environment(device: torch.device) -> str:
    return describe(device)


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return "python " + " ".join(shlex.quote(a) for a in [str(script), *sys.argv[1:]])


def write(name: str, args: argparse.Namespace, device: torch.device, title: str, body: str) -> Path:
    out = Path(args.out) if args.out else ROOT / "results" / "benchmarks" / f"{name}_{device.type}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    minutes = (time.time() - STARTED) / 60
    cut = "".join(f"**Cut short:** {note}.\n\n" for note in CUT)
    text = (f"# {title}\n\nMade by `{command_line()}` on {environment(device)}, in {minutes:.1f} min.\n\n"
            f"{cut}{body}\n")
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return out


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.3g}"
    return str(value)
