"""Spectral norms and the weight operations built on them.

σ₁(W) is the largest singular value. The RMS→RMS norm of a (d_out × d_in) matrix is
‖W‖_RMS = sqrt(d_in / d_out) · σ₁(W) (Newhouse et al. 2025; METHODS.md §4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def power_iteration(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                    iterations: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` steps of v ← Wᵀu/‖·‖, u ← Wv/‖·‖ on (batched) matrices (..., m, n).

    u: (..., m), v: (..., n). Returns the new (u, v); no gradient flows through them.
    """
    with torch.no_grad():
        for _ in range(iterations):
            v = F.normalize(torch.einsum("...mn,...m->...n", weight, u), dim=-1)
            u = F.normalize(torch.einsum("...mn,...n->...m", weight, v), dim=-1)
    return u, v


def sigma_from_vectors(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """σ ≈ uᵀ W v (differentiable in W, with u, v held constant), shape (...)."""
    return torch.einsum("...m,...mn,...n->...", u, weight, v)


def spectral_norm(weight: torch.Tensor) -> torch.Tensor:
    """Exact σ₁ of (batched) matrices, by SVD."""
    return torch.linalg.matrix_norm(weight, ord=2)


def rms_scale(weight: torch.Tensor) -> float:
    """sqrt(d_in / d_out): multiply σ₁ by it for the RMS→RMS norm."""
    return (weight.shape[-1] / weight.shape[-2]) ** 0.5
