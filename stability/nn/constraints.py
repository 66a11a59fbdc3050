"""Weight constraints of "Training Transformers with Enforced Lipschitz Constants"
(Newhouse et al. 2025; docs/methods.md#muon-and-weight-constraints), applied after every optimizer step.

All act on M = sqrt(d_in/d_out)·W, whose spectral norm is the RMS→RMS norm of W, and take a
target σ_max in those units. Each returns the new W.
"""
from __future__ import annotations

import numpy as np
import torch

from .spectral import rms_scale


def msign(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix sign U Vᵀ of M = U Σ Vᵀ (exact, by SVD; zero singular values map to zero)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    keep = (s > s.amax(-1, keepdim=True) * 1e-12).to(matrix.dtype) if s.numel() else s
    return (u * keep.unsqueeze(-2)) @ vh


def hard_cap(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """Spectral hard cap, W ↦ U·min(Σ, β)·Vᵀ in RMS units (β = σ_max), from one SVD.

    The paper computes the same map without an SVD, by the msign formula
    (:func:`hard_cap_msign_formula`, tested equal); with an exact msign that costs two SVDs, and
    the second, of βI − f(M)Mᵀ, has the repeated singular value β for every tall matrix, on which
    LAPACK's divide-and-conquer SVD can fail to converge."""
    scale = rms_scale(weight)
    u, s, vh = torch.linalg.svd(weight * scale, full_matrices=False)
    return (u * s.clamp_max(sigma_max).unsqueeze(-2)) @ vh / scale


def hard_cap_msign_formula(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """cap(M; β) = ½[β f(M) + M − f(βI − f(M)Mᵀ)(β f(M) − M)], f = msign (Newhouse et al. 2025)."""
    scale = rms_scale(weight)
    m = weight * scale
    f = msign(m)
    eye = torch.eye(m.shape[-2], dtype=m.dtype, device=m.device)
    capped = 0.5 * (sigma_max * f + m - msign(sigma_max * eye - f @ m.mT) @ (sigma_max * f - m))
    return capped / scale


def soft_cap_alpha(k: float, sigma_max: float) -> float:
    """Smallest α ≥ 0 with p_α(k) = σ_max, i.e. root of −k⁹α⁴ + 3k⁷α³ − 3k⁵α² + (k − σ_max) = 0.

    k bounds the norm a weight can reach in one step; 0 when k ≤ σ_max (nothing to cap)."""
    if k <= sigma_max:
        return 0.0
    roots = np.roots([-k ** 9, 3 * k ** 7, -3 * k ** 5, 0.0, k - sigma_max])
    real = sorted(r.real for r in roots if abs(r.imag) < 1e-9 * max(1.0, abs(r)) and r.real >= 0)
    if not real:
        raise ValueError(f"soft cap: no real α ≥ 0 for k={k}, sigma_max={sigma_max}")
    return float(real[0])


def soft_cap(weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """M ← M(I − αMᵀM), then M ← M(I + αMᵀM): σ ↦ σ − 3α²σ⁵ + 3α³σ⁷ − α⁴σ⁹ (matmuls only)."""
    if alpha == 0:
        return weight
    scale = rms_scale(weight)
    m = weight * scale
    m = m - alpha * m @ (m.mT @ m)
    m = m + alpha * m @ (m.mT @ m)
    return m / scale


def soft_cap_polynomial(sigma: torch.Tensor, alpha: float) -> torch.Tensor:
    return sigma - 3 * alpha ** 2 * sigma ** 5 + 3 * alpha ** 3 * sigma ** 7 - alpha ** 4 * sigma ** 9


def hammer(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """Spectral hammer: W ← W + (σ_max − σ₁) u₁v₁ᵀ in RMS units — the top singular value is *set* to
    σ_max, raised when below it (Newhouse et al. 2025). The others are untouched, so one above σ_max
    stays above it: the hammer was made for Adam's small steps, it is no cap."""
    scale = rms_scale(weight)
    u, s, vh = torch.linalg.svd(weight * scale, full_matrices=False)
    change = sigma_max - s[..., 0]
    return weight + change[..., None, None] * (u[..., :, :1] @ vh[..., :1, :]) / scale


def spectral_weight_decay(weight: torch.Tensor, strength: float) -> torch.Tensor:
    """Spectral weight decay: W ← W − λ·σ₁u₁v₁ᵀ, the top singular value shrunk by (1 − λ) and nothing
    else (the reference code's fifth method; per step, not scaled by the learning rate)."""
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    return weight - strength * s[..., :1, None] * (u[..., :, :1] @ vh[..., :1, :])


@torch.no_grad()
def orthogonal_rms_(weight: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Initialise in place to a random (semi-)orthogonal matrix scaled so that every RMS→RMS singular
    value is 1, i.e. ‖W‖_RMS = 1 (the reference Lipschitz transformer's initialisation)."""
    m, n = weight.shape
    gaussian = torch.randn(max(m, n), min(m, n), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # uniform over orthogonal matrices
    q = q if m >= n else q.T
    return weight.copy_(q * (m / n) ** 0.5)


def normalise(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """Spectral normalisation: W ← W / max(1, ‖W‖_RMS / σ_max)."""
    norms = torch.linalg.matrix_norm(weight, ord=2) * rms_scale(weight)  # one per matrix of a stack
    return weight / (norms / sigma_max).clamp_min(1.0)[..., None, None]


def rms_norm(weight: torch.Tensor) -> float:
    """‖W‖_RMS→RMS = sqrt(d_in/d_out)·σ₁(W)."""
    return float(torch.linalg.matrix_norm(weight.detach(), ord=2)) * rms_scale(weight)
