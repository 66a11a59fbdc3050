"""The Lipschitz transformer's pixel bound (:func:`.transformer_bounds.pixel_bound`) composed for every block at once:
what the certified losses compose at every training step from their σ̂ estimates.

``pixel_bound`` walks the blocks one by one, a few dozen operators on scalars and per-head vectors each and twice
that in the backward: about 164 kernel launches a block, 2,000 a step of ViT-S on a GPU, for arithmetic that costs
nothing. Here only the token size r, which passes from block to block, is carried block by block, and only where a
bound needs it (dot-product attention's bound depends on the size of its input tokens; L2 attention's, token
mixing's and the MLP's do not). Each block maps r in closed form, its coefficients computed for all blocks at once:

    attention   r ↦ (1 − a)·r + a·(min(‖W_O‖·‖r_V‖, Σ_h ‖W_O^h‖·r_V^h)/3 + ‖b_O‖),  r_V^h = ‖W_V^h‖·r + ‖b_V^h‖
    MLP         r ↦ (1 − a)·r + a·(‖W₂‖·λ·(‖W₁‖·r + ‖b₁‖) + ‖b₂‖)

(dot-product attention). Without biases on W_V the attention's output size is linear in r, r·min(‖W_O‖·‖W_V^h‖_h,
Σ_h ‖W_O^h‖‖W_V^h‖)/3 + ‖b_O‖, and so are L2 attention's and token mixing's: a block's map is then one multiply-add.
Every block's Lipschitz factor is then computed from the sizes for all blocks at once, (blocks, heads) tensors, and
the bound is their product.

The same function as ``pixel_bound`` given the same σ̂, in value and gradient (tested to 1e-10 in float64 on the
ViT, the hybrid and the token-mixing control, with and without biases); ``pixel_bound`` stays the certificate's
composition (exact σ₁, float64).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..models import vit_tokens
from ..nn.l2_attention import L2MultiHeadAttention, l2_attention_bound, unit_divisor
from ..nn.lipschitz_blocks import activation_lipschitz
from ..nn.norms import row_norms
from ..nn.token_mixing import TokenMixing
from .transformer_bounds import NotALipschitzTransformer, _embedding, _parts, column_sum_bound, head_sigmas, pixel_bound

Scalar = float | torch.Tensor


def stacked_pixel_bound(network: nn.Module, sigmas: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound of pixels → logits, bound of pixels → the head's input) from the σ̂ estimates ``sigmas`` (by the names
    of :func:`~.transformer_bounds.bound_matrices`, per-head vectors ``"<i>.q[heads]"`` or per-head values),
    differentiable, in their dtype: :func:`~.transformer_bounds.pixel_bound` with ``sigmas``, computed for all blocks
    at once (module docstring). Blocks of different kinds (attention, heads, width) in one network, which no
    stabilizer makes, are composed by ``pixel_bound`` itself."""
    backbone, embed, blocks = _parts(network)
    kinds = {_kind(wrapper.block.attn) for wrapper in blocks}
    if len(kinds) != 1:
        return pixel_bound(network, differentiable=True, sigmas=sigmas)
    kind = kinds.pop()
    dtype = sigmas["head"].dtype
    tokens = vit_tokens(backbone)
    embedding, r = _embedding(network, backbone, embed, sigmas, dtype, True)
    a = _per_block([wrapper.a for wrapper in blocks], r)
    mlp_factor, mlp_offset = _mlp(blocks, sigmas, a, r)
    attention = (_DotAttention if kind[0] == "dot" else _LinearAttention)(kind, blocks, sigmas, tokens, r)
    sizes = None
    if isinstance(attention, _DotAttention):  # its bound needs the size of each block's input tokens
        sizes = _carry_sizes(r, attention.size_map(a), mlp_factor, mlp_offset)
    factors = (1 - a) + a * attention.lipschitz(sizes)
    bound = embedding / network.std.to(dtype).min() * (factors * mlp_factor).prod()
    if backbone.global_pool == "avg":
        bound = bound / math.sqrt(backbone.patch_embed.num_patches)
    return bound * sigmas["head"] * abs(network.logit_scale), bound


def _kind(attn: nn.Module) -> tuple:
    """Blocks of one kind have their bounds computed together."""
    if isinstance(attn, L2MultiHeadAttention):
        return "l2", attn.num_heads, attn.head_dim, attn.unit
    if isinstance(attn, TokenMixing):
        return "mix", tuple(attn.mix.weight.shape)
    return "dot", attn.num_heads, attn.head_dim


def _per_block(values: list[float], like: torch.Tensor) -> Scalar:
    """Python numbers, one a block: the number where all are equal, else a (blocks,) tensor on ``like``'s device
    (made by fills, not copied from the host: a copy from pageable memory would wait for the GPU)."""
    if all(v == values[0] for v in values):
        return float(values[0])
    return torch.stack([like.new_full((), float(v)) for v in values])


