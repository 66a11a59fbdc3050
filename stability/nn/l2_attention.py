"""L2 self-attention with tied queries and keys (Kim, Papamakarios & Mnih 2021, "The Lipschitz Constant of
Self-Attention"; docs/methods.md#l2-self-attention): globally Lipschitz, unlike dot-product attention.

For one head h of width d = D/H, on tokens X (N × D), with W_Q^h (D × d) the query map, tied to the key map:

    P^h_ij ∝ exp(−‖x_iᵀW_Q^h − x_jᵀW_Q^h‖² / √(D/H)),    f^h(X) = P^h · X · A_h · W_V^h,   A_h = W_Q^h W_Q^hᵀ / √(D/H),

and F(X) = [f¹(X), …, f^H(X)] · W_O. Their Theorem 3.2 bounds it in ℓ2 over the whole sequence, for every input:

    Lip₂(F) ≤ (√N / √(D/H)) · (4 φ⁻¹(N − 1) + 1) · √(Σ_h ‖W_Q^h‖₂⁴ ‖W_V^h‖₂²) · ‖W_O‖₂,

φ(x) = x·e^(x+1), so φ⁻¹(N − 1) = W₀((N − 1)/e) (Lambert's W), ≈ log N − log log N. The bound is checked here
against exact Jacobian norms (tests) and grows like √N·log N in the number of tokens, not with their size.

**Unit L2 attention** (``unit=True``): F divided by that bound at unit weight norms,
c_N = √(N·H/d)·(4 W₀((N − 1)/e) + 1) (‖W_Q^h‖ = ‖W_V^h‖ = ‖W_O‖ = 1 in the bound; N from the input). With
every σ₁ ≤ 1 — Muon's hard cap at σ_max = 1 on these square D × D matrices — the layer is 1-Lipschitz in ℓ2 over
the whole sequence by the theorem, on every input.

Computation: with q = X W_Q^h, the logits are −‖q_i‖²/√d + 2 q_i·q_j/√d − ‖q_j‖²/√d, and the first term is
constant along a softmax row, so P = softmax(2 q qᵀ/√d − ‖q_j‖²/√d) — a scaled dot product with an additive
bias, which the fused attention kernel takes; the values are X A_h W_V^h = q · (W_Q^hᵀ W_V^h) / √d.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.adapters import SplitQKV
from .norms import row_norms


def lambert_w0(x: float) -> float:
    """The principal branch of Lambert's W for x ≥ 0: the w ≥ 0 with w·eʷ = x (Halley's iteration)."""
    if x < 0:
        raise ValueError(f"lambert_w0 is defined here for x >= 0, got {x}")
    w = math.log1p(x)
    for _ in range(50):
        e = math.exp(w)
        f = w * e - x
        step = f / (e * (w + 1) - (w + 2) * f / (2 * w + 2))
        w -= step
        if abs(step) <= 1e-15 * max(1.0, abs(w)):
            break
    return w


def lambert_factor(tokens: int) -> float:
    """4·φ⁻¹(N − 1) + 1 with φ(x) = x·e^(x+1): 4·W₀((N − 1)/e) + 1 (Kim et al. 2021, Theorem 3.2)."""
    return 4 * lambert_w0((tokens - 1) / math.e) + 1


def unit_divisor(tokens: int, heads: int, head_dim: int) -> float:
    """c_N = √(N·H/d)·(4·W₀((N − 1)/e) + 1): Theorem 3.2's bound at ‖W_Q^h‖ = ‖W_V^h‖ = ‖W_O‖ = 1."""
    return math.sqrt(tokens * heads / head_dim) * lambert_factor(tokens)


def l2_attention_bound(tokens: int, head_dim: int, w_q: torch.Tensor, w_v: torch.Tensor,
                       w_o: torch.Tensor) -> torch.Tensor:
    """The ℓ2 Lipschitz bound of L2 multi-head attention on N = ``tokens`` tokens, from the spectral norms
    ‖W_Q^h‖ (H,), ‖W_V^h‖ (H,) and ‖W_O‖ (a scalar), as tensors (differentiable; their dtype); or of several blocks
    at once, (blocks, H) and (blocks,)."""
    spread = row_norms(w_q.pow(2) * w_v)  # a finite gradient at 0 too
    return math.sqrt(tokens) / math.sqrt(head_dim) * lambert_factor(tokens) * spread * w_o


class L2MultiHeadAttention(nn.Module):
    """L2 self-attention with W_K = W_Q, taking over the ``qkv`` and ``proj`` of a timm ViT ``Attention``: the
    fused projection is held as :class:`~stability.models.adapters.SplitQKV` whose ``k`` *is* its ``q`` (one
    module, one matrix), so constraints and optimizers see W_Q once. Follows the attention conventions of
    :mod:`stability.models.view` (``qkv``, ``proj``, ``num_heads``, ``fused_attn``, ``attn_drop``)."""

    def __init__(self, original: nn.Module, unit: bool = False) -> None:
        super().__init__()
        self.unit = unit  # divide by unit_divisor(N, H, d): 1-Lipschitz wherever every σ₁ ≤ 1
        if getattr(original, "kernel", None) is not None:
            raise ValueError(f"L2 attention replaces a plain ViT attention; this one computes its heads with "
                             f"{type(original.kernel).__name__} (set by another stabilizer)")
        self.num_heads = original.num_heads
        self.head_dim = original.qkv.out_features // (3 * self.num_heads)
        self.fused_attn = True
        qkv = original.qkv if isinstance(original.qkv, SplitQKV) else SplitQKV(original.qkv)
        qkv.k = qkv.q  # tied: the keys are the queries
        self.qkv, self.proj = qkv, original.proj
        self.attn_drop, self.proj_drop = original.attn_drop, original.proj_drop

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q = self.qkv.q(x).view(b, n, h, d).transpose(1, 2)  # (B, H, N, d)
        w_q = self.qkv.q.weight.view(h, d, -1)  # (H, d, D): rows of head h
        w_v = self.qkv.v.weight.view(h, d, -1)
        mixing = torch.einsum("hik,hjk->hij", w_q, w_v) / math.sqrt(d)  # (H, d, d) = W_Q^hᵀ W_V^h / √d
        values = torch.einsum("bhnd,hde->bhne", q, mixing)  # X A_h W_V^h
        bias = -(q.pow(2).sum(-1) / math.sqrt(d)).unsqueeze(-2)  # (B, H, 1, N): −‖q_j‖²/√d
        if self.fused_attn:
            out = F.scaled_dot_product_attention(q, q, values, attn_mask=bias.to(q.dtype), scale=2 / math.sqrt(d),
                                                 dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            logits = 2 / math.sqrt(d) * (q @ q.transpose(-2, -1)) + bias
            out = self.attn_drop(logits.softmax(dim=-1)) @ values
        out = self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, -1)))
        return out / unit_divisor(n, h, d) if self.unit else out
