"""Random streams that depend only on the run's seed and the epoch, so that a run resumed from a
checkpoint draws exactly what an uninterrupted run of the same seed draws."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def run_seed() -> int:
    """The run's seed (``--seed_everything``), as Lightning records it."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def epoch_seed(epoch: int, salt: int = 0) -> int:
    return (run_seed() * 1_000_003 + epoch * 7919 + salt) % 2 ** 32


def seed_epoch(epoch: int) -> None:
    """Python's, NumPy's and torch's global generators seeded from (run seed, epoch)."""
    value = epoch_seed(epoch)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
