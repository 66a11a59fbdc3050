"""Deterministic index splits, independent of the global RNG (so of the run's seed)."""
from __future__ import annotations

import torch


def split_indices(n: int, val_fraction: float, test_fraction: float = 0.0,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffle range(n) with ``seed`` and cut it into train / val / test index tensors."""
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must be in "
                         f"[0, 1) and sum to less than 1")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    return order[n_val + n_test:], order[:n_val], order[n_val:n_val + n_test]