def _norms(tensors: list[torch.Tensor | None], like: torch.Tensor, shape: tuple = ()) -> Scalar:
    """‖t‖ of each tensor (over its trailing dimensions beyond ``shape``), stacked, in ``like``'s dtype: 0.0 where
    none is given, a zero for each missing one."""
    if all(t is None for t in tensors):
        return 0.0
    present = next(t for t in tensors if t is not None)
    rows = [(t if t is not None else torch.zeros_like(present)).reshape(*shape, -1) for t in tensors]
    return row_norms(torch.stack(rows).to(like.dtype))


def _mlp(blocks: list, sigmas: dict[str, torch.Tensor], a: Scalar, like: torch.Tensor) -> tuple[torch.Tensor, Scalar]:
    """Each block's MLP: (its factor (1 − a) + a·‖W₂‖λ‖W₁‖, which is also the slope of its size map, and the map's
    offset a·(‖W₂‖λ‖b₁‖ + ‖b₂‖)), (blocks,) each."""
    w_1 = torch.stack([sigmas[f"{i}.fc1"] for i in range(len(blocks))])
    w_2 = torch.stack([sigmas[f"{i}.fc2"] for i in range(len(blocks))])
    gain = w_2 * _per_block([activation_lipschitz(wrapper.block.mlp.act) for wrapper in blocks], like)
    mlps = [wrapper.block.mlp for wrapper in blocks]
    b_1, b_2 = _norms([m.fc1.bias for m in mlps], like), _norms([m.fc2.bias for m in mlps], like)
    offset = 0.0 if isinstance(b_1, float) and isinstance(b_2, float) else a * (gain * b_1 + b_2)
    return (1 - a) + a * gain * w_1, offset


def _unbound(values: Scalar, count: int) -> list:
    """A (blocks,) tensor as its blocks' scalars — unbound, not indexed: the backward then stacks their gradients
    once, where an index each would write a zero-filled copy of the whole for every block —, or a number repeated."""
    return list(values.unbind(0)) if isinstance(values, torch.Tensor) else [values] * count


def _carry_sizes(r: torch.Tensor, attention: tuple | list, mlp_factor: torch.Tensor,
                 mlp_offset: Scalar) -> torch.Tensor:
    """(blocks,): the size of the tokens entering each block, carried from the embedding's ``r`` through each block's
    attention map — linear, (slopes, offsets) for all blocks, or a :class:`_BiasedSize` each — and its MLP."""
    count = len(mlp_factor)
    sizes = []
    if isinstance(attention, tuple):  # both maps linear: a block is one multiply-add
        slopes, offsets = attention
        through = _unbound(mlp_factor * slopes, count)
        shifts = _unbound(mlp_factor * offsets + mlp_offset, count)
        for slope, shift in zip(through, shifts):
            sizes.append(r)
            r = slope * r + shift
        return torch.stack(sizes)
    mlp_slopes, mlp_offsets = _unbound(mlp_factor, count), _unbound(mlp_offset, count)
    for size_map, slope, offset in zip(attention, mlp_slopes, mlp_offsets):
        sizes.append(r)
        r = slope * size_map(r) + offset
    return torch.stack(sizes)


class _BiasedSize:
    """r ↦ (1 − a)·r + a·(min(‖W_O‖·‖r_V‖, Σ_h ‖W_O^h‖·r_V^h)/3 + ‖b_O‖), r_V = (‖W_V^h‖·r + ‖b_V^h‖)_h: one block of
    dot-product attention with biases on W_V, as :func:`~.transformer_bounds._dot_attention` sizes it (a norm whose
    gradient at 0 is 0, and the two sides of the min rounded alike, so that a tie splits its gradient alike)."""

    def __init__(self, a: Scalar, whole, w_o, w_v, b_v, bias) -> None:
        self.a, self.whole, self.w_o, self.w_v, self.b_v, self.bias = a, whole, w_o, w_v, b_v, bias

    def __call__(self, r: torch.Tensor) -> torch.Tensor:
        r_v = self.w_v * r + self.b_v  # (H,)
        size = torch.minimum(self.whole * row_norms(r_v), (self.w_o * r_v).sum(-1)) / 3 + self.bias
        return (1 - self.a) * r + self.a * size


