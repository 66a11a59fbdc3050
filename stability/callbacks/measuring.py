"""How a long measurement runs (:func:`~stability.callbacks.points.measure_batches` with a :class:`Session`):

* **progress**: one bar per measurement, in the style of Lightning's own (tqdm: points done of the total, rate, ETA),
  only where the progress bar is on and on the first process; without it, a log line as each measurement starts; and,
  bar or not, one log line per measurement when it ends (points, seconds, points/s);
* **SIGTERM honoured within seconds**: every forward pass of the measured network checks Lightning's SIGTERM flag
  (and the batches between them), so an attack — the official AutoAttack's hundreds of passes per batch included —
  stops at its next forward: :class:`MeasurementInterrupted`, carrying what was measured so far;
* **resume** (at test): every finished batch is kept under ``<checkpoint dir>/measurements/<key>/``, ``key`` a digest
  of the network's weights and of what is measured; rerunning the same ``stability test`` loads those batches instead
  of measuring them again — a batch's outcome depends only on its index (its seed), so the resumed numbers are those
  of an uninterrupted run. The folder is removed once the whole test has been measured.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

RESULTS_FILE = "results.json"  # beside the tested checkpoint (results_file.py writes it)
LAST_CHECKPOINT = "last.ckpt"


class MeasurementInterrupted(Exception):
    """A stop signal (SIGTERM) arrived during a measurement. ``completed``: {batch index: result} of this process's
    finished batches, ``points``: how many points they hold, ``name``: the measurement."""

    def __init__(self, name: str, completed: dict[int, Any], points: int) -> None:
        super().__init__(f"{name}: stopped after {points} points")
        self.name, self.completed, self.points = name, completed, points


@dataclass
class Session:
    """What a monitor's measurements at one stage share.

    Args:
        label: the monitor and stage, e.g. ``robustness (test)``, for the bars and log lines.
        show_bar: draw progress bars (the trainer's progress bar is on, and this is the first process).
        should_stop: True once the run was asked to stop (Lightning's ``trainer.received_sigterm``).
        store: the folder finished batches are kept in for a resumed run (None: not kept).
    """

    label: str
    show_bar: bool = False
    should_stop: Callable[[], bool] = lambda: False
    store: Path | None = None
    lines: list[str] = field(default_factory=list)  # the log lines written, in order
    progress_every_s: float = 10.0  # a progress line once a measurement has run this long, and as often at most
    _last_progress: float = 0.0

    @classmethod
    def of(cls, trainer, label: str, store: Path | None = None) -> Session:
        show = trainer.progress_bar_callback is not None and trainer.is_global_zero
        return cls(label, show, lambda: bool(getattr(trainer, "received_sigterm", False)), store)

    def check(self, name: str, completed: dict[int, Any], points: int) -> None:
        if self.should_stop():
            raise MeasurementInterrupted(name, completed, points)

    @contextlib.contextmanager
    def interruptible(self, network: nn.Module | Sequence[nn.Module] | None, name: str, completed: dict[int, Any],
                      points: int) -> Iterator[None]:
        """Every forward pass of ``network`` (or of each of several) inside the block first checks the stop
        signal."""
        networks = [] if network is None else [network] if isinstance(network, nn.Module) else list(network)

        def hook(module, args):
            self.check(name, completed, points)

        # before any work the forward's hooks do
        handles = [each.register_forward_pre_hook(hook, prepend=True) for each in networks]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------------------------------------- resume
    def _path(self, name: str, index: int) -> Path | None:
        if self.store is None:
            return None
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        return self.store / f"{safe}.batch{index}.pt"

    def load(self, name: str, index: int) -> Any | None:
        path = self._path(name, index)
        if path is None or not path.is_file():
            return None
        return torch.load(path, weights_only=True, map_location="cpu")  # any device: a GPU run resumes on a CPU

    def save(self, name: str, index: int, result: Any) -> None:
        path = self._path(name, index)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        torch.save(_on_cpu(result), partial)
        os.replace(partial, path)  # a batch is kept whole or not at all

    def finished(self) -> None:
        """The whole measurement is done: its kept batches are no longer needed."""
        if self.store is not None and self.store.is_dir():
            shutil.rmtree(self.store, ignore_errors=True)
            with contextlib.suppress(OSError):  # the measurements/ folder too, once no other monitor keeps anything
                self.store.parent.rmdir()

    # ----------------------------------------------------------------------------------------------- progress
    def bar(self, name: str, total: int):
        if not self.show_bar:
            return _NoBar()
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"{self.label} {name}", unit="pt", leave=False, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0)

    def starting(self, name: str, points: int) -> None:
        """A log line as a measurement starts, where no bar shows it (a log read while it runs, or cut short, names
        what was running)."""
        self._last_progress = 0.0  # this measurement's progress lines start afresh
        if not self.show_bar:
            rank_zero_info(f"{self.label}: {name} on {points} points …")

    def progress(self, name: str, done: int, total: int, seconds: float, resumed: int = 0) -> None:
        """A log line after a batch of a measurement with more to come, where no bar shows it, once it has run
        ``progress_every_s`` and as often at most: the points done and the end re-estimated from the rate of those
        measured (not those kept from an interrupted run)."""
        if self.show_bar or seconds < self._last_progress + self.progress_every_s:
            return
        self._last_progress = seconds
        measured = done - resumed
        rest = f"; the rest ≈ {format_seconds(seconds / measured * (total - done))}" if measured > 0 else ""
        rank_zero_info(f"{self.label}: {name}: {done} of {total} points in {format_seconds(seconds)}{rest}")

    def said(self, name: str, points: int, seconds: float, resumed: int = 0) -> None:
        rate = (points - resumed) / seconds if seconds > 0 and points > resumed else float("nan")
        kept = f", {resumed} of them kept from an interrupted run" if resumed else ""
        line = f"{self.label}: {name} on {points} points in {format_seconds(seconds)} ({rate:.3g} points/s{kept})"
        self.lines.append(line)
        rank_zero_info(line)


SHARE_LIMIT = 0.10  # of an epoch's training time, for the measurements a monitor makes at validation during fit


class EpochShare:
    """What a monitor's measurements at a validation during fit cost, against the training time of the epoch so far
    (from the epoch's start to its validation), and the bound on it. On a GPU a small model's epoch takes seconds,
    and measurements sized for a CPU can take longer than the training itself.

    After each measurement: one line with its share. Where the share s exceeds ``limit`` (the monitor's
    ``max_share``, 10% by default), the next ⌈s / limit⌉ − 1 due validations are skipped, so that over the run the
    measurements cost at most ``limit`` of the training time, and a line says which epoch is measured next (the
    points and seeds of a measured epoch are unchanged; which epochs are measured then follows this machine's
    speed). ``limit`` 0 measures every due validation and only warns, once, above :data:`SHARE_LIMIT`. In DDP the
    share is rank 0's (``agree``), so every process skips the same validations. The schedule (the next measured
    epoch) travels in the monitor's checkpoint state, so that a resumed run skips what the run it resumes would
    have skipped."""

    def __init__(self, options: str, limit: float = SHARE_LIMIT,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if limit < 0:
            raise ValueError(f"max_share must be >= 0 (0: no bound), got {limit}")
        self.options, self.limit, self.clock = options, limit, clock
        self.started: float | None = None
        self.training: float | None = None
        self.next_epoch = 0
        self.warned = False

    def epoch_started(self) -> None:
        self.started, self.training = self.clock(), None

    def state_dict(self) -> dict:
        return {"next_epoch": self.next_epoch, "warned": self.warned, "limit": self.limit}

    def load_state_dict(self, state: dict) -> None:
        """The saved schedule, where it was made under this bound (a resumed run given another ``max_share``, or 0,
        measures its next due validation and plans from there)."""
        self.warned = bool(state["warned"])
        if self.limit and state.get("limit") == self.limit:
            self.next_epoch = int(state["next_epoch"])

    def validation_started(self) -> None:
        if self.started is not None:
            self.training = self.clock() - self.started

    def due(self, epoch: int, every_n_epochs: int = 1) -> bool:
        """Whether the validation of ``epoch`` (0-based) is measured: one every ``every_n_epochs`` (0: none), less
        those the bound skips."""
        return bool(every_n_epochs) and (epoch + 1) % every_n_epochs == 0 and epoch >= self.next_epoch

    def report(self, label: str, seconds: float, epoch: int | None = None, every_n_epochs: int = 1,
               agree: Callable[[float], float] = lambda share: share) -> float | None:
        """Say the share ``seconds`` is of this epoch's training (None where the epoch was not timed); above the
        limit, skip the validations that keep the measurements within it (from ``epoch``, measured every
        ``every_n_epochs``)."""
        if not self.training:
            return None
        share = float(agree(seconds / self.training))
        rank_zero_info(f"{label}: measurements {format_seconds(seconds)}, {share:.0%} of this epoch's training "
                       f"({format_seconds(self.training)})")
        if self.limit and share > self.limit and epoch is not None:
            cycles = math.ceil(share / self.limit)
            self.next_epoch = epoch + every_n_epochs * cycles
            rank_zero_info(f"{label}: next measured at epoch {self.next_epoch + 1} (one due validation in {cycles} "
                           f"keeps the measurements within {self.limit * 100:g}% of the training time; max_share "
                           f"sets the bound, {self.options} the measurements' size)")
        elif not self.limit and share > SHARE_LIMIT and not self.warned:
            rank_zero_warn(f"{label}: the measurements take {share:.0%} of an epoch's training time (more than "
                           f"{SHARE_LIMIT:.0%}); limit them with {self.options}")
            self.warned = True
        return share


class SharedMeasurements:
    """A monitor's hooks around its :class:`EpochShare` ``_share``, for a Lightning callback that measures at
    validation during fit every ``every_n_epochs``: the epoch's training timed, the measured validations chosen, the
    share reported (rank 0's in DDP), the schedule kept in the checkpoint. Listed before ``L.Callback`` in the bases,
    so that its hooks are the callback's."""

    _share: EpochShare
    every_n_epochs: int

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._share.epoch_started()

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._share.validation_started()

    def state_dict(self) -> dict:
        return {"share": self._share.state_dict()}  # which validations the bound skips, for a resumed run

    def load_state_dict(self, state_dict: dict) -> None:
        if "share" in state_dict:  # absent from checkpoints written before the bound existed
            self._share.load_state_dict(state_dict["share"])

    def measured_now(self, trainer) -> bool:
        """Whether this validation (during fit, not the sanity check) is measured."""
        return not trainer.sanity_checking and self._share.due(trainer.current_epoch, self.every_n_epochs)

    def report_share(self, trainer, label: str, seconds: float) -> None:
        self._share.report(label, seconds, trainer.current_epoch, self.every_n_epochs,
                           lambda share: trainer.strategy.broadcast(share, src=0))


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def results_path(trainer) -> Path | None:
    """Beside the tested checkpoint: the one given to ``test`` (``results.json`` for ``last.ckpt``,
    ``results_<name>.json`` for another, e.g. ``best.ckpt``, so that it never replaces the final weights' results),
    else the run's checkpoints (a test after fit: the final weights), else the run directory."""
    tested = trainer.ckpt_path
    if tested and Path(tested).is_file():
        tested = Path(tested)
        return tested.parent / (RESULTS_FILE if tested.name == LAST_CHECKPOINT else f"results_{tested.stem}.json")
    for checkpoint in getattr(trainer, "checkpoint_callbacks", []):
        for candidate in (checkpoint.last_model_path, checkpoint.best_model_path):
            if candidate and Path(candidate).is_file():
                return Path(candidate).parent / RESULTS_FILE
    return Path(trainer.log_dir) / RESULTS_FILE if trainer.log_dir else None


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 4 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def store_key(network: nn.Module, dataset, *what: Any) -> str:
    """A digest of the network (its weights, and the settings outside them: logit scale and cap), of the data (its
    class, size and a sample of its points) and of what is measured (settings, points): batches kept under it are valid
    only for exactly that measurement."""
    digest = hashlib.sha1()
    for name, tensor in network.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr((getattr(network, "logit_scale", None), getattr(network, "logit_cap", None))).encode())
    digest.update(f"{type(dataset).__qualname__}:{len(dataset)}".encode())
    for i in sorted({0, len(dataset) // 2, len(dataset) - 1}):
        image, label = dataset[i]
        digest.update(torch.as_tensor(image).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digest.update(repr(int(label)).encode())
    digest.update(repr(what).encode())
    return digest.hexdigest()[:16]


def seconds_per_point(network: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The time of one forward and backward pass of ``network`` per point, measured on ``images`` (the unit of an
    attack's cost); a :class:`~stability.robustness.fixed_batch.FixedBatch` on its whole batch (``images``
    repeated), after a warm-up pass that compiles it."""
    from ..robustness.attacks import evaluating, gradients_allowed, input_gradient
    from ..robustness.fixed_batch import FixedBatch, repeated_to
    from ..wall_clock import seconds

    if isinstance(network, FixedBatch):  # timed on one whole batch, the shape it always computes
        images, labels = repeated_to(network.batch_size, images, labels)
    with gradients_allowed(), evaluating(network):
        input_gradient(network, images, labels)  # warm-up
        return seconds(lambda: input_gradient(network, images, labels), images.device) / max(1, len(labels))


__all__ = ["MeasurementInterrupted", "Session", "format_seconds", "results_path", "seconds_per_point", "store_key"]
