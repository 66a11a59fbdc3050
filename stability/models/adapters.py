"""Modules that wrap a backbone's own parts so a stabilizer can change how they compute.

* :class:`KernelAttention` / :class:`KernelWindowAttention` take over the ``qkv`` and ``proj`` of
  timm's ViT ``Attention`` / Swin ``WindowAttention`` and compute the heads with a replacement
  kernel ``kernel(q, k, v, bias, attn_drop, fused)`` (LipsFormer's scaled cosine attention, the
  Lipschitz transformer's (1/3)·softmax(s·QKᵀ/d)·V). CSwin takes a kernel natively.
* :class:`ConvexResidualBlock` computes a transformer block with convex residuals
  x ← (1 − a)·x + a·f(x) (Newhouse et al. 2025), bypassing the block's own additions and DropPath.

They rely on timm internals (Swin blocks partition windows in a private ``_attn``); the tests in
``tests/test_compat.py`` fail by name when those change.
"""
from __future__ import annotations

import torch
from torch import nn


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
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




class ConvexResidualBlock(nn.Module):
    """x ← (1 − a)·x + a·attn(norm1(x)); x ← (1 − a)·x + a·mlp(norm2(x)), for a timm ViT / Swin
    block or a CSwin block (whose own residual additions and DropPath are bypassed)."""

    def __init__(self, block: nn.Module, a: float) -> None:
        super().__init__()
        if not 0 < a <= 1:
            raise ValueError(f"convex residual weight must be in (0, 1], got {a}")
        self.block, self.a = block, a

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        # Swin partitions and merges windows in its private _attn; ViT and CSwin blocks call attn directly
        attention = self.block._attn if hasattr(self.block, "_attn") else self.block.attn
        x = (1 - self.a) * x + self.a * attention(self.block.norm1(x))
        return (1 - self.a) * x + self.a * self.block.mlp(self.block.norm2(x))
