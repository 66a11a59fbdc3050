"""Dot-product attention as a replaceable kernel, with the two practical stabilizers that act on its logits:

    P = softmax(cap(scale · n_q(q) · n_k(k)ᵀ) + B),      out = P·V,

* ``n_q``, ``n_k``: QK normalisation, a LayerNorm or RMSNorm over each head's d features (Dehghani et al. 2023,
  "Scaling Vision Transformers to 22 Billion Parameters", §2.1; timm's ``qk_norm``), Identity when off;
* ``cap``: logit soft-capping l ↦ c·tanh(l/c) (Gemma 2, Gemma Team 2024, §2), none when off;
* ``B``: the backbone's additive bias (Swin's relative-position bias and shift mask), added after the cap as
  Gemma 2 adds its mask after capping.

With both off it computes exactly the backbone's own attention. The capped path cannot use the fused SDPA
kernels (they take no elementwise map of the logits); on CUDA it runs on FlexAttention with the cap as its
``score_mod`` (:mod:`stability.nn.flex`), fused, where there is no additive bias and no attention dropout (ViT) and the
heads are at least 16 wide, and explicitly elsewhere (the CPU, whose FlexAttention has no backward; Swin's bias and
mask; narrower heads, which the compiled kernel refuses).

Under autocast the QK norms run in the queries' own (bf16) dtype, their statistics accumulated in float32 by the
kernel (:func:`norm_in_dtype`): autocast would run LayerNorm in float32, saving a float32 copy of q and k for the
backward and casting the result back to bf16 for the attention kernel — 1.14× a plain step's saved bytes, where
the bf16 norm adds only its normalised q and k. Before a fused kernel they normalise the queries and keys
token-major (:func:`token_major`), so that the kernel's output merges into the projection's input without a copy
(not where SDPA falls back to its math path: :func:`keeps_query_layout`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .flex import flex_accepts, flex_trains_on, softcapped_attention
from .precision import autocast_off


def norm_in_dtype(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` computed in x's dtype with autocast off, where ``norm`` is a LayerNorm or RMSNorm: the kernels
    accumulate the mean and variance in float32 and round only the output. Other modules are called as they are."""
    if isinstance(norm, nn.Identity) or x.dtype == torch.float32 or not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        return norm(x)
    weight = None if norm.weight is None else norm.weight.to(x.dtype)
    with autocast_off(x.device.type):
        if isinstance(norm, nn.LayerNorm):
            bias = None if norm.bias is None else norm.bias.to(x.dtype)
            return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
        return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)


def token_major(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for per-head x of shape (…, h, N, d) and a ``norm`` over the last dimension, computed on x's
    token-major view (…, N, h, d) and returned as the (…, h, N, d) view of its result. The same values; the result laid
    out as SDPA's flash-type kernels want it: they allocate their output in the query's layout (CUDA's cuDNN kernel,
    the default on an H100 or H200 with torch 2.11's cuDNN, by ``alloc_with_matching_layout``; CUDA's flash kernel and
    the CPU's by ``empty_like``), and their query gradient too, so a query normalised head-major makes the attention's
    output head-major, and its merge into the projection's (…, N, h·d) input a copy of the output, a kernel forward
    each step; token-major, that merge is a view, and the norm's backward reads the query gradient as it is. (CUDA's
    memory-efficient kernel writes its output token-major whatever the query's layout.) The strided view of the qkv
    projection costs the norm no more in this layout than in the other (its kernel copies a strided input into one
    contiguous in the shape it is given, either way)."""
    return norm(x.transpose(-3, -2)).transpose(-3, -2)


def keeps_query_layout(q: torch.Tensor, dropout_p: float, bias: torch.Tensor | None) -> bool:
    """Whether token-major queries pay here: whether SDPA runs a kernel that writes its output in q's layout (cuDNN's
    or a flash kernel) or one that writes token-major anyway (CUDA's memory-efficient kernel, float32's), not its math
    fallback, which multiplies head by head (copying token-major queries and keys first) and writes its output
    head-major whatever q's layout. The math fallback runs on the CPU with attention dropout (the CPU's flash kernel
    takes none) or with an additive bias that takes a gradient (Swin's learned relative-position bias, training: on
    CUDA the memory-efficient kernel takes it, token-major either way), and on CUDA in float64 (no fused kernel takes
    it). Never inside a compiled graph, where Inductor lays out its own buffers (the graph is as before)."""
    if torch.compiler.is_compiling() or (bias is not None and bias.requires_grad):
        return False
    return dropout_p == 0 if q.device.type == "cpu" else q.dtype != torch.float64


def norm_for_fused_attention(norm: nn.Module, x: torch.Tensor, token_major_layout: bool) -> torch.Tensor:
    """:func:`norm_in_dtype` of x for SDPA: a LayerNorm or RMSNorm computed token-major (:func:`token_major`) where
    ``token_major_layout`` (:func:`keeps_query_layout`); any other module as it is."""
    if not token_major_layout or not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        return norm_in_dtype(norm, x)
    return token_major(lambda t: norm_in_dtype(norm, t), x)


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
        logits = self.scale * (norm_in_dtype(self.q_norm, q) @ norm_in_dtype(self.k_norm, k).transpose(-2, -1))
        if self.logit_cap is not None:
            logits = soft_cap(logits, self.logit_cap)
        return logits if bias is None else logits + bias

    def uses_flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  attn_drop: nn.Dropout, fused: bool) -> bool:
        """The capped logits go through FlexAttention: fused requested, on CUDA, heads at least 16 wide (the
        narrowest the compiled kernel takes), no bias, no attention dropout."""
        dropout = self.training and attn_drop.p > 0
        return (fused and self.logit_cap is not None and flex_trains_on(q.device) and flex_accepts(q, k, v)
                and bias is None and not dropout)

    def forward(self, q, k, v, bias: torch.Tensor | None, attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        if self.uses_flex(q, k, v, bias, attn_drop, fused):
            q, k = norm_in_dtype(self.q_norm, q), norm_in_dtype(self.k_norm, k)
            return softcapped_attention(q, k, v.to(q.dtype), self.scale, self.logit_cap)
        if fused and self.logit_cap is None:
            dropout_p = attn_drop.p if self.training else 0.0
            layout = keeps_query_layout(q, dropout_p, bias)
            return F.scaled_dot_product_attention(norm_for_fused_attention(self.q_norm, q, layout),
                                                  norm_for_fused_attention(self.k_norm, k, layout), v,
                                                  attn_mask=bias, scale=self.scale, dropout_p=dropout_p)
        return attn_drop(self.logits(q, k, bias).softmax(dim=-1)) @ v
