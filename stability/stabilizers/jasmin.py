"""JaSMin: regularise the softmax Jacobian of every attention row (Yudin et al. 2025).

    k = 0:  L = Σ_{l,h} R_i log g₁(P_i^{l,h})
    k > 1:  L = Σ_{l,h} R_i log( g₁(P_i^{l,h}) / (g_k(P_i^{l,h}) + ε) )

with R_i the max (or mean) over the rows i of an image's attention map, summed over layers l
and heads h, averaged over the batch, and added to the task loss as λ·L (JaSMin, Sec. 4;
restated in docs/methods.md#jasmin). For Swin and CSwin the rows of all windows / stripes of an image
count as the rows of that image's map. g₁ bounds ‖J_softmax(P_i)‖₂ (Theorem 4), so lowering it
lowers the local Lipschitz bound of each head (Theorem 3).

Only the top-(k+1) probabilities of each row enter, so on ViT (``row_statistics="streamed"``, or
``"auto"`` on CUDA) they come from each row's log-sum-exp and top logits computed a block of rows
at a time from the captured queries and keys (:mod:`stability.nn.row_statistics`): the attention
output keeps the fused kernel and no N×N probability map is stored. Swin (relative-position bias,
window masks), CSwin and replaced attention kernels use the materialised maps.
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch

from ..models import supports_query_key_capture
from ..nn.precision import autocast_off, float32_math
from ..nn.row_statistics import products_exact_in_tf32, top_probabilities_streamed
from ..nn.softmax_bounds import g_k_of_top, g_of_pair, top_probabilities
from .base import ForwardStep, Stabilizer, register_stabilizer


def exact_in_tf32(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every (q, k) pair holds values whose products TF32 computes exactly."""
    return all(products_exact_in_tf32(q, k) for q, k in pairs)


def tf32_products(device_type: str) -> bool:
    """Whether float32 products on ``device_type`` run in TF32 now (CUDA, unless the matmul precision is highest)."""
    return device_type == "cuda" and torch.get_float32_matmul_precision() != "highest"


