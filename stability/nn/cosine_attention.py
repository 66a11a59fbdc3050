"""Scaled cosine similarity attention, SCSA (LipsFormer, Qi et al. 2023, Eq. 6; docs/methods.md#lipsformer):

    q̂_i = q_i / sqrt(‖q_i‖² + ε)  (same for k, and v when ``normalize_v``)
    SCSA = ν · softmax(τ Q̂ K̂ᵀ + B) V̂,       multi-head output scaled by 1/K (K heads)

B is a constant additive bias (Swin's relative position bias and shift mask; none for ViT).
ε > 0 makes it Lipschitz; Theorem 1 bounds one head (ℓ2, N tokens):

    Lip ≤ 2N(N−1)ντ ε^{-1/2} ‖W_K‖₂ + 2(N−1)ντ ε^{-1/2} ‖W_Q‖₂ + 2Nν ε^{-1/2} ‖W_V‖₂.

Reference-code variant (IDEA-Research/LipsFormer): τ fixed, V not normalised, no 1/K.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .dot_attention import keeps_query_layout, token_major
from .precision import accumulation_dtype, autocast_off


def fused_norm_on(device: torch.device) -> bool:
    """Whether torch runs RMSNorm on ``device`` as a fused kernel (CUDA's ``_fused_rms_norm``): elsewhere it is a
    composite, slower than the normalisation spelled out (1.5-1.8× on the CPU, forward and backward)."""
    return device.type == "cuda"


def takes_fused_norm(x: torch.Tensor) -> bool:
    """Whether the normalisation of ``x`` runs as the fused RMSNorm: where the device has the kernel
    (:func:`fused_norm_on`), and never inside a compiled graph, where Inductor fuses the spelled-out formula into
    fewer kernels than it makes of RMSNorm with a scale as its weight and the contiguous copy its input needs (ViT-S's
    compiled LipsFormer network: 634 against 694 launches in the Triton program written for an H200,
    ``benchmarks/compiled_kernels.py``)."""
    return fused_norm_on(x.device) and not torch.compiler.is_compiling()


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

    def unit(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """√d · x/√(‖x‖² + ε) over the last dimension (width d), times ``scale`` where given, in x's dtype: RMSNorm
        with ε/d, the same formula (x/√(‖x‖²/d + ε/d)), the scale as its weight. CUDA runs it as one fused kernel
        forward and one backward, and one more for the weight's gradient (torch's ``_fused_rms_norm``: ‖x‖² accumulated
        in float32 at least, a float64 network stays float64; the scale's gradient from the weight's), where the sum of
        squares spelled out took a product, a sum, a float32 copy for the backward and five passes back; and a
        scale applied to the output would keep that output for its own gradient."""
        width = x.shape[-1]
        # in x's dtype (CUDA's fused kernel takes no other) and contiguous (it would copy a strided one each way)
        weight = None if scale is None else scale.expand(width).to(x.dtype).contiguous()
        with autocast_off(x.device.type):  # in x's dtype: torch 2.14's CUDA autocast would run it in float32
            # contiguous: the attention's q, k and v are strided views of one projection, which CUDA's kernel would
            # copy in the forward and again in the backward; one copy here serves both
            return F.rms_norm(x.contiguous(), (width,), weight, eps=self.eps / width)

    def normalize(self, x: torch.Tensor, scale: torch.Tensor | None = None, for_fused: bool = False) -> torch.Tensor:
        """scale · x/√(‖x‖² + ε), in x's dtype: :meth:`unit` with ``scale``/√d where a fused RMSNorm kernel runs it
        (:func:`takes_fused_norm`), token-major where the result goes to a fused attention kernel (``for_fused``:
        :func:`~stability.nn.dot_attention.token_major`, its output then merges into the projection's input without
        a copy); elsewhere spelled out, ‖x‖² summed in at least float32 and at least x's dtype from x·x (autocast would
        square x in float32 and keep that copy for the backward), the scale on the (…, 1) factor, not on x (its
        output takes x's layout: token-major for the projection's views)."""
        if takes_fused_norm(x):
            factor = 1.0 / math.sqrt(x.shape[-1])
            return self._unit_laid_out(x, x.new_full((), factor) if scale is None else scale * factor, for_fused)
        factor = torch.rsqrt((x * x).sum(-1, keepdim=True, dtype=accumulation_dtype(x.dtype)) + self.eps)
        if scale is not None:
            factor = factor * scale
        return x * factor.to(x.dtype)

    def scaled_queries_and_keys(self, q: torch.Tensor, k: torch.Tensor,
                                for_fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys whose product is τ·q̂k̂ᵀ: with a fused RMSNorm (τ/d · unit(q), unit(k)), both 1/√d
        factors and τ riding on the queries' norm, token-major for a fused attention kernel (``for_fused``, as in
        :meth:`normalize`); else (τ·q̂, k̂)."""
        if takes_fused_norm(q):
            return (self._unit_laid_out(q, self.tau / q.shape[-1], for_fused),
                    self._unit_laid_out(k, None, for_fused))
        return self.normalize(q, self.tau), self.normalize(k)

    def _unit_laid_out(self, x: torch.Tensor, scale: torch.Tensor | None, token_major_layout: bool) -> torch.Tensor:
        """:meth:`unit`, token-major where ``token_major_layout`` (:func:`~stability.nn.dot_attention.token_major`)."""
        if token_major_layout:
            return token_major(lambda t: self.unit(t, scale), x)
        return self.unit(x, scale)

    def logits(self, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The softmax's input τ·q̂k̂ᵀ + B, (B', h, N, N)."""
        queries, keys = self.scaled_queries_and_keys(q, k)
        logits = queries @ keys.transpose(-2, -1)
        return logits if bias is None else logits + bias

    def forward(self, q, k, v, bias: torch.Tensor | None, attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        # ν/K is folded into the values (attention is linear in them) and τ into the queries: each scale multiplies a
        # number, so the fused kernel gets its three inputs and nothing else is kept for the backward
        out_scale = self.nu * self.head_factor
        dropout_p = attn_drop.p if self.training else 0.0
        layout = fused and keeps_query_layout(q, dropout_p, bias)
        v = self.normalize(v, out_scale, for_fused=layout) if self.normalize_v else v * out_scale.to(v.dtype)
        if fused:
            queries, keys = self.scaled_queries_and_keys(q, k, for_fused=layout)
            return F.scaled_dot_product_attention(queries, keys, v, attn_mask=bias, scale=1.0, dropout_p=dropout_p)
        return attn_drop(self.logits(q, k, bias).softmax(dim=-1)) @ v


def scsa_lipschitz_bound(n_tokens: int, tau: float, nu: float, eps: float, w_q: float, w_k: float,
                         w_v: float) -> float:
    """Theorem 1 of LipsFormer: ℓ2 Lipschitz bound of one SCSA head from ‖W_Q‖₂, ‖W_K‖₂, ‖W_V‖₂."""
    n, c = n_tokens, nu / math.sqrt(eps)
    return 2 * n * (n - 1) * tau * c * w_k + 2 * (n - 1) * tau * c * w_q + 2 * n * c * w_v
