"""Specformer: penalise the spectral norms of the query, key and value projections
(Hu et al., ECCV 2024; docs/methods.md#specformer).

    L = Σ_blocks [λ_Q Σ_h σ₁(W_Q^h)² + λ_K Σ_h σ₁(W_K^h)² + λ_V Σ_h σ₁(W_V^h)²]

σ₁ by power iteration: one step per training step, under no_grad, on persistent vectors u, v
(buffers of each attention module, so they are in the state dict and in checkpoints), then
σ = uᵀ W v with the gradient of W only — in float32 with autocast and TF32 off, whatever the
training precision (the weights are float32 under mixed precision; bf16 would round σ by ~2⁻⁸); its gradient
2λσ·u vᵀ is formed in the backward pass, under the run's matmul setting.

Heads: by default W^h is the true per-head projection, a block of d output rows of the fused
qkv weight. ``blocks="columns"`` slices the part's (H·d × D) weight into H column blocks of
D/H input columns instead, as the reference code does. Both bound σ₁ of the whole W_part.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..models import attention_sites
from ..nn.precision import float32_math
from ..nn.spectral import power_iteration, shape_groups, sigma_from_vectors
from .base import ForwardStep, Stabilizer, register_stabilizer

PARTS = ("q", "k", "v")


def head_blocks(qkv_weight: torch.Tensor, part: str, heads: int, blocks: str) -> torch.Tensor:
    """The per-head matrices of ``part`` as one (H, m, n) tensor (a view of the weight)."""
    width = qkv_weight.shape[0] // 3
    w = qkv_weight[PARTS.index(part) * width:(PARTS.index(part) + 1) * width]  # (H·d, D)
    if blocks == "rows":
        return w.view(heads, width // heads, w.shape[1])
    d_in = w.shape[1]
    if d_in % heads:
        raise ValueError(f"specformer: blocks='columns' needs D={d_in} divisible by heads={heads}")
    return w.view(width, heads, d_in // heads).transpose(0, 1)  # (H, H·d, D/H)


def head_sigmas(blocks: list[torch.Tensor], us: list[torch.Tensor], vs: list[torch.Tensor], update: bool,
                iterations: int) -> list[torch.Tensor]:
    """σ = uᵀWv of every head block (H, m, n) → (H,), differentiable in W, in float32 at least (call it inside
    :func:`~stability.nn.precision.float32_math`). With ``update``, first ``iterations`` power-iteration steps on the
    persistent vectors ``us`` (H, m) and ``vs`` (H, n), written back in place. The blocks of one shape are stacked
    and iterated in one batched call."""
    sigmas: list[torch.Tensor] = [None] * len(blocks)  # type: ignore[list-item]
    for indices in shape_groups(blocks):
        for i, value in zip(indices, _iterate_and_evaluate(blocks, us, vs, indices, update, iterations)):
            sigmas[i] = value
    return sigmas


def weighted_squares(blocks: list[torch.Tensor], us: list[torch.Tensor], vs: list[torch.Tensor], lams: list[float],
                     update: bool, iterations: int) -> torch.Tensor:
    """Σ_b λ_b Σ_heads σ₁(W_b^h)² over the head blocks b, as :func:`head_sigmas` computes them; the blocks of one
    shape and one λ are stacked and summed together (blocks with λ_b = 0 are iterated and left out of the sum)."""
    total = 0.0
    for indices in shape_groups(blocks, lams):
        values = _iterate_and_evaluate(blocks, us, vs, indices, update, iterations)  # (G, H)
        if lams[indices[0]] > 0:
            total = total + lams[indices[0]] * values.pow(2).sum()
    return total


def _iterate_and_evaluate(blocks: list[torch.Tensor], us: list[torch.Tensor], vs: list[torch.Tensor],
                          indices: list[int], update: bool, iterations: int) -> torch.Tensor:
    """One group of same-shape blocks stacked (G, H, m, n): the power-iteration step on its persistent vectors (when
    ``update``, written back with one multi-tensor copy each), then σ = uᵀWv, (G, H), differentiable in the weights."""
    stacked = torch.stack([blocks[i] for i in indices])
    stacked = stacked.to(torch.promote_types(stacked.dtype, torch.float32))
    u = torch.stack([us[i] for i in indices]).to(stacked.dtype)
    v = torch.stack([vs[i] for i in indices]).to(stacked.dtype)
    if update:
        u, v = power_iteration(stacked.detach(), u, v, iterations)
        torch._foreach_copy_([us[i] for i in indices], list(u.unbind(0)))
        torch._foreach_copy_([vs[i] for i in indices], list(v.unbind(0)))
    return sigma_from_vectors(stacked, u, v)


@register_stabilizer
class Specformer(Stabilizer):
    """``--stabilizer specformer``.

    Args:
        lam_q, lam_k, lam_v: λ of each projection (0 skips it).
        blocks: ``rows`` (true per-head projections, default) or ``columns`` (reference code).
        iterations: power-iteration steps per training step (the paper: 1).
    """

    name = "specformer"
    compiles_whole_term = True
    summary = "λ_Q,K,V·Σ_heads σ₁(W^h)² by persistent power iteration"
    source = "Hu et al. 2024"

    def __init__(self, lam_q: float = 1e-5, lam_k: float = 1e-5, lam_v: float = 1e-5,
                 blocks: Literal["rows", "columns"] = "rows", iterations: int = 1) -> None:
        for label, lam in (("lam_q", lam_q), ("lam_k", lam_k), ("lam_v", lam_v)):
            if lam < 0:
                raise ValueError(f"specformer: {label} must be >= 0, got {lam}")
        if blocks not in ("rows", "columns"):
            raise ValueError(f"specformer: blocks must be 'rows' or 'columns', got {blocks!r}")
        if iterations < 1:
            raise ValueError(f"specformer: iterations must be >= 1, got {iterations}")
        self.lam_q, self.lam_k, self.lam_v = lam_q, lam_k, lam_v
        self.blocks, self.iterations = blocks, iterations
        self._compiled = False
        self._compiled_penalty = None

    def _lams(self) -> dict[str, float]:
        return {p: lam for p, lam in zip(PARTS, (self.lam_q, self.lam_k, self.lam_v)) if lam > 0}

    def prepare(self, network: nn.Module) -> None:
        sites = attention_sites(network)
        if not sites:
            raise ValueError("specformer: the network has no attention module with a fused qkv projection")
        generator = torch.Generator().manual_seed(0)
        for site in sites:
            for part in PARTS:
                w = head_blocks(site.qkv.weight, part, site.num_heads, self.blocks)
                u = F.normalize(torch.randn(w.shape[:2], generator=generator, device="cpu"), dim=-1).to(w.device)
                v = F.normalize(torch.randn(w.shape[0], w.shape[2], generator=generator, device="cpu"), dim=-1)
                v = v.to(w.device)
                site.module.register_buffer(f"specformer_u_{part}", u)
                site.module.register_buffer(f"specformer_v_{part}", v)

    def sigmas(self, network: nn.Module, update: bool = True) -> dict[str, list[torch.Tensor]]:
        """σ₁ estimates per part: a list (one per attention module) of (H,) tensors with gradient.
        ``update`` runs the power iteration first (once per training step). All head blocks of
        one shape (every layer and part, usually) are iterated and evaluated in one batched call."""
        keys, blocks, us, vs = self._blocks(network)
        with float32_math(blocks[0].device.type):
            sigmas = head_sigmas(blocks, us, vs, update, self.iterations)
        out: dict[str, list[torch.Tensor]] = {p: [] for p in PARTS}
        for (_, part), sigma in zip(keys, sigmas):
            out[part].append(sigma)
        return out

    def _blocks(self, network: nn.Module) -> tuple[list, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(site, part) keys, the head blocks (views of the qkv weights: no copy) and their persistent u, v buffers."""
        keys = [(site, part) for site in attention_sites(network) for part in PARTS]
        blocks = [head_blocks(site.qkv.weight, part, site.num_heads, self.blocks) for site, part in keys]
        us = [getattr(site.module, f"specformer_u_{part}") for site, part in keys]
        vs = [getattr(site.module, f"specformer_v_{part}") for site, part in keys]
        return keys, blocks, us, vs

    def penalty(self, network: nn.Module, update: bool = True) -> torch.Tensor:
        """Σ_parts λ_part Σ_heads σ₁² after this step's power iteration (``update``); under ``--model.compile`` the
        power iteration, the σ's and the sum run as one compiled graph (:meth:`compile_terms`)."""
        keys, blocks, us, vs = self._blocks(network)
        by_part = self._lams()
        lams = [by_part.get(part, 0.0) for _, part in keys]
        penalty = weighted_squares
        if self._compiled:
            if self._compiled_penalty is None:
                self._compiled_penalty = torch.compile(weighted_squares, fullgraph=True, dynamic=False)
            penalty = self._compiled_penalty
        with float32_math(blocks[0].device.type):  # outside the graph: it sets torch's matmul precision
            return penalty(blocks, us, vs, lams, update, self.iterations)

    def compile_terms(self) -> None:
        """Trained compiled: the penalty as one compiled graph (≈ 100 eager launches a step on ViT-S)."""
        self._compiled = True

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled_penalty": None}  # a compiled function does not pickle

    def loss(self, step: ForwardStep) -> torch.Tensor | None:
        if not self._lams():
            return None
        return self.penalty(step.network)
