"""The two Lipschitz bounds of Newhouse et al.'s Lipschitz transformer on the ViT backbone
(docs/methods.md#lipschitz-transformer), composed from the measured weights.

Architecture: no norms, convex residuals x ← (1−a)x + a·f(x), heads (1/3)·W_O·softmax(c·QKᵀ)·V with
c = s/d, GELU/1.1289. Dot-product attention is Lipschitz only on bounded inputs, so both bounds
propagate a bound r on the size of every token from the pixel box [0, 1]ⁿ, layer by layer.

**Pixel-space bound** (:func:`pixel_bound`, certifies): ℓ2 over the whole input image → ℓ2 of the
logits, tokens measured in ℓ2 (‖x_i‖ ≤ r). For one head on {X : ‖x_i‖ ≤ r}, with r_• = ‖W_•‖r + ‖b_•‖,

    d(PV) = P·dV + dP·V,  ‖P·dV‖_F ≤ √κ‖W_V‖‖dX‖_F,
    (dP·V)_i = Cov_{P_i}(u, V) with u_j = c(dq_i·k_j + q_i·dk_j),
    ‖Cov_p(u, V)‖ ≤ √Var_p(u)·√(E_p‖v − v̄‖²) ≤ (√Var_p(dq_i·k) + √Var_p(q_i·dk))·r_v
                  ≤ (r_k‖dq_i‖ + r_q·√(E_p‖dk_j‖²))·c·r_v.

κ bounds P's column sums: the logits c·q_i·k_j of a row lie in an interval of width Δ = 2c·r_q·r_k, so
P_ij ≤ 1/(1 + (N − 1)e^(−Δ)) and every column sums to ≤ κ = N/(1 + (N − 1)e^(−Δ)) (≤ N; → 1 as the
attention becomes uniform). Then ‖P‖₂ ≤ √(‖P‖₁‖P‖_∞) ≤ √κ and Σ_i E_{P_i}‖dk_j‖² ≤ κ‖dK‖_F², and
Minkowski over the rows gives

    Lip_h ≤ √κ‖W_V‖ + c·r_v·(r_k‖W_Q‖ + √κ·r_q‖W_K‖).

Heads are combined through W_O as (1/3)·min(‖W_O‖·√Σ_h Lip_h², Σ_h ‖W_O^h‖·Lip_h) (W_O^h: the
columns of head h); the MLP as ‖W₂‖·‖W₁‖; a block as (1 − a) + a·Lip(f). Token sizes: the
embedding ‖W_e‖·max‖patch‖ + max‖b_e + pos_i‖ (and ‖cls + pos_0‖); attention output
(1/3)·min(‖W_O‖√Σ r_v², Σ‖W_O^h‖r_v) + ‖b_O‖ (each head's output is a convex combination of value
rows); MLP ‖W₂‖(‖W₁‖r + ‖b₁‖) + ‖b₂‖. L2 attention: Kim et al.'s Theorem 3.2, global (divided by its unit-norm
constant for ``l2_unit``); token mixing M·X·W_Vᵀ·W_Oᵀ: ‖M‖‖W_V‖‖W_O‖. Class-token pooling is 1-Lipschitz, mean
pooling 1/√N. The logits are
c·W_head·h with c the network's logit scale (the reference's ``final_scale``): both bounds include c.

**Paper's bound** (:func:`paper_bound`, for comparison with its figures, certifies nothing in
pixel space): the composition of Newhouse et al. in RMS→RMS norms ‖W‖ = √(d_in/d_out)·σ₁ over
per-token RMS sizes, from the embedded tokens to the logits:
L_att = (1/3)‖W_O‖‖W_V‖(1 + 2s·r²‖W_Q‖‖W_K‖), L_mlp = ‖W₂‖‖W₁‖, a block (1 − a) + a·L, the head
‖W_head‖; r propagated as above in RMS units (from the patch embedding of the pixel box).

``differentiable=True`` keeps the graph through the σ₁'s (for the Lipschitz-margin loss); :func:`pixel_bound`
also composes given σ₁ estimates (``sigmas``, by :func:`bound_matrices`' names), in their dtype.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..models import AttentionSite, ConvexResidualBlock, PatchLinear, vit_tokens
from ..models.hybrid import AOLStem, is_stem
from ..nn.folded_scale import ScaledInputLinear
from ..nn.l2_attention import L2MultiHeadAttention, l2_attention_bound, unit_divisor
from ..nn.lipschitz_blocks import GELU_LIPSCHITZ, LipschitzDotKernel, activation_lipschitz, effective_weight
from ..nn.token_mixing import TokenMixing


class NotALipschitzTransformer(Exception):
    """The network is not the Lipschitz-transformer ViT these bounds are for."""


def exact_sigma(weight: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """σ₁ of a matrix (a kernel is reshaped to out × rest), exact, in ``dtype``; differentiable."""
    return torch.linalg.matrix_norm(weight.to(dtype).reshape(weight.shape[0], -1), ord=2)


def _size(t: torch.Tensor | None, differentiable: bool, like: torch.Tensor) -> torch.Tensor:
    """‖t‖ (0 for a missing bias), in ``like``'s dtype and on its device."""
    if t is None:
        return like.new_zeros(())
    return (t if differentiable else t.detach()).to(like.dtype).norm()


