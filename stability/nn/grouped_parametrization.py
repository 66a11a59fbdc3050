"""Parametrised weights computed a group at a time: one batched computation per forward of the network.

A parametrisation such as σReparam's W ↦ (γ/σ₁(W))·W or spectral normalisation's W ↦ W/σ₁(W) runs, per matrix and per
forward, a power-iteration step of a handful of small operators (matrix–vector products, norms, divisions, buffer
copies) and their backward. On a ViT-S that is ≈ 50 matrices × ≈ 20 kernel launches a step: launch-bound on a GPU. The
matrices fall into a few shapes (qkv, proj, fc1, fc2), so :class:`GroupedWeights` computes, before each forward of the
network, every same-shape group's effective weights at once: its originals stacked, its power-iteration step batched
(``bmm``), its buffers written back with one ``_foreach_copy_``. During that forward each member's parametrisation
returns its slice of the group's result, so gradients reach every original through the stack.

The arithmetic is the member's own, batched: a member asked for its weight outside a network forward (a measurement
reading ``module.weight``, a layer called on its own) computes it alone, as before, and is the reference the grouped
path is tested against (tests/test_grouped_parametrization.py). One difference in kind: a weight read twice within
one forward is computed once (as under ``torch.nn.utils.parametrize.cached()``), where the per-matrix path would take
two power-iteration steps.

The hooks sit on a Network's backbone, so that torch.compile of the Network (``--model.compile true``) traces the
grouped step into the network's graph; its matrix–vector products are then fused reductions (:func:`batched_matvec`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from .precision import ieee_float32


def bilinear(left: torch.Tensor, matrices: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """leftᵀ W right for each of G matrices, (G, m), (G, m, n), (G, n) → (G,), differentiable in W, elementwise: its
    gradient left rightᵀ is exact in float32 (as the outer product of one matrix's ``mv`` backward), where a batched
    product with an inner dimension of 1 would round its factors to TF32 on a GPU that allows it."""
    return (matrices * (left.unsqueeze(-1) * right.unsqueeze(-2))).sum((-2, -1))


def batched_matvec(matrices: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """W x for each of G matrices, (G, m, n), (G, n) → (G, m), in IEEE float32 (a power iteration's products, as each
    weight's own ``mv``, which no GPU runs in TF32). Eager: a batched product with TF32 off. Compiled, where a graph
    cannot switch TF32 off: a product and a sum, which Inductor fuses into one reduction kernel."""
    if torch.compiler.is_compiling():
        return (matrices * vectors.unsqueeze(-2)).sum(-1)
    with ieee_float32():
        return torch.bmm(matrices, vectors.unsqueeze(-1)).squeeze(-1)


class GroupedParametrization(nn.Module):
    """A parametrisation whose members of one shape can be computed together.

    Subclasses define :meth:`single` (one matrix: the reference) and :meth:`grouped` (a stack of them); ``forward``
    returns the slice the group computed for the current network forward, when there is one. (No ``__init__``: it
    can come first in the bases of an existing parametrisation, such as torch's spectral norm.)"""

    # during a grouped forward: (this member's effective weight, the original it came from, that original's version)
    _grouped: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self._grouped is not None:
            effective, original, version = self._grouped
            unversioned = version is None and torch.compiler.is_compiling()  # set inside the same trace
            if original is weight and (unversioned or version == weight._version):
                return effective
        return self.single(weight)  # outside a grouped forward, or a slice left from one whose weight changed since

    def __getstate__(self) -> dict:
        """Copies and pickles without a forward's slice (a tensor of its graph: not deep-copyable)."""
        state = super().__getstate__()
        state.pop("_grouped", None)
        return state

    def single(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def grouped(cls, members: Sequence[GroupedParametrization], weights: torch.Tensor) -> torch.Tensor:
        """The effective weights of ``members`` from their originals stacked as ``weights`` (G, *shape)."""
        raise NotImplementedError


class GroupedWeights:
    """Computes the members' effective weights group by group before each forward of ``network`` (a forward pre-hook)
    and forgets them after it (a forward hook, also on an exception; a slice is used only while its original is the
    tensor, at the version, it was computed from, so one left behind by an interrupt is never read).

    ``holders``: the ``ParametrizationList`` of each weight (``module.parametrizations.weight``), whose first
    parametrisation, the member, reads ``original``. Members are grouped by class, training mode, and their original's
    shape, dtype and device at each forward, so a network moved or cast after registration groups correctly."""

    def __init__(self, network: nn.Module, holders: Sequence[nn.Module]) -> None:
        for holder in holders:
            if not isinstance(holder[0], GroupedParametrization):
                raise ValueError(f"a grouped parametrisation must be the first of its weight, got "
                                 f"{[type(p).__name__ for p in holder]}")
        self.holders = list(holders)
        # on a Network, its backbone's hooks: torch.compile of the Network traces them into the network's graph (the
        # hooks of the compiled module itself would run as graphs of their own)
        runner = getattr(network, "backbone", network)
        self._handles = [runner.register_forward_pre_hook(self._before),
                         runner.register_forward_hook(self._after, always_call=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, _module, _args) -> None:
        groups: dict[tuple, list[nn.Module]] = defaultdict(list)
        for holder in self.holders:
            member, original = holder[0], holder.original
            groups[(type(member), member.training, original.shape, original.dtype, original.device)].append(holder)
        for (kind, *_), group in groups.items():
            originals = [holder.original for holder in group]
            effective = kind.grouped([holder[0] for holder in group], torch.stack(originals))
            compiling = torch.compiler.is_compiling()  # a traced forward: no weight changes inside it
            for holder, original, weight in zip(group, originals, effective.unbind(0)):
                holder[0]._grouped = (weight, original, None if compiling else original._version)

    def _after(self, _module, _args, _output) -> None:
        for holder in self.holders:
            holder[0]._grouped = None
