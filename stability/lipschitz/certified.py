"""Certified global ℓ2 Lipschitz upper bounds by composition, from the measured weights.

Implemented for the ViT backbone (timm ``VisionTransformer``) when every factor is bounded:

    Lip(f) ≤ (1/min σ_pixel) · ‖patch conv‖ · Π_blocks Lip(block) · Lip(final norm) · ‖W_head‖

* the patch embedding has stride = kernel (non-overlapping patches), so its operator norm is σ₁
  of the reshaped kernel exactly (the hybrid's AOL stem: the product of its layers' Schur bounds); position
  embeddings and the class token are constants;
* a pre-norm residual branch x + α ⊙ f(N(x)) has Lip ≤ 1 + max|α|·Lip(f)·Lip(N) (LipsFormer,
  Theorem 2), with N CenterNorm (D/(D−1)·max|γ|) or Identity — LayerNorm has no global bound;
* scaled cosine attention: one head by LipsFormer's Theorem 1 (with the learned τ, ν and the
  per-head ‖W_Q‖, ‖W_K‖, ‖W_V‖), heads concatenated (√(Σ L_h²)), times the 1/K head scale
  and ‖W_O‖ — dot-product attention has no global bound;
* MLP: ‖W_2‖ · Lip(act) · ‖W_1‖ with Lip(GELU) = 1.1289…;
* pooling (class token, mean or max over tokens) is 1-Lipschitz in the Frobenius norm over tokens; attention pooling
  (``global_pool='map'``) is refused; a norm before the blocks (``pre_norm``) counts with its own constant; class
  and register tokens and positions are constants.

For Newhouse et al.'s Lipschitz transformer (``lipschitz_transformer``) the bound is composed on the
image domain [0, 1]ⁿ: :mod:`stability.lipschitz.transformer_bounds`; for the convolutional anchor
(``--model.backbone lipcnn``, AOL layers) in :mod:`stability.lipschitz.conv_bounds`.

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

from ..models import AttentionSite, ConvexResidualBlock, KernelAttention, PatchLinear, vit_tokens
from ..models.hybrid import is_stem
from ..nn.center_norm import CenterNorm
from ..nn.cosine_attention import ScaledCosineKernel, scsa_lipschitz_bound
from ..nn.lipschitz_blocks import activation_lipschitz as known_activation_lipschitz
from ..nn.lipschitz_blocks import effective_weight


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
    lipschitz = known_activation_lipschitz(act)
    if lipschitz is None:
        raise Unbounded(f"no Lipschitz constant known for activation {type(act).__name__}")
    return lipschitz


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


def _vit(network: nn.Module) -> tuple[VisionTransformer, float]:
    """The ViT backbone and the bound of its embedding from the normalised image: σ₁ of the patch embedding, which
    must not overlap (else: Unbounded), times its norm's; or the hybrid's AOL stem's float64 bound."""
    backbone = network.backbone
    if not isinstance(backbone, VisionTransformer):
        raise Unbounded(f"certified bounds are implemented for the ViT backbone, not {type(backbone).__name__}")
    embedding = backbone.patch_embed
    if is_stem(embedding):
        return backbone, float(embedding.lipschitz())
    proj = embedding.proj
    if isinstance(proj, PatchLinear):
        return backbone, sigma(proj.linear.weight) * norm_lipschitz(embedding.norm)
    if tuple(proj.stride) != tuple(proj.kernel_size):
        raise Unbounded("overlapping patch embedding")
    return backbone, sigma(proj.weight) * norm_lipschitz(embedding.norm)


def _with_head(features: float, network: nn.Module, backbone: VisionTransformer, label: str, domain: str) -> Bound:
    """The bound through the final norms (pooling is 1-Lipschitz), the classifier head and the network's logit
    scale c, keeping the bound of the head's input and c·W_head for the per-class-pair refinement."""
    features *= norm_lipschitz(backbone.norm) * norm_lipschitz(backbone.fc_norm)
    head = backbone.head
    if not isinstance(head, nn.Linear):
        raise Unbounded(f"classifier head {type(head).__name__} is not a Linear layer")
    return Bound(features * sigma(effective_weight(head)) * abs(network.logit_scale), label, domain, features,
                 _scaled_head(network, head))


def _scaled_head(network: nn.Module, head: nn.Linear) -> torch.Tensor:
    """c·W_head, the logits' linear map from the head's input (c: the network's logit scale)."""
    return effective_weight(head).detach().clone() * abs(network.logit_scale)


def vit_bound(network: nn.Module) -> Bound:
    backbone, embedding = _vit(network)
    if getattr(backbone, "attn_pool", None) is not None:
        raise Unbounded("attention pooling (global_pool='map') is not accounted for")
    bound = 1.0 / float(network.std.min()) * embedding
    bound *= norm_lipschitz(backbone.norm_pre)  # pre_norm: a norm before the blocks (CenterNorm under LipsFormer)
    tokens = vit_tokens(backbone)
    for block in backbone.blocks:
        for attr, norm, branch, layer_scale in (("drop_path1", block.norm1, block.attn, block.ls1),
                                                ("drop_path2", block.norm2, block.mlp, block.ls2)):
            if not isinstance(layer_scale, nn.Identity):
                raise Unbounded("LayerScale is not accounted for")
            alpha = branch_scale(getattr(block, attr))
            f = attention_lipschitz(branch, tokens) if attr == "drop_path1" else mlp_lipschitz(branch)
            bound *= 1.0 + alpha * f * norm_lipschitz(norm)
    return _with_head(bound, network, backbone, "LipsFormer composition (Theorems 1–2)", "all inputs")


def lipschitz_transformer_bound(network: nn.Module) -> Bound:
    """The pixel-space bound of the Lipschitz-transformer ViT on [0, 1]ⁿ (transformer_bounds)."""
    from .transformer_bounds import NotALipschitzTransformer, pixel_bound

    backbone = network.backbone
    try:
        value, features = pixel_bound(network)
    except NotALipschitzTransformer as reason:
        raise Unbounded(str(reason)) from None
    return Bound(float(value), "Lipschitz-transformer composition on the pixel box", "[0, 1]^n", float(features),
                 _scaled_head(network, backbone.head))


def lipconvnet_bound(network: nn.Module) -> Bound:
    """The convolutional anchor's bound: AOL layers, each bounded from its weights in float64 (conv_bounds)."""
    from .conv_bounds import features_bound, head_norm, scaled_head

    features = float(features_bound(network))
    return Bound(features * float(head_norm(network)), "AOL composition (Schur bound per layer)", "all inputs",
                 features, scaled_head(network))


def certified_bound(network: nn.Module) -> tuple[Bound | None, str]:
    """(bound, "") or (None, reason): the one place that picks the bound of an architecture family."""
    from .conv_bounds import is_lipconvnet

    if getattr(network, "logit_cap", None) is not None:
        return None, "the final logits are soft-capped (softcap): no certificate is composed through the cap"
    if is_lipconvnet(network):
        return lipconvnet_bound(network), ""
    blocks = getattr(network.backbone, "blocks", None)
    convex = blocks is not None and len(blocks) and isinstance(blocks[0], ConvexResidualBlock)
    try:
        return (lipschitz_transformer_bound(network) if convex else vit_bound(network)), ""
    except Unbounded as reason:
        return None, str(reason)