@register_stabilizer
class JaSMin(Stabilizer):
    """``--stabilizer jasmin``.

    Args:
        lam: λ, the weight of the regulariser (0 disables it and keeps the fused attention path).
        k: 0 for the bound variant (log g₁), or k > 1 for the ratio variant log(g₁/(g_k + ε)).
        reduction: ``max`` or ``mean`` over the rows of each attention map.
        eps: ε of the ratio variant, and the floor of g₁ inside the log.
        row_statistics: ``auto`` (streamed on CUDA where the backbone allows it, i.e. plain ViT
            attention; materialised on the CPU, where that is faster; streamed wherever the network trains
            compiled, ``--model.compile true``), ``streamed`` (an error elsewhere) or ``materialized`` (always
            record the probability maps, the fused path off; refused compiled).
    """

    name = "jasmin"
    compiles_whole_term = True  # trained compiled, the streamed statistics run as one graph of their own
    summary = "λ·Σ_{layers,heads} R_rows log g₁(P_i) (k=0) or log(g₁/(g_k+ε)) (k>1) on the attention rows"
    source = "Yudin et al. 2025"

    def __init__(self, lam: float = 1e-3, k: int = 0, reduction: Literal["max", "mean"] = "mean",
                 eps: float = 1e-6, row_statistics: Literal["auto", "streamed", "materialized"] = "auto") -> None:
        if lam < 0:
            raise ValueError(f"jasmin: lam must be >= 0, got {lam}")
        if k == 1 or k < 0:
            raise ValueError(f"jasmin: k must be 0 (log g1) or > 1 (log g1/g_k), got {k}")
        if reduction not in ("max", "mean"):
            raise ValueError(f"jasmin: reduction must be 'max' or 'mean', got {reduction!r}")
        if eps <= 0:
            raise ValueError(f"jasmin: eps must be > 0, got {eps}")
        if row_statistics not in ("auto", "streamed", "materialized"):
            raise ValueError(f"jasmin: row_statistics must be 'auto', 'streamed' or 'materialized', "
                             f"got {row_statistics!r}")
        self.lam, self.k, self.reduction, self.eps = lam, k, reduction, eps
        self.row_statistics = row_statistics
        self.streamed = False
        self._supported = False
        self._compiled = False
        self._compiled_regulariser = None
        self.needs_attention_probs = lam > 0

    @property
    def top_count(self) -> int:
        """How many of each row's largest probabilities g₁ (and g_k) need."""
        return max(self.k, 1) + 1

    def prepare(self, network) -> None:
        self._supported = supports_query_key_capture(network.backbone)
        if self.row_statistics == "streamed" and not self._supported:
            raise ValueError("jasmin: row_statistics='streamed' needs plain ViT attention (Swin's bias and masks, "
                             "CSwin and replaced kernels need the materialised maps); use 'auto' or 'materialized'")
        self._choose(streamed=self.row_statistics == "streamed")

    def on_device(self, device: torch.device) -> None:
        """``auto`` streams on CUDA, where the baseline's fused (flash) attention is worth keeping and
        N×N maps are the memory problem; on the CPU the materialised path is faster (its top-k
        runs once, the streamed backward recomputes the logits; results/benchmarks/)."""
        if self.row_statistics == "auto" and not self._compiled:
            self._choose(streamed=self._supported and device.type == "cuda")

    def compile_refusal(self) -> str | None:
        """Streamed statistics train compiled (the queries and keys are outputs of the compiled graph); the
        materialised maps come from hooks on the explicit attention path, which a compiled graph does not call."""
        if self.lam > 0 and (not self._supported or self.row_statistics == "materialized"):
            return ("its materialised attention maps are read through forward hooks on the explicit attention path, "
                    "which a compiled graph does not call (streamed row statistics, on plain ViT attention, train "
                    "compiled)")
        return None

    def compile_terms(self) -> None:
        """Trained compiled: the streamed statistics, on every device (``auto`` no longer follows the device), as
        one compiled graph (forward and backward) from the queries and keys that the compiled network returns."""
        if self.lam > 0:
            self._compiled = True
            self._choose(streamed=True)

    def __getstate__(self):
        return {**self.__dict__, "_compiled_regulariser": None}  # a compiled function does not pickle

    def _choose(self, streamed: bool) -> None:
        self.streamed = self.lam > 0 and streamed
        self.needs_attention_probs = self.lam > 0 and not self.streamed
        self.needs_queries_keys = self.streamed

    def row_scores(self, probs: torch.Tensor) -> torch.Tensor:
        """log g₁ or log(g₁/(g_k+ε)) of every row: (B', H, N, N) → (B', H, N)."""
        return self.scores_of_top(top_probabilities(probs, self.top_count))

    @property
    def top_columns(self) -> tuple[int, ...]:
        """The positions among each row's k + 1 largest probabilities that g₁ and g_k read: (1st, 2nd) and, for k > 1,
        (k-th, (k+1)-th), counted from 0."""
        return (0, 1) if self.k == 0 else (0, 1, self.k - 1, self.k)

    def scores_of_columns(self, top: torch.Tensor) -> torch.Tensor:
        """:meth:`scores_of_top` from only the probabilities at :attr:`top_columns` (..., N, 2 or 4): g of each
        (x, y) pair (:func:`~stability.nn.softmax_bounds.g_of_pair`), both pairs at once."""
        x, y = top.unflatten(-1, (-1, 2)).unbind(-1)
        g = g_of_pair(x, y)  # (..., N, 1 or 2): g₁ (and g_k); unbound, not indexed (one stack in the backward)
        return self._score(g.squeeze(-1)) if self.k == 0 else self._score(*g.unbind(-1))

    def scores_of_top(self, top: torch.Tensor) -> torch.Tensor:
        """log g₁ or log(g₁/(g_k+ε)) from each row's largest probabilities (..., N, k+1) → (..., N)."""
        return self._score(g_k_of_top(top, 1), g_k_of_top(top, self.k) if self.k else None)

    def _score(self, g1: torch.Tensor, g_k: torch.Tensor | None = None) -> torch.Tensor:
        """log g₁ (k = 0) or log(g₁/(g_k+ε)), g₁ floored at ε."""
        g1 = g1.clamp_min(self.eps)
        return g1.log() if g_k is None else (g1 / (g_k + self.eps)).log()

    def regulariser_streamed(self, queries_keys: list[tuple], batch_size: int,
                             recomputed: bool = False) -> torch.Tensor:
        """L_JaSMin (without λ) from the queries and keys of one forward pass (ViT); ``recomputed``: with the backward
        that torch.compile traces (:func:`~stability.nn.row_statistics.row_statistics_recomputed`)."""
        total = 0.0
        for q, k, scale in queries_keys:
            if recomputed:  # a compiled graph: Inductor fuses the selections (the columns' cat and unbind would
                # cost it four kernels a layer on ViT-S: benchmarks/compiled_kernels.py)
                scores = self.scores_of_top(top_probabilities_streamed(q, k, scale, self.top_count, recomputed=True))
            else:  # eager: only the probabilities g₁ and g_k read (the others' zero gradients not made nor scattered)
                scores = self.scores_of_columns(top_probabilities_streamed(q, k, scale, self.top_count,
                                                                           columns=self.top_columns))  # (B, H, N)
            # max(-1)'s backward goes to the saved index; amax's compares the scores with their max again, which a
            # compiled backward recomputes with other rounding: no score equal, a 0/0 gradient (seen on the CPU)
            reduced = scores.max(-1).values if self.reduction == "max" else scores.mean(-1)
            total = total + reduced.sum(-1).mean()
        return total

    def regulariser_compiled(self, queries_keys: list[tuple]) -> torch.Tensor:
        """:meth:`regulariser_streamed` through one compiled graph, its forward and backward (≈ 90 eager launches a
        layer become ≈ 10 kernels), compiled once for every batch size (the batch dimension is dynamic), in
        torch.compile's default mode whatever ``--model.compile_mode`` (not captured as a CUDA graph). Its products:
        bf16 / fp16 queries and keys multiply exactly at the run's TF32 setting. Float32 ones need IEEE float32, which
        a graph cannot set, in its forward nor in its backward (which runs later, at the run's setting): they take
        the compiled graph where TF32 is off for float32 products (the CPU, or ``highest`` precision), the forward's
        precision set here, and the eager statistics (IEEE in both passes) where a GPU run allows TF32."""
        pairs = [(q, k) for q, k, _ in queries_keys]
        q = pairs[0][0]
        exact = exact_in_tf32(pairs)
        if not exact and tf32_products(q.device.type):
            return self.regulariser_streamed(queries_keys, q.shape[0])
        if self._compiled_regulariser is None:
            self._compiled_regulariser = torch.compile(partial(self.regulariser_streamed, batch_size=0,
                                                               recomputed=True), fullgraph=True)
        for q_or_k in (t for pair in pairs for t in pair):
            torch._dynamo.maybe_mark_dynamic(q_or_k, 0)
        with autocast_off(q.device.type) if exact else float32_math(q.device.type):
            return self._compiled_regulariser(queries_keys)

    def regulariser(self, attention_probs: list[torch.Tensor], batch_size: int) -> torch.Tensor:
        """L_JaSMin (without λ) from the attention maps of one forward pass."""
        total = 0.0
        for probs in attention_probs:
            scores = self.row_scores(probs)  # (B·windows, H, N)
            windows, heads = scores.shape[0] // batch_size, scores.shape[1]
            rows = scores.view(batch_size, windows, heads, -1).transpose(1, 2).reshape(batch_size, heads, -1)
            reduced = rows.amax(-1) if self.reduction == "max" else rows.mean(-1)  # (B, H)
            total = total + reduced.sum(-1).mean()
        return total

    def loss(self, step: ForwardStep) -> torch.Tensor | None:
        if self.lam == 0:
            return None
        if self.streamed:
            if not step.queries_keys:
                raise RuntimeError("jasmin: no queries and keys were recorded for this forward pass")
            if self._compiled:
                return self.lam * self.regulariser_compiled(step.queries_keys)
            return self.lam * self.regulariser_streamed(step.queries_keys, step.inputs.shape[0])
        if not step.attention_probs:
            raise RuntimeError("jasmin: no attention probabilities were recorded for this forward pass")
        return self.lam * self.regulariser(step.attention_probs, step.inputs.shape[0])
