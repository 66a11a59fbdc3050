"""Certified robust accuracy from a certified Lipschitz bound (docs/methods.md#certified-robustness).

With L an ℓ2 Lipschitz bound of the input→logits map z, the margin z_y − z_j of a correctly
classified point x changes by at most √2·L·‖δ‖ under a perturbation δ (|Δz_y − Δz_j| ≤ √2‖Δz‖), so
x is certified at every radius below

    r(x) = (z_y − max_{j≠y} z_j) / (√2·L)                                    (Tsuzuku et al. 2018)

Where the logits are a final linear layer z = W h + b of features h with an ℓ2 bound L_h of
input→h, the pair (y, j) margin changes by at most ‖W_y − W_j‖·L_h·‖δ‖, which gives the radius
min_{j≠y} (z_y − z_j)/(‖W_y − W_j‖·L_h); the larger of the two radii is certified. A misclassified
point has radius 0. An ℓ∞ budget ε is certified through ‖δ‖₂ ≤ √n·‖δ‖∞ (n pixels).

A bound that holds only on the image domain [0, 1]ⁿ certifies perturbations that stay in it,
which is the threat model of every attack here (attacked images are clipped to [0, 1]).

A certificate is a bound, so rounding may only make it smaller: the monitors compute the bound and the logits in
float64 from a float64 copy of the network (whose float32 weights it holds exactly), and :func:`certified_radii`
enlarges the bound and shrinks every margin by ``ROUNDING`` (relative; float64 rounds by 1.1e-16 an operation, and a
forward pass or a composed bound here takes a few thousand operations in a row at most).
"""
from __future__ import annotations

import math

import torch

from ..lipschitz.certified import Bound

ROUNDING = 1e-9  # relative slack for float64 rounding of the bound and of the logits


def certified_radii(logits: torch.Tensor, labels: torch.Tensor, bound: Bound) -> torch.Tensor:
    """(B,) float64: the ℓ2 radius each point is certified at (0 where misclassified), rounded down: margins less
    ``ROUNDING``·max|z|, the bound times 1 + ``ROUNDING``. Give float64 logits (a float64 network's) for a certificate
    that holds to the last bit: float32 logits round by ≈ 6e-8·|z|, beyond the slack."""
    z = logits.detach().double()
    slack = ROUNDING * z.abs().amax(1)  # (B,)
    true = z.gather(1, labels[:, None]).squeeze(1)
    others = z.scatter(1, labels[:, None], -math.inf)
    margin = true - others.amax(1)  # (B,)
    lipschitz = bound.value * (1 + ROUNDING)
    radius = (margin - slack) / (math.sqrt(2) * lipschitz) if bound.value > 0 else torch.full_like(margin, math.inf)
    if bound.head_weight is not None and bound.features is not None:
        w = bound.head_weight.detach().double().to(z.device)  # (K, F)
        pair_norms = torch.cdist(w, w, compute_mode="donot_use_mm_for_euclid_dist")[labels]  # (B, K): ‖W_y − W_j‖
        gaps = true[:, None] - z - slack[:, None]  # (B, K): z_y − z_j, rounded down
        pair = gaps / (pair_norms * bound.features * (1 + ROUNDING))
        pair = pair.scatter(1, labels[:, None], math.inf).amin(1)
        radius = torch.maximum(radius, pair)
    return torch.where(margin > 0, radius, torch.zeros_like(radius)).clamp_min(0)


def l2_radius(norm: str, eps: float, input_size: int) -> float:
    """The ℓ2 radius that certifies a budget ε in ``norm`` (ℓ∞: √n·ε; ℓ2: ε)."""
    if norm == "L2":
        return eps
    if norm == "Linf":
        return math.sqrt(input_size) * eps
    raise ValueError(f"certification is implemented for the L2 and Linf norms, not {norm!r}")


def certified_at(radii: torch.Tensor, radius: float) -> torch.Tensor:
    """(B,) bool: certified at ``radius`` (strictly inside the certified ball; radius 0 = correct)."""
    return radii > radius if radius > 0 else radii > 0
