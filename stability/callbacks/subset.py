"""A fixed evaluation subset: the first ``size`` points of a data loader (its order is fixed).

Starting a DataLoader iterator draws its base seed from the global RNG; the state is restored
afterwards, so that measuring never changes the training run it measures."""
from __future__ import annotations

import torch


def first_points(loader, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels, count = [], [], 0
    with torch.random.fork_rng(devices=[]):
        for x, y in loader:
            images.append(x)
            labels.append(y)
            count += len(y)
            if count >= size:
                break
    if not images:
        raise ValueError("the evaluation data loader is empty")
    return torch.cat(images)[:size], torch.cat(labels)[:size]


def has_finite_weights(module: torch.nn.Module) -> bool:
    """False once a run has diverged into inf/NaN weights: there is nothing left to measure (and
    an SVD of such a weight raises)."""
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())
