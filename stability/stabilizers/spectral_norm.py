"""Spectral normalisation: keep chosen Linear weights at σ₁ ≤ σ_max (Miyato et al. 2018).

Two ways, chosen with ``mode``:

* ``parametrize``: W_eff = σ_max · W / σ̂(W) through
  ``torch.nn.utils.parametrizations.spectral_norm`` (σ̂ by one power iteration per training
  forward, on persistent vectors). The effective weight has σ₁ = σ_max (up to the power
  iteration's error), not merely ≤; the raw parameter is unconstrained.
* ``project``: after every optimizer step, W ← W / max(1, σ₁(W)/σ_max) with the exact σ₁
  (top eigenvalue of the smaller Gram matrix, float64). The parameter itself satisfies
  σ₁ ≤ σ_max at every step; weights already below the cap are left alone. The exact σ₁ is only
  computed for weights that may be above the cap: each weight keeps a certified upper bound
  b ≥ σ₁, its exact σ₁ when last computed plus ‖ΔW‖_F of every step since (σ₁(W + ΔW) ≤ σ₁(W) +
  σ₁(ΔW) ≤ σ₁(W) + ‖ΔW‖_F); where b ≤ σ_max the projection is the identity and nothing is computed.
  (Useful while weights are below the cap with small steps; a weight at the cap is computed
  exactly every step.)

``layers`` picks the weights: ``all`` (every Linear of the backbone, the classifier head
included), ``attention`` (qkv and output projections) or ``mlp``. Convolutions (patch
embedding, CSwin's LePE and merges) are not touched: the σ₁ of a reshaped kernel is not a
convolution's operator norm.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm as torch_spectral_norm

from ..models import linear_layers
from ..nn.spectral import spectral_norms
from .base import Stabilizer, register_stabilizer


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return self.factor * weight


@register_stabilizer
class SpectralNorm(Stabilizer):
    """``--stabilizer spectral_norm``.

    Args:
        sigma_max: the cap on σ₁ (spectral norm, ℓ2→ℓ2).
        mode: ``project`` (after each step, exact) or ``parametrize`` (torch's spectral_norm).
        layers: ``all``, ``attention`` or ``mlp``.
    """

    name = "spectral_norm"
    summary = "σ₁ ≤ σ_max for chosen Linear weights (projection or parametrisation)"
    source = "Miyato et al. 2018"

    def __init__(self, sigma_max: float = 1.0, mode: Literal["project", "parametrize"] = "project",
                 layers: Literal["all", "attention", "mlp"] = "all") -> None:
        if sigma_max <= 0:
            raise ValueError(f"spectral_norm: sigma_max must be > 0, got {sigma_max}")
        if mode not in ("project", "parametrize"):
            raise ValueError(f"spectral_norm: mode must be 'project' or 'parametrize', got {mode!r}")
        if layers not in ("all", "attention", "mlp"):
            raise ValueError(f"spectral_norm: layers must be 'all', 'attention' or 'mlp', got {layers!r}")
        self.sigma_max, self.mode, self.layers = sigma_max, mode, layers

    def prepare(self, network: nn.Module) -> None:
        linears = linear_layers(network, self.layers)
        if not linears:
            raise ValueError(f"spectral_norm: no Linear layers selected by layers={self.layers!r}")
        if self.mode == "parametrize":
            for linear in linears:
                torch_spectral_norm(linear)
                if self.sigma_max != 1.0:
                    parametrize.register_parametrization(linear, "weight", _Scale(self.sigma_max))
        else:
            self.after_optimizer_step(network)

    @torch.no_grad()
    def after_optimizer_step(self, network: nn.Module) -> None:
        if self.mode != "project":
            return
        weights = [linear.weight for linear in linear_layers(network, self.layers)]
        if not weights:
            return
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
        self.exact_computations = getattr(self, "exact_computations", 0) + len(unsure)