class _DotAttention:
    """The Lipschitz transformer's dot-product attention (1/3)·W_O·softmax(c·QKᵀ)·V of every block (H heads each), as
    :func:`~.transformer_bounds._dot_attention` bounds one block."""

    def __init__(self, kind: tuple, blocks: list, sigmas: dict[str, torch.Tensor], tokens: int,
                 like: torch.Tensor) -> None:
        _, heads, _ = kind
        self.tokens, count = tokens, len(blocks)
        attns = [wrapper.block.attn for wrapper in blocks]
        c = _per_block([attn.kernel.s / attn.head_dim for attn in attns], like)
        self.c = c if isinstance(c, float) else c[:, None]
        w = torch.stack([head_sigmas(sigmas, i, part, heads) for i in range(count) for part in "qkv"])
        self.w = w.view(count, 3, heads)  # ‖W_Q^h‖, ‖W_K^h‖, ‖W_V^h‖
        self.w_o = torch.stack([head_sigmas(sigmas, i, "o", heads) for i in range(count)])  # (blocks, H): ‖W_O^h‖
        self.whole = torch.stack([sigmas[f"{i}.o"] for i in range(count)])  # (blocks,): ‖W_O‖
        self.b = _norms([attn.qkv.bias for attn in attns], like, (3, heads))  # (blocks, 3, H), or 0.0
        self.b_o = _norms([attn.proj.bias for attn in attns], like)  # (blocks,), or 0.0

    def size_map(self, a: Scalar) -> tuple | list:
        """r ↦ (1 − a)·r + a·size(r) of every block: (slopes, offsets) where it is linear (no biases on W_V:
        size(r) = min(‖W_O‖·‖W_V^h‖_h, Σ_h ‖W_O^h‖‖W_V^h‖)/3·r + ‖b_O‖), else a :class:`_BiasedSize` each."""
        count = len(self.whole)
        w_v = self.w[:, 2]
        if isinstance(self.b, float):
            spread = torch.minimum(self.whole * row_norms(w_v), (self.w_o * w_v).sum(-1)) / 3
            return (1 - a) + a * spread, a * self.b_o
        columns = [_unbound(part, count) for part in (self.whole, self.w_o, w_v, self.b[:, 2], self.b_o)]
        return [_BiasedSize(weight, *(column[j] for column in columns))
                for j, weight in enumerate(_unbound(a, count))]

    def lipschitz(self, sizes: torch.Tensor) -> torch.Tensor:
        """(blocks,): each block's bound on tokens of size ≤ ``sizes``."""
        r_q, r_k, r_v = (self.w * sizes[:, None, None] + self.b).unbind(1)  # (blocks, H) each
        w_q, w_k, w_v = self.w.unbind(1)
        root = column_sum_bound(self.tokens, 2 * self.c * r_q * r_k).sqrt()
        per_head = root * w_v + self.c * r_v * (r_k * w_q + root * r_q * w_k)
        return torch.minimum(self.whole * row_norms(per_head),
                             (self.w_o * per_head).sum(-1)) / 3


class _LinearAttention:
    """L2 attention (Kim et al.'s Theorem 3.2, divided by its unit constant where unit) or token mixing of every
    block: bounds that need no token size (:func:`~.transformer_bounds._l2_attention`,
    :func:`~.transformer_bounds._token_mixing`); their sizes are linear in it."""

    def __init__(self, kind: tuple, blocks: list, sigmas: dict[str, torch.Tensor], tokens: int,
                 like: torch.Tensor) -> None:
        count = len(blocks)
        attns = [wrapper.block.attn for wrapper in blocks]
        whole = torch.stack([sigmas[f"{i}.o"] for i in range(count)])
        if kind[0] == "mix":
            mixes = torch.stack([attn.mix.weight for attn in attns]).to(like.dtype)
            w = whole * torch.stack([sigmas[f"{i}.v"] for i in range(count)])
            self.lip = torch.stack([sigmas[f"{i}.mix"] for i in range(count)]) * w
            self.slope, self.offset = w * mixes.abs().sum(dim=-1).amax(dim=-1), 0.0
            return
        _, heads, width, unit = kind
        if any(attn.qkv.bias is not None for attn in attns):
            raise NotALipschitzTransformer("L2 attention with biases (its bound is for linear maps)")
        w_q = torch.stack([head_sigmas(sigmas, i, "q", heads) for i in range(count)])  # (blocks, H)
        w_v = torch.stack([head_sigmas(sigmas, i, "v", heads) for i in range(count)])
        self.lip = l2_attention_bound(tokens, width, w_q, w_v, whole)
        self.slope = whole * row_norms(w_q.pow(2) * w_v) / math.sqrt(width)
        self.offset = _norms([attn.proj.bias for attn in attns], like)
        if unit:
            divisor = unit_divisor(tokens, heads, width)
            self.lip, self.slope, self.offset = self.lip / divisor, self.slope / divisor, self.offset / divisor

    def lipschitz(self, sizes: torch.Tensor | None) -> torch.Tensor:
        return self.lip
