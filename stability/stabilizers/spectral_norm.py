"""Spectral normalisation: keep chosen Linear weights at σ₁ ≤ σ_max (Miyato et al. 2018).

Two ways, chosen with ``mode``:

* ``parametrize``: W_eff = σ_max · W / σ̂(W) as ``torch.nn.utils.parametrizations.spectral_norm``
  computes it (σ̂ by one power iteration per training forward, on persistent vectors; torch's buffers and keys),
  the weights of one shape together in a forward of the network (:class:`GroupedSpectralNorm`). The effective
  weight has σ₁ = σ_max (up to the power iteration's error), not merely ≤; the raw parameter is unconstrained.
* ``project``: after every optimizer step, W ← W / max(1, σ₁(W)/σ_max): the stored weight itself is
  capped, and a weight below the cap is left alone. How σ₁ is known, ``method``:

  - ``iterative`` (default): σ₁ from a persistent block power iteration with Rayleigh–Ritz
    (:class:`~stability.nn.spectral.SubspaceIteration`: Miyato et al.'s warm-started power iteration with a
    block of 8 vectors), ``iterations`` steps per training step, its vectors kept as buffers of each
    Linear (batched by shape, float32, matmuls only, no host sync). Its estimate σ̂ = ‖Wv‖ lies below σ₁, so
    a weight at the cap can sit above it by the estimate's error (measured at most 6e-6 of σ_max on digits
    at AdamW lr 1e-2). Every ``check_every`` steps the exact σ₁ of every
    weight is computed (eigenvalues of the Gram matrix, float64; one host sync): a weight found above
    the cap is projected exactly, the largest relative excess found is kept (``largest_excess``,
    logged as ``stability/spectral_norm/excess``) and a warning is raised once it exceeds
    ``tolerance``. The cap is therefore never exceeded silently, and exactly enforced at every check.
  - ``exact``: certified at every step. Each weight keeps an upper bound b ≥ σ₁ — its exact σ₁ when last
    computed plus ‖ΔW‖_F of every step since (σ₁(W + ΔW) ≤ σ₁(W) + ‖ΔW‖_F) — and its exact σ₁ is
    computed only where b reaches the cap. Weights below the cap cost almost nothing; a weight at the
    cap costs an eigensolver every step, and deciding which needs a host sync per step.

``layers`` picks the weights: ``all`` (every Linear of the backbone, the classifier head
included), ``attention`` (qkv and output projections) or ``mlp``. Convolutions (patch
embedding, CSwin's LePE and merges) are not touched: the σ₁ of a reshaped kernel is not a
convolution's operator norm.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm

from ..models import linear_layers
from ..nn.grouped_parametrization import GroupedParametrization, GroupedWeights, batched_matvec, bilinear
from ..nn.precision import autocast_off
from ..nn.spectral import SubspaceIteration, spectral_norms
from .base import Stabilizer, register_stabilizer


class GroupedSpectralNorm(GroupedParametrization, _SpectralNorm):
    """torch's spectral normalisation of a Linear weight (``torch.nn.utils.parametrizations.spectral_norm``: its
    buffers, initialisation and state-dict keys), whose weights of one shape are computed together in a forward of
    the network (:mod:`~stability.nn.grouped_parametrization`): u ← normalise(W v), v ← normalise(Wᵀ u) per training
    forward, σ = uᵀ W v, W / σ. Both the grouped step and each weight's own run in the weights' precision with
    autocast off, as σReparam's reference does (torch's own matrix–vector products follow autocast: bf16 on a GPU,
    where σ̂ would be off by ~2⁻⁸); the grouped step's batched products also with TF32 off, as eager ``mv`` never
    takes it."""

    def __init__(self, weight: torch.Tensor, factor: float = 1.0) -> None:
        super().__init__(weight)  # torch's defaults: one power iteration, dim 0, eps 1e-12
        self.factor = factor  # σ_max: the effective weight's σ₁

    def single(self, weight: torch.Tensor) -> torch.Tensor:
        with autocast_off(weight.device.type):  # float32 σ̂, as the grouped step (class docstring)
            normalised = _SpectralNorm.forward(self, weight)
        return normalised if self.factor == 1.0 else self.factor * normalised

    @classmethod
    def grouped(cls, members, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`single` for G matrices of one shape at once: ``weights`` (G, m, n) → (G, m, n)."""
        first = members[0]
        with autocast_off(weights.device.type):
            with torch.no_grad():  # matrix–vector products in IEEE float32, as torch's own
                u = torch.stack([m._u for m in members])
                v = torch.stack([m._v for m in members])
                if first.training:
                    for _ in range(first.n_power_iterations):
                        u = F.normalize(batched_matvec(weights, v), dim=-1, eps=first.eps)
                        v = F.normalize(batched_matvec(weights.mH, u), dim=-1, eps=first.eps)
                    torch._foreach_copy_([m._u for m in members], list(u.unbind(0)))
                    torch._foreach_copy_([m._v for m in members], list(v.unbind(0)))
            sigma = bilinear(u, weights, v)
        return weights * (first.factor / sigma).view(-1, 1, 1)


