"""Dot-product attention as a replaceable kernel, with the two practical stabilizers that act on its logits:

    P = softmax(cap(scale · n_q(q) · n_k(k)ᵀ) + B),      out = P·V,

* ``n_q``, ``n_k``: QK normalisation, a LayerNorm or RMSNorm over each head's d features (Dehghani et al. 2023,
  "Scaling Vision Transformers to 22 Billion Parameters", §2.1; timm's ``qk_norm``), Identity when off;
* ``cap``: logit soft-capping l ↦ c·tanh(l/c) (Gemma 2, Gemma Team 2024, §2), none when off;
* ``B``: the backbone's additive bias (Swin's relative-position bias and shift mask), added after the cap as
  Gemma 2 adds its mask after capping.

With both off it computes exactly the backbone's own attention. The capped path cannot use the fused SDPA
kernels (they take no elementwise map of the logits), as in Gemma 2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """c·tanh(x/c): the identity near 0 (slope 1), bounded by ±c (Gemma 2's logit soft-capping)."""
    return cap * torch.tanh(x / cap)


class DotProductKernel(nn.Module):
    """softmax(cap(scale·n_q(q)·n_k(k)ᵀ) + B)·V on per-head tensors (B', h, N, d)."""

    def __init__(self, scale: float, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 logit_cap: float | None = None) -> None:
        super().__init__()
        if logit_cap is not None and logit_cap <= 0:
            raise ValueError(f"the attention logit cap must be > 0, got {logit_cap}")
        self.scale, self.logit_cap = float(scale), logit_cap
        self.q_norm = q_norm if q_norm is not None else nn.Identity()
        self.k_norm = k_norm if k_norm is not None else nn.Identity()

    def logits(self, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The softmax's input, (B', h, N, N)."""
        logits = self.scale * (self.q_norm(q) @ self.k_norm(k).transpose(-2, -1))
        if self.logit_cap is not None:
            logits = soft_cap(logits, self.logit_cap)
        return logits if bias is None else logits + bias

    def forward(self, q, k, v, bias: torch.Tensor | None, attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        if fused and self.logit_cap is None:
            return F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, attn_mask=bias, scale=self.scale,
                                                  dropout_p=attn_drop.p if self.training else 0.0)
        return attn_drop(self.logits(q, k, bias).softmax(dim=-1)) @ v
