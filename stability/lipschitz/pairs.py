"""A lower bound of a network's global Lipschitz constant of its margins, found by gradient ascent on pairs of inputs
(GloRo's lower-bound tool, klasleino/gloro ``tools/lower_bounds``: Leino et al. 2021, Sec. 5.3), against which a
certificate's looseness is measured.

For a pair (x₁, x₂) and t the top class at x₁, each margin m_j(x) = z_t(x) − z_j(x) changes by

    |m_j(x₁) − m_j(x₂)| / ‖x₁ − x₂‖₂ ≤ K_tj,

K_tj the per-pair constant a certificate uses (L_h·‖w_t − w_j‖ with a linear head, √2·L otherwise): any pair found is a
proved *lower* bound of the margin's true Lipschitz constant, hence of every sound K. Both points move, by Adam on
−max_j of that ratio, inside the pixel box [0, 1]ⁿ (where the certified bounds hold), starting from a data point and a
small random move away from it; the largest ratio seen is kept. A certified bound below it would be no bound at all
(a test); the gap between them is what the certificate gives away.
"""
from __future__ import annotations

import torch
from torch import nn


def margin_lower_bound(network: nn.Module, images: torch.Tensor, steps: int = 200, lr: float = 1e-2,
                       start: float = 0.05, seed: int = 0, exact: nn.Module | None = None,
                       min_distance: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio (B,), pair classes (B, 2)): per starting point, the largest |Δ(z_t − z_j)|/‖x₁ − x₂‖ found and the class
    pair (t, j) it was found for. ``start``: the ℓ2 size of the random first move of x₂ (pixel units).

    Pairs closer than ``min_distance`` are not kept (their ratio would be rounding noise over a tiny distance). With
    ``exact`` (the float64 copy a certificate is computed on), the best pair of each point is evaluated again there
    and that ratio is returned, in float64: a lower bound of the very function the certificate bounds."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.enable_grad(), torch.inference_mode(False):
        x1 = images.detach().clone()
        noise = torch.randn(x1.shape, generator=gen, dtype=torch.float32, device="cpu").to(x1)
        x2 = (x1 + start * noise / noise.flatten(1).norm(dim=1).view(-1, *[1] * (x1.ndim - 1))).clamp(0, 1)
        x1, x2 = x1.requires_grad_(True), x2.requires_grad_(True)
        optimizer = torch.optim.Adam([x1, x2], lr=lr)
        best = x1.new_zeros(len(x1))
        pairs = torch.zeros(len(x1), 2, dtype=torch.long, device=x1.device)
        kept1, kept2 = x1.detach().clone(), x2.detach().clone()
        for _ in range(steps):
            z1, z2 = network(x1), network(x2)
            top = z1.detach().argmax(dim=-1, keepdim=True)
            distance = (x1 - x2).flatten(1).norm(dim=1)
            value, j = _largest_margin_ratio(z1, z2, top, distance.clamp_min(1e-12))
            better = (value.detach() > best) & (distance.detach() >= min_distance)
            best = torch.where(better, value.detach(), best)
            pairs = torch.where(better[:, None], torch.cat([top, j[:, None]], dim=-1), pairs)
            per_image = better.view(-1, *[1] * (x1.ndim - 1))
            kept1, kept2 = torch.where(per_image, x1.detach(), kept1), torch.where(per_image, x2.detach(), kept2)
            x1.grad, x2.grad = torch.autograd.grad(-value.sum(), [x1, x2])  # the network's own gradients untouched
            optimizer.step()
            with torch.no_grad():
                x1.clamp_(0, 1)
                x2.clamp_(0, 1)
    if exact is None:
        return best, pairs
    return _evaluated_in(exact, kept1, kept2, best > 0)


def _largest_margin_ratio(z1: torch.Tensor, z2: torch.Tensor, top: torch.Tensor, distance: torch.Tensor):
    """(value, j): max_j |(z_t − z_j)(x₁) − (z_t − z_j)(x₂)| / ‖x₁ − x₂‖ per point, and the j attaining it (the
    ratio is 0 at j = t)."""
    margins1 = z1.gather(-1, top) - z1  # (B, K): z_t − z_j at x₁
    margins2 = z2.gather(-1, top) - z2
    return ((margins1 - margins2).abs() / distance[:, None]).max(dim=-1)


@torch.no_grad()
def _evaluated_in(network: nn.Module, x1: torch.Tensor, x2: torch.Tensor, found: torch.Tensor):
    """max_j |Δ(z_t − z_j)|/‖x₁ − x₂‖ of kept pairs, in the network's dtype (float64 for a certificate's copy); 0 where
    no pair was kept."""
    dtype = next(network.parameters()).dtype
    x1, x2 = x1.to(dtype), x2.to(dtype)
    z1, z2 = network(x1), network(x2)
    top = z1.argmax(dim=-1, keepdim=True)
    value, j = _largest_margin_ratio(z1, z2, top, (x1 - x2).flatten(1).norm(dim=1).clamp_min(torch.finfo(dtype).tiny))
    return torch.where(found, value, torch.zeros_like(value)), torch.cat([top, j[:, None]], dim=-1)


def certified_pair_constants(bound, num_classes: int) -> torch.Tensor:
    """(K, K) float64: K_ij of a certified :class:`~stability.lipschitz.certified.Bound` (per pair where it has a
    linear head, else √2·L off the diagonal)."""
    if bound.head_weight is not None and bound.features is not None:
        w = bound.head_weight.detach().double().cpu()
        return torch.cdist(w, w, compute_mode="donot_use_mm_for_euclid_dist") * bound.features
    return (1 - torch.eye(num_classes, dtype=torch.float64)) * (2 ** 0.5) * bound.value


__all__ = ["certified_pair_constants", "margin_lower_bound"]
