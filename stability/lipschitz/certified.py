"""Certified global ℓ2 Lipschitz upper bounds by composition, from the measured weights.

Implemented for the ViT backbone (timm ``VisionTransformer``) when every factor is bounded:

    Lip(f) ≤ (1/min σ_pixel) · ‖patch conv‖ · Π_blocks Lip(block) · Lip(final norm) · ‖W_head‖

* the patch embedding has stride = kernel (non-overlapping patches), so its operator norm is σ₁
  of the reshaped kernel exactly; position embeddings and the class token are constants;
* a pre-norm residual branch x + α ⊙ f(N(x)) has Lip ≤ 1 + max|α|·Lip(f)·Lip(N) (LipsFormer,
  Theorem 2), with N CenterNorm (D/(D−1)·max|γ|) or Identity — LayerNorm has no global bound;
* scaled cosine attention: one head by LipsFormer's Theorem 1 (with the learned τ, ν and the
  per-head ‖W_Q‖, ‖W_K‖, ‖W_V‖), heads concatenated (√(Σ L_h²)), times the 1/K head scale
  and ‖W_O‖ — dot-product attention has no global bound;
* MLP: ‖W_2‖ · Lip(act) · ‖W_1‖ with Lip(GELU) = 1.1289…;
* pooling (class token or mean) is 1-Lipschitz in the Frobenius norm over tokens.

For Newhouse et al.'s Lipschitz transformer (``muon`` with ``lipschitz_transformer``: no norms,
convex residuals x ← (1−a)x + a·f(x), heads (1/3)·softmax(s·QKᵀ/d)·V, GELU/1.1289) dot-product
attention is Lipschitz only on bounded inputs, so the bound holds on the image domain [0, 1]ⁿ:
a per-token norm bound r is propagated from the pixel box (embedding: ‖W_e‖·max‖patch‖ +
‖b_e + pos_i‖; attention: ‖W_O‖·⅓·√Σ_h(‖W_V^h‖r + ‖b_V^h‖)² + ‖b_O‖; MLP: ‖W₂‖(‖W₁‖r + ‖b₁‖) +
‖b₂‖; residual (1−a)r + a·r_f), and one head on {X : ‖x_i‖ ≤ r} has

    Lip_h ≤ √N‖W_V‖ + (s·N / 2d)·r_v·(‖W_K‖·r_q + ‖W_Q‖·r_k),   r_• = ‖W_•‖r + ‖b_•‖

(differentiating P·V: ‖P‖₂ ≤ √N for a row-stochastic P, ‖M(P_i)‖₂ ≤ g₁ ≤ ½ (JaSMin, Thm 4),
‖V‖₂ ≤ √N·r_v, ‖K‖₂ ≤ √N·r_k; rows combined by Minkowski's inequality).

Each bound comes as a :class:`Bound`: its value, a label saying which bound it is, the domain it
holds on, and — where the logits are a final linear layer — the bound of the features entering it
and the layer's weight, which certification refines per class pair. Returns None with the reason
when a factor is unbounded; never a made-up number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..models import AttentionSite, ConvexResidualBlock, KernelAttention
from ..nn.center_norm import CenterNorm
from ..nn.cosine_attention import ScaledCosineKernel, scsa_lipschitz_bound
from ..nn.lipschitz_blocks import GELU_LIPSCHITZ, LipschitzDotKernel, ScaledGELU


class Unbounded(Exception):
    """A factor of the network has no finite global Lipschitz bound."""


@dataclass(frozen=True)
class Bound:
    """A certified ℓ2 Lipschitz bound of the pixels → logits map.

    Args:
        value: the bound L.
        label: which bound it is (how it was composed), for tables and results.json.
        domain: where it holds: ``all inputs`` or ``[0, 1]^n`` (the image box).
        features: a bound of pixels → the input of the final linear head, where there is one.
        head_weight: that head's weight (K, F), for the per-class-pair refinement.
    """

    value: float
    label: str = "certified"
    domain: str = "all inputs"
    features: float | None = None
    head_weight: torch.Tensor | None = None

    @classmethod
    def of(cls, bound: Bound | float | None) -> Bound | None:
        """A stabilizer may return a plain number; it becomes an unlabelled bound on all inputs."""
        return bound if bound is None or isinstance(bound, Bound) else cls(float(bound))


def sigma(weight: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(weight.detach().double().reshape(weight.shape[0], -1), ord=2))


def norm_lipschitz(norm: nn.Module) -> float:
    if isinstance(norm, nn.Identity):
        return 1.0
    if isinstance(norm, CenterNorm):
        return norm.lipschitz()
    raise Unbounded(f"{type(norm).__name__} has no global Lipschitz bound (it divides by the standard deviation)")


def activation_lipschitz(act: nn.Module) -> float:
    if isinstance(act, ScaledGELU):
        return 1.0
    if isinstance(act, nn.GELU):
        return GELU_LIPSCHITZ
    if isinstance(act, nn.ReLU):
        return 1.0
    raise Unbounded(f"no Lipschitz constant known for activation {type(act).__name__}")


def mlp_lipschitz(mlp: nn.Module) -> float:
    if not isinstance(mlp, Mlp):
        raise Unbounded(f"unknown MLP {type(mlp).__name__}")
    return sigma(mlp.fc2.weight) * norm_lipschitz(mlp.norm) * activation_lipschitz(mlp.act) * sigma(mlp.fc1.weight)


def attention_lipschitz(attn: nn.Module, tokens: int) -> float:
    kernel = getattr(attn, "kernel", None)
    if not isinstance(attn, KernelAttention) or not isinstance(kernel, ScaledCosineKernel):
        raise Unbounded("dot-product attention has no global Lipschitz bound (only local ones, JaSMin Theorem 3)")
    if not kernel.normalize_v:
        raise Unbounded("cosine attention without V normalisation is not Lipschitz (LipsFormer, Sec. 4.1.2)")
    tau, nu = abs(float(kernel.tau.detach())), abs(float(kernel.nu.detach()))
    site = AttentionSite("", attn)
    heads = []
    for h in range(attn.num_heads):
        w_q, w_k, w_v = (sigma(site.head_weight(part, h)) for part in "qkv")
        heads.append(scsa_lipschitz_bound(tokens, tau, nu, kernel.eps, w_q, w_k, w_v))
    return sigma(attn.proj.weight) * kernel.head_factor * math.sqrt(sum(h * h for h in heads))


def branch_scale(module: nn.Module) -> float:
    """max|α| of a weighted residual wrapped around the DropPath slot (1 when there is none)."""
    if isinstance(module, nn.Sequential) and hasattr(module[0], "alpha"):
        return float(module[0].alpha.detach().abs().max())
    return 1.0


def _vit(network: nn.Module) -> tuple[VisionTransformer, nn.Conv2d]:
    """The ViT backbone and its patch convolution, which must not overlap (else: Unbounded)."""
    backbone = network.backbone
    if not isinstance(backbone, VisionTransformer):
        raise Unbounded(f"certified bounds are implemented for the ViT backbone, not {type(backbone).__name__}")
    proj = backbone.patch_embed.proj
    if tuple(proj.stride) != tuple(proj.kernel_size):
        raise Unbounded("overlapping patch embedding")
    return backbone, proj


def _with_head(features: float, backbone: VisionTransformer, label: str, domain: str) -> Bound:
    """The bound through the final norms (pooling is 1-Lipschitz) and the classifier head, keeping the
    bound of the head's input for the per-class-pair refinement."""
    features *= norm_lipschitz(backbone.norm) * norm_lipschitz(backbone.fc_norm)
    head = backbone.head
    if not isinstance(head, nn.Linear):
        raise Unbounded(f"classifier head {type(head).__name__} is not a Linear layer")
    return Bound(features * sigma(head.weight), label, domain, features, head.weight.detach().clone())


