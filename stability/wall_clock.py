"""Wall-clock seconds of work on a device: the host waits for the device before and after, so that queued CUDA
kernels count where they run (a CPU tensor's work is done when its call returns)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(step: Callable[[], Any], device: torch.device | str) -> float:
    """The wall-clock seconds ``step()`` takes on ``device``, its queued work included."""
    synchronize(device)
    started = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - started
