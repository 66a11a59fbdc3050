"""Opt-in timing of the training steps: ``time/train_epoch_s``, the seconds the forward, backward
and optimizer steps of an epoch took (data loading, validation and measurements excluded).

On CUDA each batch is bracketed by CUDA events and the device is synchronised once per epoch, so
timing does not stall the pipeline at every batch; on the CPU it is wall-clock time."""
from __future__ import annotations

import time

import lightning as L
import torch

from .. import tags


class EpochTimer(L.Callback):
    """Args: enabled (off by default: ``--timing.enabled true``)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._seconds = 0.0
        self._started = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._seconds, self._events = 0.0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.enabled:
            return
        if pl_module.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, end))
        else:
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        if self._events:
            self._events[-1][1].record()
        else:
            self._seconds += time.perf_counter() - self._started

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        if self._events:
            torch.cuda.synchronize(pl_module.device)
            self._seconds = sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
        pl_module.log(tags.TIME_TRAIN_EPOCH, self._seconds, on_step=False, on_epoch=True, sync_dist=True)
