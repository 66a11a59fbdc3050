"""Attention diagnostics per layer and head (JaSMin, Yudin et al. 2025; docs/methods.md#jasmin):

* ``g1_mean``, ``g1_max`` — g₁ of the attention rows (an upper bound of each row's softmax-Jacobian
  norm, Theorem 4);
* ``softmax_jac_mean``, ``softmax_jac_max`` — the exact ‖diag(p) − ppᵀ‖₂ on the first ``sample_rows``
  rows of each point, to show g₁'s tightness (``g1_sample_max`` ≥ it, row by row);
* ``entropy`` — mean −Σ p log p of the rows;
* ``theorem3_max`` — the local bound of one dot-product head at the measured inputs (Theorem 3),
  ‖W_V‖₂(‖P‖₂ + 2‖X‖₂²‖A_h‖₂ max_i g₁(P_i)), A_h = W_Q W_Kᵀ/√d, maximised over samples
  (images, or windows for Swin). Only for dot-product heads without q/k/v bias on plain token
  sequences (ViT, Swin); CSwin's stripes with LePE and replaced attention kernels have none.

Everything is computed per point (:func:`point_statistics`), so that points can be measured on
several processes and pooled afterwards (:func:`pool`): means of per-point means (every point has
the same number of rows) and maxima of per-point maxima.
"""
from __future__ import annotations

import torch
from timm.layers import Attention as TimmAttention
from timm.models.swin_transformer import WindowAttention
from torch import nn

from ..models import attention_sites, capture_attention
from ..nn.precision import accumulation_dtype
from ..nn.softmax_bounds import g_k, softmax_jacobian_norm

MEAN_STATISTICS = ("g1_mean", "softmax_jac_mean", "entropy")


def point_statistics(network: nn.Module, images: torch.Tensor,
                     sample_rows: int = 16) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer: {statistic: (B, H)}}`` per point and head at ``images``, plus ``g1_rows``
    (B, H, rows): g₁ of every row of each point (for histograms)."""
    backbone = network.backbone
    sites = attention_sites(backbone)
    inputs: dict[nn.Module, torch.Tensor] = {}
    handles = [s.module.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0].detach()))
               for s in sites]
    try:
        with torch.no_grad(), capture_attention(backbone) as probs:
            network(images)
    finally:
        for h in handles:
            h.remove()
    results = {}
    calls = iter(probs)
    batch = images.shape[0]
    for site in sites:
        branches = len(getattr(site.module, "stripes", [None]))  # CSwin: one call per stripe direction
        p = torch.cat([next(calls) for _ in range(branches)], dim=1) if branches > 1 else next(calls)
        results[site.name] = head_statistics(p, batch, sample_rows)
        bound = theorem3_bound(site, inputs.get(site.module), p, batch)
        if bound is not None:
            results[site.name]["theorem3_max"] = bound
    return results


def head_statistics(p: torch.Tensor, batch: int, sample_rows: int) -> dict[str, torch.Tensor]:
    """Statistics of attention maps p (B·W, H, N, N) — W windows or stripes per image — per image and
    head, each (B, H); ``g1_rows`` (B, H, W·N)."""
    heads, n = p.shape[1], p.shape[-1]
    rows = p.reshape(batch, -1, heads, n, n).transpose(1, 2).reshape(batch, heads, -1, n)  # (B, H, W·N, N)
    g1 = g_k(rows, 1)  # (B, H, W·N)
    sample = rows[:, :, :sample_rows]
    exact = softmax_jacobian_norm(sample.double()).to(accumulation_dtype(p.dtype))
    entropy = -(rows * rows.clamp_min(1e-12).log()).sum(-1)
    return {"g1_mean": g1.mean(-1), "g1_max": g1.amax(-1), "softmax_jac_mean": exact.mean(-1),
            "softmax_jac_max": exact.amax(-1), "g1_sample_max": g1[..., :sample_rows].amax(-1),
            "entropy": entropy.mean(-1), "g1_rows": g1}


def theorem3_bound(site, x: torch.Tensor | None, p: torch.Tensor, batch: int) -> torch.Tensor | None:
    """JaSMin Theorem 3 per image and head (maximised over an image's windows), (B, H); None where it
    does not apply."""
    module = site.module
    if x is None or type(module) not in (TimmAttention, WindowAttention) or module.qkv.bias is not None:
        return None
    if getattr(module, "q_norm", nn.Identity()).__class__ is not nn.Identity:
        return None
    d = site.head_dim
    bounds = []
    x_norm_sq = torch.linalg.matrix_norm(x.double(), ord=2).pow(2)  # (B',)
    p_norm = torch.linalg.matrix_norm(p.double(), ord=2)  # (B', H)
    g1_max = g_k(p.double(), 1).amax(-1)  # (B', H)
    for h in range(site.num_heads):
        w_q, w_k, w_v = (site.head_weight(part, h).detach().double() for part in "qkv")
        a_norm = torch.linalg.matrix_norm(w_q.T @ w_k / d ** 0.5, ord=2)
        v_norm = torch.linalg.matrix_norm(w_v, ord=2)
        per_sample = v_norm * (p_norm[:, h] + 2 * x_norm_sq * a_norm * g1_max[:, h])  # (B',)
        bounds.append(per_sample.view(batch, -1).amax(-1))
    return torch.stack(bounds, dim=-1).to(accumulation_dtype(p.dtype))  # (B, H)


def pool(per_point: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-head values over all points, (H,) each: means of the ``*_mean`` statistics and the
    entropy, maxima of the others (``g1_rows`` is left out)."""
    return {stat: values.mean(0) if stat in MEAN_STATISTICS else values.amax(0)
            for stat, values in per_point.items() if stat != "g1_rows"}


def attention_diagnostics(network: nn.Module, images: torch.Tensor,
                          sample_rows: int = 16) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer_name: {statistic: tensor of shape (heads,)}}`` pooled over ``images``."""
    return {layer: pool(stats) for layer, stats in point_statistics(network, images, sample_rows).items()}