@register_stabilizer
class SpectralNorm(Stabilizer):
    """``--stabilizer spectral_norm``.

    Args:
        sigma_max: the cap on σ₁ (spectral norm, ℓ2→ℓ2).
        mode: ``project`` (after each step) or ``parametrize`` (torch's spectral_norm).
        layers: ``all``, ``attention`` or ``mlp``.
        method: how ``project`` knows σ₁: ``iterative`` (power iteration, exact checks) or ``exact``.
        iterations: power-iteration steps per training step (``iterative``).
        check_every: steps between exact checks (``iterative``; 0: never).
        tolerance: relative excess over the cap found at a check beyond which a warning is raised.
    """

    name = "spectral_norm"
    summary = "σ₁ ≤ σ_max for chosen Linear weights (projection or parametrisation)"
    source = "Miyato et al. 2018"

    def __init__(self, sigma_max: float = 1.0, mode: Literal["project", "parametrize"] = "project",
                 layers: Literal["all", "attention", "mlp"] = "all",
                 method: Literal["iterative", "exact"] = "iterative", iterations: int = 1,
                 check_every: int = 100, tolerance: float = 1e-3) -> None:
        if sigma_max <= 0:
            raise ValueError(f"spectral_norm: sigma_max must be > 0, got {sigma_max}")
        if mode not in ("project", "parametrize"):
            raise ValueError(f"spectral_norm: mode must be 'project' or 'parametrize', got {mode!r}")
        if layers not in ("all", "attention", "mlp"):
            raise ValueError(f"spectral_norm: layers must be 'all', 'attention' or 'mlp', got {layers!r}")
        if method not in ("iterative", "exact"):
            raise ValueError(f"spectral_norm: method must be 'iterative' or 'exact', got {method!r}")
        if iterations < 1 or check_every < 0 or tolerance < 0:
            raise ValueError(f"spectral_norm: need iterations >= 1, check_every >= 0 (0: never) and tolerance >= 0; "
                             f"got {iterations}, {check_every}, {tolerance}")
        self.sigma_max, self.mode, self.layers = sigma_max, mode, layers
        self.method, self.iterations, self.check_every, self.tolerance = method, iterations, check_every, tolerance
        self._power: SubspaceIteration | None = None
        self._grouped: GroupedWeights | None = None  # ``parametrize``: the weights' power steps, a shape at a time
        self.largest_excess = 0.0  # relative excess over the cap found at the exact checks so far
        self.exact_computations = 0  # exact σ₁'s computed (``exact``: per step, where the bound reaches the cap)
        self._warned = False

    def compile_terms(self) -> None:
        """Trained compiled: the per-step power iteration of the projection (a block power iteration with
        Rayleigh–Ritz over every weight) as one compiled graph."""
        if self._power is not None:
            self._power.compile()

    def prepare(self, network: nn.Module) -> None:
        linears = linear_layers(network, self.layers)
        if not linears:
            raise ValueError(f"spectral_norm: no Linear layers selected by layers={self.layers!r}")
        if self.mode == "parametrize":
            for linear in linears:  # as torch's spectral_norm(linear), times σ_max
                parametrize.register_parametrization(linear, "weight",
                                                     GroupedSpectralNorm(linear.weight, self.sigma_max))
            self._grouped = GroupedWeights(network, [linear.parametrizations.weight for linear in linears])
            return
        self._project_exactly([linear.weight for linear in linears])  # a certified start
        if self.method == "iterative":
            self._power = SubspaceIteration.of_weights(linears, "spectral_norm")
            self._power.step(self._weights(), iterations=30)  # warm start

    def _weights(self) -> list[torch.Tensor]:
        return [module.weight for module, _ in self._power.homes]

    def signals(self) -> dict[str, float]:
        return {"excess": self.largest_excess} if self.mode == "project" and self.method == "iterative" else {}

    @torch.no_grad()
    def after_optimizer_step(self, network: nn.Module, global_step: int = 0) -> None:
        if self.mode != "project":
            return
        if self.method == "exact":
            self._certified_step(network)
            return
        weights = self._weights()
        for group in self._power.step(weights, self.iterations):  # σ̂ ≤ σ₁ per matrix, on the device
            factors = (self.sigma_max / group.sigma).clamp(max=1.0)  # 1 below the cap: the weight is untouched
            torch._foreach_mul_([weights[i] for i in group.indices],
                                [f.to(weights[i].dtype) for i, f in zip(group.indices, factors.unbind(0))])
        if self.check_every and (global_step + 1) % self.check_every == 0:
            self.check(weights)

    @torch.no_grad()
    def check(self, weights: list[torch.Tensor]) -> float:
        """The exact σ₁ of every weight: project those above the cap exactly, keep and return the largest
        relative excess found (a host sync)."""
        excess = self._project_exactly(weights)
        self.largest_excess = max(self.largest_excess, excess)
        if excess > self.tolerance and not self._warned:
            rank_zero_warn(f"spectral_norm: an exact check found σ₁ = {1 + excess:.4g}·σ_max after the "
                           f"power-iteration projection (tolerance {self.tolerance:g}); it is projected exactly "
                           f"now. Raise --spectral_norm.iterations, check more often, or use method: exact")
            self._warned = True
        return excess

    @torch.no_grad()
    def _project_exactly(self, weights: list[torch.Tensor]) -> float:
        """W ← W·σ_max/σ₁ where σ₁ > σ_max, from exact σ₁'s; returns the largest relative excess found."""
        sigmas = spectral_norms(weights)
        self.exact_computations += len(weights)
        worst = 0.0
        for weight, sigma in zip(weights, sigmas.tolist()):
            if sigma > self.sigma_max:
                weight.mul_(self.sigma_max / sigma)
                worst = max(worst, sigma / self.sigma_max - 1)
        self._bounds = torch.clamp(sigmas.cpu(), max=self.sigma_max)
        self._previous = [w.detach().clone() for w in weights] if self.method == "exact" else None
        return worst

    def _certified_step(self, network: nn.Module) -> None:
        """``method: exact``: the bound b = last exact σ₁ + Σ‖ΔW‖_F decides which weights need an exact σ₁."""
        weights = [linear.weight for linear in linear_layers(network, self.layers)]
        previous = getattr(self, "_previous", None)
        if previous is None or len(previous) != len(weights) or any(
                p.shape != w.shape or p.device != w.device for p, w in zip(previous, weights)):
            bounds = torch.full((len(weights),), float("inf"), dtype=torch.float64)  # unknown: compute all
        else:
            steps = torch.stack([(w - p).double().norm() for w, p in zip(weights, previous)]).cpu()
            bounds = self._bounds + steps * (1 + 1e-12)
        unsure = [i for i, b in enumerate(bounds.tolist()) if b > self.sigma_max]
        if unsure:
            sigmas = spectral_norms([weights[i] for i in unsure])  # exact σ₁, batched per shape
            for i, sigma in zip(unsure, sigmas.tolist()):
                if sigma > self.sigma_max:
                    weights[i].mul_(self.sigma_max / sigma)
                bounds[i] = min(sigma, self.sigma_max)
        self._bounds = bounds
        self._previous = [w.detach().clone() for w in weights]
        self.exact_computations += len(unsure)
