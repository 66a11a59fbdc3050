"""Bounds on the softmax Jacobian from the JaSMin paper (Yudin et al. 2025).

For a probability vector x with order statistics x₍₁₎ ≥ x₍₂₎ ≥ … ≥ x₍ₙ₎ and x₍ₙ₊₁₎ = 0,

    g_k(x) = x₍ₖ₎ · (1 − x₍ₖ₎ + x₍ₖ₊₁₎)                                   (JaSMin, Theorem 4)

bounds the singular values of M(x) = diag(x) − x xᵀ, the Jacobian of softmax at output x:
x₍₁₎ ≥ g₁ ≥ σ₁ ≥ x₍₂₎ ≥ g₂ ≥ σ₂ ≥ … In particular ‖J_softmax‖₂ ≤ g₁(x) ≤ 1/2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def top_probabilities(p: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` largest entries along the last dim, descending, zero-padded if n < count."""
    n = p.shape[-1]
    top = p.topk(min(count, n), dim=-1).values
    return F.pad(top, (0, count - top.shape[-1])) if count > n else top


def g_k(p: torch.Tensor, k: int) -> torch.Tensor:
    """g_k of each row of ``p`` (last dim a probability vector), k ≥ 1; differentiable."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return g_k_of_top(top_probabilities(p, k + 1), k)


def g_k_of_top(top: torch.Tensor, k: int) -> torch.Tensor:
    """g_k from the (at least k+1) largest probabilities of each row, descending."""
    if k < 1 or top.shape[-1] < k + 1:
        raise ValueError(f"need k >= 1 and k+1 <= {top.shape[-1]} top probabilities; got k={k}")
    return g_of_pair(top[..., k - 1], top[..., k])


def g_of_pair(x_k: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
    """g_k = x₍ₖ₎ · (1 − x₍ₖ₎ + x₍ₖ₊₁₎) from the k-th and (k+1)-th largest probabilities themselves (elementwise)."""
    return x_k * (1.0 - x_k + x_next)


def softmax_jacobian(p: torch.Tensor) -> torch.Tensor:
    """M(p) = diag(p) − p pᵀ, shape (..., n, n): the Jacobian of softmax at output p."""
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def softmax_jacobian_norm(p: torch.Tensor) -> torch.Tensor:
    """‖diag(p) − ppᵀ‖₂ of each row p (...,): M(p) is symmetric positive semi-definite (the covariance of the one-hot
    vector drawn from p), so its spectral norm is its largest eigenvalue — a symmetric eigensolver, ≈ 10× faster than
    the SVD that ``matrix_norm(ord=2)`` runs (on the CPU, 1,024 rows of 65), equal to rounding."""
    return torch.linalg.eigvalsh(softmax_jacobian(p))[..., -1]
