"""What a result was measured on, in words, for the tables under ``results/``."""
from __future__ import annotations

import platform

import torch


def describe(device: str | torch.device) -> str:
    """The GPU's name, or the processor and the torch threads; with the torch and Python versions."""
    device = torch.device(device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    return f"{where}; torch {torch.__version__}; Python {platform.python_version()}"