def _parts(network: nn.Module) -> tuple[VisionTransformer, nn.Linear | nn.Conv2d | AOLStem,
                                         list[ConvexResidualBlock]]:
    """The ViT, its embedding (the patch embedding's Linear or Conv2d, or the hybrid's :class:`AOLStem`) and its
    blocks, or NotALipschitzTransformer naming the part that has no bound here."""
    backbone = network.backbone
    if not isinstance(backbone, VisionTransformer):
        raise NotALipschitzTransformer(f"the bounds are implemented for the ViT backbone, not "
                                       f"{type(backbone).__name__}")
    if is_stem(backbone.patch_embed):
        embed = backbone.patch_embed
    else:
        proj = backbone.patch_embed.proj
        embed = proj.linear if isinstance(proj, PatchLinear) else proj
        if isinstance(proj, nn.Conv2d) and tuple(proj.stride) != tuple(proj.kernel_size):
            raise NotALipschitzTransformer("overlapping patch embedding")
        if not isinstance(backbone.patch_embed.norm, nn.Identity):
            raise NotALipschitzTransformer("a norm in the patch embedding")
    for where, norm in (("a final", backbone.norm), ("a final", backbone.fc_norm), ("a pre-block (pre_norm)",
                                                                                    backbone.norm_pre)):
        if not isinstance(norm, nn.Identity):
            raise NotALipschitzTransformer(f"{where} {type(norm).__name__} (LayerNorm has no global bound)")
    if getattr(backbone, "attn_pool", None) is not None:
        raise NotALipschitzTransformer("attention pooling (global_pool='map') has no bound here")
    blocks = list(backbone.blocks)
    for wrapper in blocks:
        if not isinstance(wrapper, ConvexResidualBlock):
            raise NotALipschitzTransformer("a block without the convex residual")
        block = wrapper.block
        if not (isinstance(getattr(block.attn, "kernel", None), LipschitzDotKernel)
                or isinstance(block.attn, (L2MultiHeadAttention, TokenMixing))):
            raise NotALipschitzTransformer("attention other than the Lipschitz transformer's dot-product kernel, "
                                           "L2 attention or token mixing")
        if not (isinstance(block.norm1, nn.Identity) and isinstance(block.norm2, nn.Identity)):
            raise NotALipschitzTransformer("a LayerNorm inside a block (it has no global bound)")
        if activation_lipschitz(block.mlp.act) is None:
            raise NotALipschitzTransformer(f"activation {type(block.mlp.act).__name__}")
        _check_folds(block)
    if not isinstance(backbone.head, nn.Linear):
        raise NotALipschitzTransformer("the classifier head is not a Linear layer")
    return backbone, embed, blocks


