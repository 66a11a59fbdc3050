"""Modules that wrap a backbone's own parts so a stabilizer can change how they compute.

* :class:`KernelAttention` / :class:`KernelWindowAttention` take over the ``qkv`` and ``proj`` of
  timm's ViT ``Attention`` / Swin ``WindowAttention`` and compute the heads with a replacement
  kernel ``kernel(q, k, v, bias, attn_drop, fused)`` (LipsFormer's scaled cosine attention, the
  Lipschitz transformer's (1/3)·softmax(s·QKᵀ/d)·V). CSwin takes a kernel natively.
* :class:`ConvexResidualBlock` computes a transformer block with convex residuals
  x ← (1 − a)·x + a·f(x) (Newhouse et al. 2025), bypassing the block's own additions and DropPath.
* :class:`SplitQKV` holds a fused qkv projection as three Linear layers; :class:`PatchLinear` computes
  a non-overlapping patch convolution as the Linear map patch → token.

They rely on timm internals (Swin blocks partition windows in a private ``_attn``); the tests in
``tests/test_compat.py`` fail by name when those change.
"""
from __future__ import annotations

import torch
from torch import nn


def heads_of(qkv: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, h, N, d) of a fused projection's output (B, N, 3·h·d): the views timm's
    ``reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4)`` gives, taken as ``unbind(2)`` of the (B, N, 3, h, d) view and
    each transposed. The same tensors; their gradients are gathered by one ``stack`` along dim 2, already laid out as
    the projection's output (B, N, 3·h·d), where timm's way stacks them head-major and copies the result back to the
    projection's layout: a pass over the qkv gradient fewer (counted in tests/test_adapters.py)."""
    b, n, _ = qkv.shape
    return tuple(part.transpose(1, 2) for part in qkv.reshape(b, n, 3, heads, head_dim).unbind(2))


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
        q, k, v = heads_of(self.qkv(x), self.num_heads, self.head_dim)
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
        q, k, v = heads_of(self.qkv(x), self.num_heads, self.head_dim)
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
    block or a CSwin block (whose own residual additions and DropPath are bypassed). Each combination is
    ``torch.add(a·f, x, alpha=1 − a)``: one pass over the float32 stream where (1 − a)·x + a·f took two (the scaled
    stream written, then read by the addition), one kernel fewer forward; the backward as before."""

    def __init__(self, block: nn.Module, a: float) -> None:
        super().__init__()
        if not 0 < a <= 1:
            raise ValueError(f"convex residual weight must be in (0, 1], got {a}")
        self.block, self.a = block, a

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        # Swin partitions and merges windows in its private _attn; ViT and CSwin blocks call attn directly
        attention = self.block._attn if hasattr(self.block, "_attn") else self.block.attn
        x = torch.add(self.a * attention(self.block.norm1(x)), x, alpha=1 - self.a)
        return torch.add(self.a * self.block.mlp(self.block.norm2(x)), x, alpha=1 - self.a)


class SplitQKV(nn.Module):
    """A fused qkv projection held as three Linear layers ``q``, ``k``, ``v`` (D → H·d each) that
    computes the same x ↦ [q(x) | k(x) | v(x)], so that an optimizer or a constraint treats W_Q, W_K
    and W_V as the separate matrices they are (Newhouse et al. 2025). ``weight`` and ``bias`` read
    as the fused ones (rows q | k | v), differentiably."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        if fused.out_features % 3:
            raise ValueError(f"a fused qkv projection has 3·H·d outputs; got {fused.out_features}")
        width = fused.out_features // 3
        self.in_features, self.out_features = fused.in_features, fused.out_features
        self.q, self.k, self.v = (nn.Linear(fused.in_features, width, bias=fused.bias is not None) for _ in range(3))
        with torch.no_grad():
            for i, part in enumerate((self.q, self.k, self.v)):
                part.weight.copy_(fused.weight[i * width:(i + 1) * width])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[i * width:(i + 1) * width])

    @property
    def weight(self) -> torch.Tensor:  # (3·H·d, D)
        return torch.cat([self.q.weight, self.k.weight, self.v.weight])

    @property
    def bias(self) -> torch.Tensor | None:
        if self.q.bias is None:
            return None
        return torch.cat([self.q.bias, self.k.bias, self.v.bias])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class PatchLinear(nn.Module):
    """A non-overlapping patch convolution (stride = kernel) as the Linear map it is, patch → token:
    ``linear`` takes each flattened C·p·p patch to a D-dimensional token, and the output keeps the
    convolution's (B, D, H/p, W/p) layout. Its σ₁ is the map's exact operator norm, so it can be
    constrained like every other matrix."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if tuple(conv.stride) != tuple(conv.kernel_size) or conv.padding not in ((0, 0), 0, "valid"):
            raise ValueError(f"only a non-overlapping, unpadded patch convolution is a patch-wise linear map; got "
                             f"kernel {conv.kernel_size}, stride {conv.stride}, padding {conv.padding}")
        self.kernel_size = tuple(conv.kernel_size)
        self.linear = nn.Linear(conv.in_channels * self.kernel_size[0] * self.kernel_size[1], conv.out_channels,
                                bias=conv.bias is not None)
        with torch.no_grad():
            self.linear.weight.copy_(conv.weight.reshape(conv.out_channels, -1))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        patches = nn.functional.unfold(x, self.kernel_size, stride=self.kernel_size)  # (B, C·p·p, L)
        tokens = self.linear(patches.transpose(1, 2))  # (B, L, D)
        return tokens.transpose(1, 2).reshape(b, -1, h // self.kernel_size[0], w // self.kernel_size[1])