def vit_bound(network: nn.Module) -> Bound:
    backbone, proj = _vit(network)
    bound = 1.0 / float(network.std.min()) * sigma(proj.weight) * norm_lipschitz(backbone.patch_embed.norm)
    tokens = backbone.patch_embed.num_patches + backbone.num_prefix_tokens
    for block in backbone.blocks:
        for attr, norm, branch, layer_scale in (("drop_path1", block.norm1, block.attn, block.ls1),
                                                ("drop_path2", block.norm2, block.mlp, block.ls2)):
            if not isinstance(layer_scale, nn.Identity):
                raise Unbounded("LayerScale is not accounted for")
            alpha = branch_scale(getattr(block, attr))
            f = attention_lipschitz(branch, tokens) if attr == "drop_path1" else mlp_lipschitz(branch)
            bound *= 1.0 + alpha * f * norm_lipschitz(norm)
    return _with_head(bound, backbone, "LipsFormer composition (Theorems 1–2)", "all inputs")


def _norm(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.detach().double().norm())


def _head_parts(attn: nn.Module, part: str, h: int) -> tuple[float, float]:
    """(‖W‖₂, ‖b‖) of the ``part`` ('q', 'k' or 'v') projection of head h."""
    rows = AttentionSite("", attn).head_rows(part, h)
    bias = attn.qkv.bias[rows] if attn.qkv.bias is not None else None
    return sigma(attn.qkv.weight[rows]), _norm(bias)