def _check_folds(block: nn.Module) -> None:
    """The bounds take the attention's 1/3 and GELU's 1/1.1289 where the paper puts them (the constants below are
    theirs, not read from the modules), and read W_O's and fc2's weights as they are: a division folded into the next
    Linear layer (:func:`~stability.nn.folded_scale.fold_input_scale`) must be there, with its constant, and only
    where the division is off (NotALipschitzTransformer otherwise: the network would not be the function bounded)."""
    pairs = ((getattr(block.attn, "kernel", None), getattr(block.attn, "proj", None), 1 / 3, "the attention's 1/3"),
             (block.mlp.act, getattr(block.mlp, "fc2", None), 1 / GELU_LIPSCHITZ, "GELU's 1/1.1289"))
    for divides, linear, scale, what in pairs:
        scaled = isinstance(linear, ScaledInputLinear)
        if getattr(divides, "folded", False) != scaled or (scaled and not math.isclose(linear.input_scale, scale,
                                                                                        rel_tol=1e-12)):
            raise NotALipschitzTransformer(f"{what} folded into the next Linear layer inconsistently")


def _patch_size(backbone: VisionTransformer) -> tuple[int, int]:
    proj = backbone.patch_embed.proj
    return tuple(proj.kernel_size)


def _largest_patch(network: nn.Module, backbone: VisionTransformer, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The largest ℓ2 norm of a normalised patch of an image in [0, 1]ⁿ."""
    mean, std = network.mean.flatten().to(dtype), network.std.flatten().to(dtype)
    pixel = torch.maximum(mean, 1 - mean) / std  # largest |normalised pixel| per channel
    kh, kw = _patch_size(backbone)
    return (pixel.pow(2) * kh * kw).sum().sqrt()


def _token_size(backbone: VisionTransformer, spread: torch.Tensor, centre: torch.Tensor, differentiable: bool,
                per_token: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """max over tokens of the size of an embedded token (``per_token`` measures a vector's size): each patch token i
    is centre_i + pos_i + e_i with ‖e_i‖ ≤ ``spread`` (``centre``: (N, D) or (1, D), the tokens of the box's
    centre, or the embedding's bias), so its size is ≤ spread + max_i ‖centre_i + pos_i‖; and each prefix token's
    (class, registers) own size, with its position where it has one. timm adds the positions to the prefix tokens
    too unless ``no_embed_class`` (then the position table has one row per patch only)."""
    dtype = spread.dtype

    def value(t: torch.Tensor) -> torch.Tensor:
        return (t if differentiable else t.detach()).to(dtype)

    pos = None if backbone.pos_embed is None else value(backbone.pos_embed[0])
    prefix = backbone.num_prefix_tokens
    prefix_pos = 0 if backbone.no_embed_class else prefix  # the position rows that belong to prefix tokens
    shifts = centre + pos[prefix_pos:] if pos is not None else centre
    size = spread + per_token(shifts).max()
    tokens = [value(t)[0] for t in (backbone.cls_token, backbone.reg_token) if t is not None]  # each (n, D)
    if tokens:
        constants = torch.cat(tokens)  # (prefix, D)
        if pos is not None and prefix_pos:
            constants = constants + pos[:prefix_pos]
        size = torch.maximum(size, per_token(constants).max())
    return size


def _head_rows(attn: nn.Module, part: str, h: int) -> slice:
    return AttentionSite("", attn).head_rows(part, h)


def bound_matrices(network: nn.Module) -> dict[str, torch.Tensor]:
    """Every matrix the pixel-space bound reads, by name, in a fixed order: the patch embedding
    (``embed``), per block i and head h W_Q^h, W_K^h, W_V^h (rows of qkv: ``i.q<h>``…) and W_O^h (columns
    of W_O: ``i.o<h>``), the whole W_O (``i.o``), the MLP (``i.fc1``, ``i.fc2``), and the ``head``.
    They are views of the current weights (differentiable)."""
    backbone, embed, blocks = _parts(network)
    matrices = {} if is_stem(embed) else {"embed": embed.weight.reshape(embed.weight.shape[0], -1)}
    for i, wrapper in enumerate(blocks):
        attn, mlp = wrapper.block.attn, wrapper.block.mlp
        matrices[f"{i}.fc1"], matrices[f"{i}.fc2"] = mlp.fc1.weight, mlp.fc2.weight
        if isinstance(attn, TokenMixing):
            matrices[f"{i}.mix"], matrices[f"{i}.v"], matrices[f"{i}.o"] = attn.mix.weight, attn.v.weight, \
                attn.proj.weight
            continue
        weight, w_o, width = attn.qkv.weight, attn.proj.weight, attn.head_dim
        for h in range(attn.num_heads):
            for part in "qkv":
                matrices[f"{i}.{part}{h}"] = weight[_head_rows(attn, part, h)]
            matrices[f"{i}.o{h}"] = w_o[:, h * width:(h + 1) * width]
        matrices[f"{i}.o"] = w_o
    matrices["head"] = effective_weight(backbone.head)  # unit rows with last-layer normalisation
    return matrices


def head_sigmas(sigmas: dict[str, torch.Tensor], i: int, part: str, heads: int) -> torch.Tensor:
    """(H,): σ of ``part`` ('q', 'k', 'v' or 'o') of each head of block i — the vector ``"<i>.<part>[heads]"`` where
    ``sigmas`` has one (a training bound computes the heads of a block at once), else the per-head values stacked."""
    vector = sigmas.get(f"{i}.{part}[heads]")
    return vector if vector is not None else torch.stack([sigmas[f"{i}.{part}{h}"] for h in range(heads)])


def pixel_bound(network: nn.Module, differentiable: bool = False,
                sigmas: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound of pixels → logits, bound of pixels → the head's input), ℓ2, on [0, 1]ⁿ (module docstring); the
    first includes the network's logit scale c (z = c·W_head·h).

    ``sigmas``: σ₁ of each of :func:`bound_matrices`, by name, in the dtype to compose in (e.g. float32
    estimates from a power iteration, for a training loss); by default the exact values in float64, which
    is what makes the result a certificate."""
    backbone, embed, blocks = _parts(network)
    if sigmas is None:
        sigmas = {name: exact_sigma(m if differentiable else m.detach())
                  for name, m in bound_matrices(network).items()}
    dtype = sigmas["head"].dtype
    tokens = vit_tokens(backbone)
    embedding, r = _embedding(network, backbone, embed, sigmas, dtype, differentiable)
    bound = embedding / network.std.to(dtype).min()
    for i, wrapper in enumerate(blocks):
        block, a = wrapper.block, wrapper.a
        attn = block.attn
        if isinstance(attn, L2MultiHeadAttention):
            lip_att, r_att = _l2_attention(i, attn, sigmas, tokens, r, differentiable)
        elif isinstance(attn, TokenMixing):
            lip_att, r_att = _token_mixing(i, attn, sigmas, r, differentiable)
        else:
            lip_att, r_att = _dot_attention(i, attn, sigmas, tokens, r, differentiable)
        bound = bound * ((1 - a) + a * lip_att)
        r = (1 - a) * r + a * r_att
        mlp = block.mlp
        act = activation_lipschitz(mlp.act)
        w_1, w_2 = sigmas[f"{i}.fc1"], sigmas[f"{i}.fc2"]
        bound = bound * ((1 - a) + a * w_2 * act * w_1)
        r_mlp = w_2 * act * (w_1 * r + _size(mlp.fc1.bias, differentiable, r)) + _size(mlp.fc2.bias, differentiable, r)
        r = (1 - a) * r + a * r_mlp
    if backbone.global_pool == "avg":
        bound = bound / math.sqrt(backbone.patch_embed.num_patches)
    return bound * sigmas["head"] * abs(network.logit_scale), bound


def _embedding(network: nn.Module, backbone: VisionTransformer, embed, sigmas: dict[str, torch.Tensor],
               dtype: torch.dtype, differentiable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the embedding's bound from the normalised image, the largest token it makes on the pixel box).

    Patch embedding: σ₁(W_e), tokens ≤ ‖W_e‖·max‖patch‖ + max_i ‖b_e + pos_i‖. The hybrid's stem (:class:`AOLStem`):
    Π b_l, the layers' float64 Schur bounds (``sigmas["stem"]`` where given: a training bound takes AOL's 1 by
    construction), and around the box's centre z₀ (every pixel ½), token i ≤ ‖stem(z₀)_i + pos_i‖ + L_stem·‖z − z₀‖
    with ‖z − z₀‖ ≤ √(h·w·Σ_c (½/σ_c)²) over the box."""
    if not is_stem(embed):
        spread = sigmas["embed"] * _largest_patch(network, backbone, dtype)
        return sigmas["embed"], _token_size(backbone, spread, _size_vector(embed.bias, embed.weight.shape[0],
                                                                           differentiable, spread), differentiable,
                                            lambda t: t.norm(dim=-1))
    stem_bound = sigmas["stem"] if "stem" in sigmas else embed.lipschitz(torch.float64).to(dtype)
    mean, std = network.mean.to(dtype), network.std.to(dtype)
    height, width = embed.img_size
    centre = ((0.5 - mean) / std).expand(1, -1, height, width)
    half_width = (0.25 / std.flatten().pow(2)).sum().mul(height * width).sqrt()
    centre_tokens = embed.tokens_in(centre, dtype, differentiable)[0]  # (N, D)
    return stem_bound, _token_size(backbone, stem_bound * half_width, centre_tokens, differentiable,
                                   lambda t: t.norm(dim=-1))


def _size_vector(bias: torch.Tensor | None, width: int, differentiable: bool, like: torch.Tensor) -> torch.Tensor:
    """A bias as a (1, D) row in ``like``'s dtype and on its device (zeros where there is none)."""
    if bias is None:
        return like.new_zeros(1, width)
    return (bias if differentiable else bias.detach()).to(like)[None]


def column_sum_bound(tokens: int, width: torch.Tensor) -> torch.Tensor:
    """κ = N/(1 + (N − 1)·e^(−Δ)): the largest column sum of a softmax matrix over N tokens whose rows' logits
    each lie in an interval of width Δ (each entry is ≤ 1/(1 + (N − 1)e^(−Δ))). κ ≤ N, and κ → 1 as Δ → 0."""
    return tokens / (1 + (tokens - 1) * torch.exp(-width))


def _dot_attention(i: int, attn: nn.Module, sigmas: dict[str, torch.Tensor], tokens: int, r: torch.Tensor,
                   differentiable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Lipschitz bound, output token size) of the Lipschitz transformer's attention (1/3)·W_O·softmax(c·QKᵀ)·V
    on tokens of size ≤ r (module docstring)."""
    c, bias, heads = attn.kernel.s / attn.head_dim, attn.qkv.bias, range(attn.num_heads)
    w_q, w_k, w_v, w_o_heads = (head_sigmas(sigmas, i, p, attn.num_heads) for p in "qkvo")  # (H,) each
    if bias is None:
        b_q = b_k = b_v = r.new_zeros(())
    else:
        b_q, b_k, b_v = (torch.stack([_size(bias[_head_rows(attn, p, h)], differentiable, r) for h in heads])
                         for p in "qkv")
    r_q, r_k, r_v = w_q * r + b_q, w_k * r + b_k, w_v * r + b_v  # every head at once: one launch per step, not H
    root = column_sum_bound(tokens, 2 * c * r_q * r_k).sqrt()
    per_head = root * w_v + c * r_v * (r_k * w_q + root * r_q * w_k)
    whole = sigmas[f"{i}.o"]
    lip = torch.minimum(whole * torch.linalg.vector_norm(per_head), (w_o_heads * per_head).sum()) / 3
    size = torch.minimum(whole * torch.linalg.vector_norm(r_v), (w_o_heads * r_v).sum()) / 3 \
        + _size(attn.proj.bias, differentiable, r)
    return lip, size


def _l2_attention(i: int, attn: L2MultiHeadAttention, sigmas: dict[str, torch.Tensor], tokens: int,
                  r: torch.Tensor, differentiable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Lipschitz bound, output token size) of L2 attention: Kim et al.'s Theorem 3.2, global (it needs no token
    size); the output rows are convex combinations of q_j·W_Qᵀ W_V/√d, of size ≤ ‖W_Q‖²‖W_V‖·r/√d per head."""
    if attn.qkv.bias is not None:
        raise NotALipschitzTransformer("L2 attention with biases (its bound is for linear maps)")
    w_q, w_v = head_sigmas(sigmas, i, "q", attn.num_heads), head_sigmas(sigmas, i, "v", attn.num_heads)
    whole = sigmas[f"{i}.o"]
    lip = l2_attention_bound(tokens, attn.head_dim, w_q, w_v, whole)
    size = whole * torch.linalg.vector_norm(w_q.pow(2) * w_v * r / math.sqrt(attn.head_dim)) \
        + _size(attn.proj.bias, differentiable, r)
    if attn.unit:
        divisor = unit_divisor(tokens, attn.num_heads, attn.head_dim)
        return lip / divisor, size / divisor
    return lip, size


def _token_mixing(i: int, attn: TokenMixing, sigmas: dict[str, torch.Tensor], r: torch.Tensor,
                  differentiable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Lipschitz bound, output token size) of token mixing M·X·W_Vᵀ·W_Oᵀ: ‖M‖·‖W_V‖·‖W_O‖ over the sequence
    (a Kronecker product), and ‖W_O‖‖W_V‖·max_i Σ_j |M_ij|·r per token."""
    mix = attn.mix.weight if differentiable else attn.mix.weight.detach()
    rows = mix.to(r.dtype).abs().sum(dim=1).max()
    w = sigmas[f"{i}.o"] * sigmas[f"{i}.v"]
    return sigmas[f"{i}.mix"] * w, w * rows * r


def paper_bound(network: nn.Module) -> float:
    """Newhouse et al.'s composition in RMS→RMS norms over per-token RMS sizes, embedded tokens →
    logits (module docstring). Comparable with the paper's figures; it certifies nothing in pixels."""
    backbone, embed, blocks = _parts(network)
    if is_stem(embed):
        raise NotALipschitzTransformer("the paper's bound starts from a linear patch embedding, not a convolutional "
                                       "stem")
    if any(isinstance(wrapper.block.attn, (L2MultiHeadAttention, TokenMixing)) for wrapper in blocks):
        raise NotALipschitzTransformer("the paper's bound is for its dot-product attention, not L2 attention or token "
                                       "mixing")

    def rms(weight: torch.Tensor) -> torch.Tensor:  # ‖W‖_RMS→RMS = √(d_in/d_out)·σ₁
        w = weight.detach().reshape(weight.shape[0], -1)
        return exact_sigma(w) * math.sqrt(w.shape[1] / w.shape[0])

    d_patch = embed.weight.reshape(embed.weight.shape[0], -1).shape[1]
    patch_rms = _largest_patch(network, backbone) / math.sqrt(d_patch)
    width = embed.weight.shape[0]
    r = _token_size(backbone, rms(embed.weight) * patch_rms,
                    _size_vector(embed.bias, width, False, patch_rms), False,
                    lambda t: t.norm(dim=-1) / math.sqrt(width))  # ‖W_e‖_RMS·RMS(patch) + RMS(pos)
    bound = r.new_ones(())
    for wrapper in blocks:
        block, a = wrapper.block, wrapper.a
        attn, s = block.attn, block.attn.kernel.s
        weight = attn.qkv.weight
        width_qkv = weight.shape[0] // 3
        w_q, w_k, w_v = (rms(weight[i * width_qkv:(i + 1) * width_qkv]) for i in range(3))
        w_o = rms(attn.proj.weight)
        lip_att = w_o * w_v * (1 + 2 * s * r * r * w_q * w_k) / 3
        bound = bound * ((1 - a) + a * lip_att)
        r = (1 - a) * r + a * w_o * w_v * r / 3
        lip_mlp = rms(block.mlp.fc2.weight) * activation_lipschitz(block.mlp.act) * rms(block.mlp.fc1.weight)
        bound = bound * ((1 - a) + a * lip_mlp)
        r = (1 - a) * r + a * lip_mlp * r
    return float(bound * rms(effective_weight(backbone.head))) * abs(network.logit_scale)
