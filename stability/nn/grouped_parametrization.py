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
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn


def bilinear(left: torch.Tensor, matrices: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """leftᵀ W right for each of G matrices, (G, m), (G, m, n), (G, n) → (G,), differentiable in W, elementwise: its
    gradient left rightᵀ is exact in float32 (as the outer product of one matrix's ``mv`` backward), where a batched
    product with an inner dimension of 1 would round its factors to TF32 on a GPU that allows it."""
    return (matrices * (left.unsqueeze(-1) * right.unsqueeze(-2))).sum((-2, -1))


class GroupedParametrization(nn.Module):
    """A parametrisation whose members of one shape can be computed together.

    Subclasses define :meth:`single` (one matrix: the reference) and :meth:`grouped` (a stack of them); ``forward``
    returns the slice the group computed for the current network forward, when there is one. (No ``__init__``: it
    can come first in the bases of an existing parametrisation, such as torch's spectral norm.)"""

    _grouped: torch.Tensor | None = None  # this member's effective weight during a grouped forward
    _grouped_from: tuple | None = None  # (the original, its version) it was computed from

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        made_from = self._grouped_from
        if self._grouped is not None and made_from[0] is weight and made_from[1] == weight._version:
            return self._grouped
        return self.single(weight)  # outside a grouped forward, or a slice left from one whose weight changed since

    def __getstate__(self) -> dict:
        """Copies and pickles without a forward's slices (tensors of its graph: not deep-copyable)."""
        state = super().__getstate__()
        state.pop("_grouped", None)
        state.pop("_grouped_from", None)
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

    ``members``: (the ``ParametrizationList`` holding ``original``, the member: its first parametrisation). Members
    are grouped by class, training mode, and their original's shape, dtype and device at each forward, so a network
    moved or cast after registration groups correctly."""

    def __init__(self, network: nn.Module, members: Sequence[tuple[nn.Module, GroupedParametrization]]) -> None:
        for holder, member in members:
            if holder[0] is not member:
                raise ValueError(f"{type(member).__name__} must be the first parametrisation of its weight, got "
                                 f"{[type(p).__name__ for p in holder]}")
        self.members = list(members)
        self._handles = [network.register_forward_pre_hook(self._before),
                         network.register_forward_hook(self._after, always_call=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, _module, _args) -> None:
        if torch.compiler.is_compiling():  # compiled: each member's own arithmetic, fused by the compiler
            return
        groups: dict[tuple, list[tuple[nn.Module, GroupedParametrization]]] = defaultdict(list)
        for holder, member in self.members:
            original = holder.original
            groups[(type(member), member.training, original.shape, original.dtype, original.device)].append(
                (holder, member))
        for (kind, *_), group in groups.items():
            stacked = torch.stack([holder.original for holder, _ in group])
            effective = kind.grouped([member for _, member in group], stacked)
            for (holder, member), weight in zip(group, effective.unbind(0)):
                member._grouped, member._grouped_from = weight, (holder.original, holder.original._version)

    def _after(self, _module, _args, _output) -> None:
        if torch.compiler.is_compiling():
            return
        for _, member in self.members:
            member._grouped = member._grouped_from = None