def lipschitz_transformer_bound(network: nn.Module) -> Bound:
    """Bound on [0, 1]ⁿ for the ViT with the Lipschitz-transformer architecture (module docstring)."""
    backbone, proj = _vit(network)
    if not isinstance(backbone.patch_embed.norm, nn.Identity):
        raise Unbounded("a norm in the patch embedding")
    mean, std = network.mean.flatten().double(), network.std.flatten().double()
    pixel = torch.maximum(mean, 1 - mean) / std  # largest |normalised pixel| per channel
    patch_norm = float((pixel.pow(2) * proj.kernel_size[0] * proj.kernel_size[1]).sum().sqrt())
    pos = backbone.pos_embed.detach().double()[0] if backbone.pos_embed is not None else torch.zeros(1, 1)
    bias = proj.bias.detach().double() if proj.bias is not None else torch.zeros(pos.shape[-1], dtype=torch.float64)
    prefix = backbone.num_prefix_tokens
    r = sigma(proj.weight) * patch_norm + float((bias + pos[prefix:]).norm(dim=-1).max())
    if prefix:
        cls = backbone.cls_token.detach().double()[0, 0] + (pos[0] if not backbone.no_embed_class else 0)
        r = max(r, float(cls.norm()))
    bound = sigma(proj.weight) / float(network.std.min())
    tokens = backbone.patch_embed.num_patches + prefix
    for wrapper in backbone.blocks:
        if not isinstance(wrapper, ConvexResidualBlock):
            raise Unbounded("a block without the convex residual")
        block, a = wrapper.block, wrapper.a
        attn = block.attn
        if not isinstance(getattr(attn, "kernel", None), LipschitzDotKernel):
            raise Unbounded("attention other than the Lipschitz transformer's dot-product kernel")
        s, d = attn.kernel.s, attn.head_dim
        heads, outs = [], []
        for h in range(attn.num_heads):
            (wq, bq), (wk, bk), (wv, bv) = (_head_parts(attn, part, h) for part in "qkv")
            r_q, r_k, r_v = wq * r + bq, wk * r + bk, wv * r + bv
            heads.append(math.sqrt(tokens) * wv + s * tokens / (2 * d) * r_v * (wk * r_q + wq * r_k))
            outs.append(r_v)
        w_o = sigma(attn.proj.weight)
        lip_att = w_o / 3 * math.sqrt(sum(x * x for x in heads)) * norm_lipschitz(block.norm1)
        r_att = w_o / 3 * math.sqrt(sum(x * x for x in outs)) + _norm(attn.proj.bias)
        bound *= (1 - a) + a * lip_att
        r = (1 - a) * r + a * r_att
        mlp = block.mlp
        bound *= (1 - a) + a * mlp_lipschitz(mlp) * norm_lipschitz(block.norm2)
        r_mlp = sigma(mlp.fc2.weight) * (sigma(mlp.fc1.weight) * r + _norm(mlp.fc1.bias)) + _norm(mlp.fc2.bias)
        r = (1 - a) * r + a * r_mlp
    return _with_head(bound, backbone, "Lipschitz-transformer composition on the pixel box", "[0, 1]^n")


def certified_bound(network: nn.Module) -> tuple[Bound | None, str]:
    """(bound, "") or (None, reason)."""
    blocks = getattr(network.backbone, "blocks", None)
    convex = blocks is not None and len(blocks) and isinstance(blocks[0], ConvexResidualBlock)
    try:
        return (lipschitz_transformer_bound(network) if convex else vit_bound(network)), ""
    except Unbounded as reason:
        return None, str(reason)
