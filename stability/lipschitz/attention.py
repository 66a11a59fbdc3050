"""Attention diagnostics per layer and head (JaSMin, Yudin et al. 2025; docs/methods.md#jasmin):

* ``g1_mean``, ``g1_max`` — g₁ of the attention rows (an upper bound of each row's softmax-Jacobian
  norm, Theorem 4);
* ``softmax_jac_mean``, ``softmax_jac_max`` — the exact ‖diag(p) − ppᵀ‖₂ on a sample of rows, to
  show g₁'s tightness (g₁ ≥ it, row by row);
* ``entropy`` — mean −Σ p log p of the rows;
* ``theorem3_max`` — the local bound of one dot-product head at the measured inputs (Theorem 3),
  ‖W_V‖₂(‖P‖₂ + 2‖X‖₂²‖A_h‖₂ max_i g₁(P_i)), A_h = W_Q W_Kᵀ/√d, maximised over samples
  (images, or windows for Swin). Only for dot-product heads without q/k/v bias on plain token
  sequences (ViT, Swin); CSwin's stripes with LePE and replaced attention kernels have none.
"""
from __future__ import annotations

import torch
from timm.layers import Attention as TimmAttention
from timm.models.swin_transformer import WindowAttention
from torch import nn

from ..models import attention_sites, capture_attention
from ..nn.softmax_bounds import g_k, softmax_jacobian


def attention_diagnostics(network: nn.Module, images: torch.Tensor,
                          sample_rows: int = 16) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer_name: {statistic: tensor of shape (heads,)}}`` at ``images``."""
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
    for site in sites:
        branches = len(getattr(site.module, "stripes", [None]))  # CSwin: one call per stripe direction
        p = torch.cat([next(calls) for _ in range(branches)], dim=1) if branches > 1 else next(calls)
        results[site.name] = head_statistics(p, sample_rows)
        bound = theorem3_bound(site, inputs.get(site.module), p)
        if bound is not None:
            results[site.name]["theorem3_max"] = bound
    return results


def head_statistics(p: torch.Tensor, sample_rows: int) -> dict[str, torch.Tensor]:
    """Statistics of attention maps p (B', H, N, N), one value per head."""
    rows = p.transpose(0, 1).reshape(p.shape[1], -1, p.shape[-1])  # (H, B'·N, N)
    g1 = g_k(rows, 1)
    sample = rows[:, :sample_rows]
    exact = torch.linalg.matrix_norm(softmax_jacobian(sample.double()), ord=2).float()  # (H, rows)
    entropy = -(rows * rows.clamp_min(1e-12).log()).sum(-1)
    return {"g1_mean": g1.mean(-1), "g1_max": g1.amax(-1), "softmax_jac_mean": exact.mean(-1),
            "softmax_jac_max": exact.amax(-1), "g1_sample_max": g1[:, :sample_rows].amax(-1),
            "entropy": entropy.mean(-1)}


def theorem3_bound(site, x: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor | None:
    """JaSMin Theorem 3 per head, maximised over samples; None where it does not apply."""
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
        per_sample = v_norm * (p_norm[:, h] + 2 * x_norm_sq * a_norm * g1_max[:, h])
        bounds.append(per_sample.max())
    return torch.stack(bounds).float()
