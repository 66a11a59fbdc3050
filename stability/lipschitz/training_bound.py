"""The model's Lipschitz bound as a certified-training loss reads it at every step
(:class:`~stability.certified_training.MarginBound`: the bound of pixels → logits, and, where the logits are a
linear head, the bound of its input and its weight for the per-pair constants).

* **Lipschitz transformer** (ViT): the pixel bound of :mod:`.transformer_bounds` composed from σ₁ estimates of
  every matrix by a persistent block power iteration (:class:`~stability.nn.spectral.SubspaceIteration`, one step
  per training step, as Tsuzuku et al. do), on bases kept as buffers of the network, in float32 with autocast off;
  differentiable through the estimates (σ̂ = uᵀWv, u and v held constant) unless ``differentiable`` is off. The
  estimates approach σ₁ from below, so the training bound is at most the certified one; certification (at test)
  always uses the exact bound. The hybrid's AOL stem enters as 1 per layer (by construction), as the anchor's
  layers do.
* **The convolutional anchor** (``lipcnn``): every hidden layer is 1-Lipschitz by construction (AOL), so the
  features' bound is 1/min σ_pixel, a constant; the head's weight is the trained one (with its gradient), its σ₁
  estimated on the device (:func:`~stability.nn.spectral.top_singular_value`).
* **LipsFormer** (ViT): the certified bound recomputed exactly, constant for the step (float64 and a host sync
  per step: that combination is not GPU-tuned).

No value is read back to the host (but LipsFormer's), and nothing is made off the network's device.
"""
from __future__ import annotations

import torch
from torch import nn

from ..certified_training.losses import MarginBound
from ..models.adapters import SplitQKV
from ..models.hybrid import is_stem
from ..nn.lipschitz_blocks import effective_weight
from ..nn.precision import at_least_float32, float32_math
from ..nn.spectral import SubspaceIteration, top_singular_value
from .certified import certified_bound
from .conv_bounds import is_lipconvnet
from .stacked_bound import stacked_pixel_bound
from .transformer_bounds import NotALipschitzTransformer, _parts, bound_matrices


