"""Scaled cosine similarity attention, SCSA (LipsFormer, Qi et al. 2023, Eq. 6; METHODS.md §1):

    q̂_i = q_i / sqrt(‖q_i‖² + ε)  (same for k, and v when ``normalize_v``)
    SCSA = ν · softmax(τ Q̂ K̂ᵀ + B) V̂,       multi-head output scaled by 1/K (K heads)

B is a constant additive bias (Swin's relative position bias and shift mask; none for ViT).
ε > 0 makes it Lipschitz; Theorem 1 bounds one head (ℓ2, N tokens):

    Lip ≤ 2N(N−1)ντ ε^{-1/2} ‖W_K‖₂ + 2(N−1)ντ ε^{-1/2} ‖W_Q‖₂ + 2Nν ε^{-1/2} ‖W_V‖₂.

Reference-code variant (IDEA-Research/LipsFormer): τ fixed, V not normalised, no 1/K.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class ScaledCosineKernel(nn.Module):
    """softmax(τ Q̂K̂ᵀ + B)·V̂·ν/K on per-head tensors (B', h, N, d); τ and ν learnable or fixed."""

    def __init__(self, num_heads: int, tau: float = 10.0, nu: float = 1.0, eps: float = 1e-6,
                 normalize_v: bool = True, learn_scales: bool = True, head_scale: bool = True) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"scaled cosine attention needs eps > 0 to be Lipschitz, got {eps}")
        self.eps, self.normalize_v = eps, normalize_v
        self.head_factor = 1.0 / num_heads if head_scale else 1.0
        tau_t, nu_t = torch.tensor(float(tau)), torch.tensor(float(nu))
        if learn_scales:
            self.tau, self.nu = nn.Parameter(tau_t), nn.Parameter(nu_t)
        else:
            self.register_buffer("tau", tau_t)
            self.register_buffer("nu", nu_t)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps)

    def forward(self, q, k, v, bias: Optional[torch.Tensor], attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        q, k = self.normalize(q), self.normalize(k)
        if self.normalize_v:
            v = self.normalize(v)
        if fused:
            out = F.scaled_dot_product_attention(self.tau * q, k, v, attn_mask=bias, scale=1.0,
                                                 dropout_p=attn_drop.p if self.training else 0.0)
        else:
            logits = self.tau * (q @ k.transpose(-2, -1))
            if bias is not None:
                logits = logits + bias
            out = attn_drop(logits.softmax(dim=-1)) @ v
        return out * (self.nu * self.head_factor)


def scsa_lipschitz_bound(n_tokens: int, tau: float, nu: float, eps: float, w_q: float, w_k: float,
                         w_v: float) -> float:
    """Theorem 1 of LipsFormer: ℓ2 Lipschitz bound of one SCSA head from ‖W_Q‖₂, ‖W_K‖₂, ‖W_V‖₂."""
    n, c = n_tokens, nu / math.sqrt(eps)
    return 2 * n * (n - 1) * tau * c * w_k + 2 * (n - 1) * tau * c * w_q + 2 * n * c * w_v


class KernelAttention(nn.Module):
    """Replacement of timm's ViT ``Attention`` computing heads with ``kernel`` (e.g. SCSA); takes over
    its qkv and proj layers."""

    def __init__(self, original: nn.Module, kernel: nn.Module) -> None:
        super().__init__()
        self.num_heads = original.num_heads
        self.head_dim = original.qkv.out_features // (3 * self.num_heads)
        self.fused_attn = True
        self.qkv, self.proj = original.qkv, original.proj
        self.attn_drop, self.proj_drop = original.attn_drop, original.proj_drop
        self.kernel = kernel

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = self.kernel(q, k, v, attn_mask, self.attn_drop, self.fused_attn)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, -1)))


class KernelWindowAttention(nn.Module):
    """Replacement of timm's Swin ``WindowAttention`` computing heads with ``kernel``; keeps the
    relative position bias (a constant additive bias of the logits)."""

    def __init__(self, original: nn.Module, kernel: nn.Module) -> None:
        super().__init__()
        self.num_heads = original.num_heads
        self.head_dim = original.qkv.out_features // (3 * self.num_heads)
        self.window_area = original.window_area
        self.fused_attn = True
        self.qkv, self.proj = original.qkv, original.proj
        self.attn_drop, self.proj_drop = original.attn_drop, original.proj_drop
        self.relative_position_bias_table = original.relative_position_bias_table
        self.register_buffer("relative_position_index", original.relative_position_index, persistent=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(n, n, -1).permute(2, 0, 1).unsqueeze(0)  # (1, h, N, N)
        if mask is not None:
            windows = mask.shape[0]
            bias = (bias.unsqueeze(0) + mask.view(1, windows, 1, n, n)).expand(b // windows, -1, -1, -1, -1)
            bias = bias.reshape(b, self.num_heads, n, n)
        out = self.kernel(q, k, v, bias.to(q.dtype), self.attn_drop, self.fused_attn)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, -1)))


class LipschitzDotKernel(nn.Module):
    """(1/3)·softmax(s·QKᵀ/d + B)·V per head: the attention of Newhouse et al.'s Lipschitz
    transformer (1/d instead of 1/√d; the 1/3 sits before W_O). METHODS.md §4."""

    def __init__(self, head_dim: int, s: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.s = head_dim, s

    def forward(self, q, k, v, bias, attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        scale = self.s / self.head_dim
        if fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                                 dropout_p=attn_drop.p if self.training else 0.0)
        else:
            logits = scale * (q @ k.transpose(-2, -1))
            if bias is not None:
                logits = logits + bias
            out = attn_drop(logits.softmax(dim=-1)) @ v
        return out / 3.0