class TrainingBound:
    """Args:
        owner: the stabilizer's name; the power iteration's bases are the network's buffers ``<owner>_<i>_basis``.
        iterations: power-iteration steps per training step (Lipschitz transformer).
        differentiable: let the loss's gradient flow into the bound (it then also pulls the bound down).
    """

    def __init__(self, owner: str, iterations: int = 1, differentiable: bool = True) -> None:
        if iterations < 1:
            raise ValueError(f"{owner}: iterations must be >= 1, got {iterations}")
        self.owner, self.iterations, self.differentiable = owner, iterations, differentiable
        self.source = ""
        self._names: list[str] = []
        self._power: SubspaceIteration | None = None
        self._kind = ""
        self._head_blocks: list[int] = []  # blocks whose per-head σ are computed from the whole qkv and W_O at once
        self.compiled = False  # :meth:`compile`: the composition compiled at its first call
        self._compiled_composition = None  # not pickled: compiled again where the bound is unpickled

    def prepare(self, network: nn.Module) -> None:
        """Pick the computation for this network (after every architecture change); a ValueError where it has no
        certified bound."""
        bound, reason = certified_bound(network)
        if bound is None:
            raise ValueError(f"{self.owner} needs a model with a certified Lipschitz bound ({reason}); use it with "
                             f"lipschitz_transformer (or lipsformer) on ViT, or with --model.backbone lipcnn")
        if is_lipconvnet(network):
            self._kind, self.source = "aol", "1 per hidden layer by construction (AOL), the trained head"
            return
        try:
            matrices = bound_matrices(network)
        except NotALipschitzTransformer:
            self._kind, self.source = "exact", "certified bound, exact, constant per step (LipsFormer)"
            return
        self._kind = "power"
        self.source = ("power-iteration σ₁ estimates, " + ("differentiable" if self.differentiable else
                       "constant per step") + " (Lipschitz transformer)")
        self._names = list(matrices)
        self._head_blocks = [i for i, attn in enumerate(_attentions(network)) if _heads_in_place(attn, matrices, i)]
        self._power = SubspaceIteration([(network, f"{self.owner}_{i}") for i in range(len(self._names))],
                                        [tuple(m.shape) for m in matrices.values()])
        self._power.step([m.detach() for m in matrices.values()], iterations=30)  # warm start
        if self.compiled:
            self._power.compile()

    def estimated_sigmas(self, network: nn.Module) -> dict[str, torch.Tensor]:
        """σ̂ = uᵀWv of every matrix of the bound after the step's power iteration, float32, differentiable in W.

        The heads' matrices are rows of a block's W_Q, W_K, W_V and columns of its W_O: their σ̂ come from those
        weights viewed as (3, H, d, D) and (D, H, d), every block of one geometry at once (one product per kind for
        all of them: ``"<i>.q[heads]"``… and ``"<i>.o[heads]"``, vectors over the heads), instead of a slice of the
        weight per head, whose backward would write a zero-filled copy of the whole weight for every head, or a
        product per block."""
        matrices = bound_matrices(network)
        weights = [matrices[name] for name in self._names]
        sigmas: dict[str, torch.Tensor] = {}
        if is_stem(network.backbone.patch_embed):  # the hybrid's AOL stem: 1 per layer by construction
            sigmas["stem"] = at_least_float32(network.mean.new_ones(()))  # float64 for a float64 network
        groups = self._power.step(weights, self.iterations)
        where = {self._names[i]: (g, j) for g, group in enumerate(groups) for j, i in enumerate(group.indices)}
        in_blocks = set()
        attentions, dtype = _attentions(network), groups[0].u.dtype
        kinds: dict[tuple, list[int]] = {}  # head blocks by geometry (H, d, D)
        for i in self._head_blocks:
            attn = attentions[i]
            kinds.setdefault((attn.num_heads, attn.head_dim, attn.proj.weight.shape[0]), []).append(i)
        for (heads, width, _), blocks in kinds.items():
            qkv = [f"{i}.{part}{h}" for i in blocks for part in "qkv" for h in range(heads)]
            u, v = _vectors(groups, where, qkv)
            rows = torch.stack([part for i in blocks for part in _qkv_parts(attentions[i])])  # one stack, (3B, H·d, D)
            rows = rows.view(len(blocks), 3, heads, width, -1)
            values = torch.einsum("bphm,bphmn,bphn->bph", u.view(len(blocks), 3, heads, width), rows.to(dtype),
                                  v.view(len(blocks), 3, heads, -1))
            outputs = [f"{i}.o{h}" for i in blocks for h in range(heads)]
            u_o, v_o = _vectors(groups, where, outputs)  # (B·H, D), (B·H, d)
            w_o = torch.stack([attentions[i].proj.weight for i in blocks]).view(len(blocks), -1, heads, width)
            values_o = torch.einsum("bhm,bmhn,bhn->bh", u_o.view(len(blocks), heads, -1), w_o.to(dtype),
                                    v_o.view(len(blocks), heads, width))  # column block h of W_O is head h's W_O^h
            # unbound, not indexed: the backward then stacks the pieces' gradients once, where an index each would
            # write a zero-filled copy of the whole (B, 3, H) result
            sigmas.update(zip([f"{i}.{part}[heads]" for i in blocks for part in "qkv"], values.flatten(0, 1).unbind(0)))
            sigmas.update(zip([f"{i}.o[heads]" for i in blocks], values_o.unbind(0)))
            in_blocks.update(qkv + outputs)
        for group in groups:
            rest = [j for j, i in enumerate(group.indices) if self._names[i] not in in_blocks]
            if not rest:
                continue
            u, v = (group.u, group.v) if len(rest) == len(group.indices) else (group.u[rest], group.v[rest])
            stacked = torch.stack([weights[group.indices[j]] for j in rest]).to(group.weight.dtype)  # with the graph
            values = torch.einsum("gm,gmn,gn->g", u, stacked, v)
            sigmas.update({self._names[group.indices[j]]: value for j, value in zip(rest, values.unbind(0))})
        return sigmas

    def __call__(self, network: nn.Module) -> MarginBound:
        if not self._kind:
            raise RuntimeError(f"{self.owner}: TrainingBound.prepare(network) was not called")
        scale = abs(network.logit_scale)
        if self._kind == "aol":
            with float32_math(network.mean.device.type):  # bf16 autocast would round the head and its σ₁ estimate
                features = (1.0 / network.std.min()).to(torch.promote_types(network.std.dtype, torch.float32))
                head = at_least_float32(effective_weight(network.backbone.head)) * scale
                return self._detached(MarginBound(features * top_singular_value(head), features, head))
        if self._kind == "power":
            with float32_math(network.mean.device.type):
                total, features = self.composition()(network, self.estimated_sigmas(network))
            return self._detached(MarginBound(total, features, effective_weight(network.backbone.head) * scale))
        bound, reason = certified_bound(network)
        if bound is None:
            raise RuntimeError(f"{self.owner}: the model lost its certified bound ({reason})")
        like = network.mean
        return MarginBound(like.new_tensor(bound.value),
                           None if bound.features is None else like.new_tensor(bound.features),
                           None if bound.head_weight is None else bound.head_weight.to(like))

    def compile(self) -> None:
        """Compose the estimates into the bound in one compiled graph (``--model.compile``). Eagerly the
        composition, stacked over the blocks, is 285 launches forward and backward on ViT-S (a few a block and a
        fixed number besides: launch-bound on a GPU), where Inductor writes 28 kernels (benchmarks/compiled_kernels.py).
        The power iteration before it is compiled too, as one graph of its own (:meth:`SubspaceIteration.compile`),
        called inside the IEEE-float32 context, which sets torch's matmul precision (something a graph cannot
        do)."""
        self.compiled = True
        if self._power is not None:
            self._power.compile()

    def composition(self):
        """:func:`composed_bound`, compiled (once) where :meth:`compile` asked for it."""
        if not self.compiled:
            return composed_bound
        if self._compiled_composition is None:
            self._compiled_composition = torch.compile(composed_bound, fullgraph=True, dynamic=False)
        return self._compiled_composition

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled_composition": None}  # a compiled function does not pickle

    def _detached(self, bound: MarginBound) -> MarginBound:
        if self.differentiable:
            return bound
        return MarginBound(*(None if t is None else t.detach() for t in (bound.total, bound.features, bound.head)))


def composed_bound(network: nn.Module, sigmas: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The Lipschitz transformer's pixel bound from σ̂ estimates, differentiable (:func:`.transformer_bounds.pixel_bound`
    with ``sigmas``, composed for all blocks at once: :func:`.stacked_bound.stacked_pixel_bound`): what
    :meth:`TrainingBound.compile` compiles."""
    return stacked_pixel_bound(network, sigmas)


def _vectors(groups: list, where: dict[str, tuple[int, int]], names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The power iteration's (u, v) of ``names``, stacked in that order: a slice of their group's vectors (no copy)
    where they lie in one group in that order (the heads' W_O^h, listed block by block and head by head), else
    stacked one by one (the heads' W_Q^h, W_K^h, W_V^h, which :func:`bound_matrices` lists head by head, not part by
    part; one launch a stack on a GPU up to 128 vectors)."""
    places = [where[name] for name in names]
    first, start = places[0]
    if places == [(first, start + k) for k in range(len(names))]:
        group = groups[first]
        return group.u[start:start + len(names)], group.v[start:start + len(names)]
    return (torch.stack([groups[g].u[j] for g, j in places]), torch.stack([groups[g].v[j] for g, j in places]))


def _attentions(network: nn.Module) -> list[nn.Module]:
    """Each block's attention module (token mixing included), in block order."""
    return [wrapper.block.attn for wrapper in _parts(network)[2]]


def _qkv_parts(attn: nn.Module) -> list[torch.Tensor]:
    """W_Q, W_K, W_V of an attention module, each (H·d, D): a split projection's three weights (the hybrid's unit
    attention shares W_K = W_Q), or views of a fused one's weight."""
    qkv = attn.qkv
    if isinstance(qkv, SplitQKV):
        return [qkv.q.weight, qkv.k.weight, qkv.v.weight]
    return list(qkv.weight.view(3, -1, qkv.weight.shape[-1]).unbind(0))


def _qkv_rows(attn: nn.Module) -> torch.Tensor:
    """W_Q, W_K, W_V of an attention module as (3, H·d, D)."""
    return torch.stack(_qkv_parts(attn))


def _heads_in_place(attn: nn.Module, matrices: dict[str, torch.Tensor], i: int) -> bool:
    """Whether block i's per-head matrices of :func:`bound_matrices` are the rows h·d … (h + 1)·d of W_Q, W_K, W_V
    and the same columns of W_O (then :meth:`TrainingBound.estimated_sigmas` takes every head from the weights at
    once); checked on their values, at preparation."""
    heads, width = getattr(attn, "num_heads", 0), getattr(attn, "head_dim", 0)
    if f"{i}.q0" not in matrices or not heads:
        return False
    with torch.no_grad():
        parts, w_o = _qkv_rows(attn), attn.proj.weight
        if parts.shape[1] != heads * width or w_o.shape[1] != heads * width:
            return False
        rows, columns = parts.view(3, heads, width, -1), w_o.view(w_o.shape[0], heads, width)
        return all(torch.equal(matrices[f"{i}.{part}{h}"], rows[p, h])
                   and torch.equal(matrices[f"{i}.o{h}"], columns[:, h])
                   for p, part in enumerate("qkv") for h in range(heads))


__all__ = ["TrainingBound"]
