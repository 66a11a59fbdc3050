"""Muon-constrained weights (Newhouse et al. 2025, "Training Transformers with Enforced
Lipschitz Constants"; docs/methods.md#muon-and-weight-constraints).

Optimizer: ``torch.optim.Muon`` for the hidden matrices (every Linear weight of the backbone
except the classifier head), its learning rate scaled by sqrt(fan_out/fan_in)
(``adjust_lr_fn="spectral_unclamped"``) so that an update has RMS→RMS norm ≈ lr; AdamW (the
module's ``lr``, ``weight_decay``, ``betas``) for everything else.

After every step, on each hidden matrix, in RMS→RMS units with target σ_max:

* ``weight_decay``: W ← W − λη·W_old (decoupled, with the current Muon lr η; with Muon this
  alone bounds ‖W‖ ≤ 1/λ);
* then the ``constraint``: ``none`` (decay only), ``normalise`` (W / max(1, ‖W‖/σ_max)),
  ``hammer`` (σ₁ set to σ_max), ``hard_cap`` (U·min(Σ, σ_max)·Vᵀ, exact msign formula) or
  ``soft_cap`` (the α-polynomial, α coupled to the measured update: k = σ_max(1 − λη) + max_W
  ‖ΔW‖_RMS; keeps ‖W‖ ≤ σ_max when the update is small against σ_max).

``lipschitz_transformer=True`` also switches the architecture to the paper's, for which a finite
global bound exists: no LayerNorm (Identity), convex residuals x ← (1 − 1/(2N))x + (1/(2N))·f(x)
for N blocks, attention (1/3)·W_O·softmax(s·QKᵀ/d)·V, and GELU/1.1289. DropPath is bypassed.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..models import linear_layers, norm_sites, replace_activations, replace_attention_kernels, use_convex_residuals
from ..nn import constraints
from ..nn.lipschitz_blocks import LipschitzDotKernel, ScaledGELU
from ..nn.spectral import grouped_by_shape, rms_scale, spectral_norms
from ..optim_combined import CombinedOptimizer
from .base import Stabilizer, register_stabilizer

CONSTRAINTS = ("none", "normalise", "hammer", "hard_cap", "soft_cap")


def hidden_matrices(network: nn.Module) -> list[nn.Parameter]:
    """Weights of every Linear except the classifier head."""
    return [linear.weight for linear in linear_layers(network, "hidden")]


@register_stabilizer
class MuonConstrained(Stabilizer):
    """``--stabilizer muon``.

    Args:
        lr: Muon learning rate (RMS→RMS update size); AdamW keeps the module's ``lr``.
        momentum, nesterov, ns_steps: passed to torch.optim.Muon.
        weight_decay: λ of the decoupled decay on the hidden matrices.
        constraint: one of none, normalise, hammer, hard_cap, soft_cap.
        sigma_max: the target RMS→RMS norm.
        optimizer: ``muon`` or ``adamw`` (the constraints alone, e.g. hammer was made for Adam).
        lipschitz_transformer: switch the architecture to the paper's (see the module docstring).
        attention_scale: s in softmax(s·QKᵀ/d) of that architecture.
    """

    name = "muon"
    summary = ("torch.optim.Muon + AdamW, weight decay and a spectral constraint after each step; optional "
               "Lipschitz-transformer architecture")
    source = "Newhouse et al. 2025"
    prepare_order = 0

    def __init__(self, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.0, constraint: Literal["none", "normalise", "hammer", "hard_cap",
                                                                "soft_cap"] = "soft_cap",
                 sigma_max: float = 1.0, optimizer: Literal["muon", "adamw"] = "muon",
                 lipschitz_transformer: bool = False, attention_scale: float = 1.0) -> None:
        if constraint not in CONSTRAINTS:
            raise ValueError(f"muon: constraint must be one of {CONSTRAINTS}, got {constraint!r}")
        if optimizer not in ("muon", "adamw"):
            raise ValueError(f"muon: optimizer must be 'muon' or 'adamw', got {optimizer!r}")
        if sigma_max <= 0 or lr <= 0 or weight_decay < 0:
            raise ValueError(f"muon: need sigma_max > 0, lr > 0, weight_decay >= 0; got {sigma_max}, {lr}, "
                             f"{weight_decay}")
        self.lr, self.momentum, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.weight_decay, self.constraint, self.sigma_max = weight_decay, constraint, sigma_max
        self.optimizer = optimizer
        self.lipschitz_transformer, self.attention_scale = lipschitz_transformer, attention_scale
        self._matrices: list[nn.Parameter] = []
        self._before: list[torch.Tensor] = []
        self._muon: torch.optim.Optimizer | None = None
        self.last_alpha = 0.0

    def prepare(self, network: nn.Module) -> None:
        if self.lipschitz_transformer:
            self._lipschitz_architecture(network.backbone if hasattr(network, "backbone") else network)
        if not hidden_matrices(network):
            raise ValueError("muon: the network has no hidden Linear weights to constrain")
        if self.constraint != "none":
            self._matrices = hidden_matrices(network)
            self._project(update_norm=0.0, decay=0.0)

    def _lipschitz_architecture(self, backbone: nn.Module) -> None:
        for site in norm_sites(backbone):
            site.replace(nn.Identity())
        replace_attention_kernels(backbone, lambda attn: LipschitzDotKernel(
            attn.qkv.out_features // (3 * attn.num_heads), self.attention_scale))
        replace_activations(backbone, nn.GELU, ScaledGELU)
        use_convex_residuals(backbone)

    def lipschitz_bound(self, network: nn.Module) -> float | None:
        """Certified bound on [0, 1]ⁿ for the Lipschitz-transformer ViT (stability.lipschitz.certified);
        None for other architectures (LayerNorm and dot-product attention have no global bound)."""
        from ..lipschitz.certified import certified_bound

        return certified_bound(network)[0] if self.lipschitz_transformer else None

    def build_optimizer(self, network, default):
        """Muon (or AdamW) on the hidden matrices, the module's default optimizer on the rest."""
        self._matrices = hidden_matrices(network)
        ids = {id(p) for p in self._matrices}
        rest = default((n, p) for n, p in network.named_parameters() if id(p) not in ids)
        if self.optimizer == "muon":
            self._muon = torch.optim.Muon(self._matrices, lr=self.lr, weight_decay=0.0, momentum=self.momentum,
                                          nesterov=self.nesterov, ns_steps=self.ns_steps,
                                          adjust_lr_fn="spectral_unclamped")
        else:
            self._muon = torch.optim.AdamW(self._matrices, lr=self.lr, weight_decay=0.0)
        optimizer = CombinedOptimizer([self._muon, rest])
        optimizer.register_step_pre_hook(lambda *_: self._snapshot())
        return optimizer

    def _snapshot(self) -> None:
        self._before = [p.detach().clone() for p in self._matrices]

    @torch.no_grad()
    def after_optimizer_step(self, network: nn.Module) -> None:
        if not self._before:
            return
        eta = self._muon.param_groups[0]["lr"]
        differences = [p - b for p, b in zip(self._matrices, self._before)]
        scales = torch.tensor([rms_scale(d) for d in differences], dtype=torch.float64)
        update = float((spectral_norms(differences).cpu() * scales).max())
        if self.weight_decay:
            for p, before in zip(self._matrices, self._before):
                p.sub_(self.weight_decay * eta * before)
        self._project(update_norm=update, decay=self.weight_decay * eta)
        self._before = []

    @torch.no_grad()
    def _project(self, update_norm: float, decay: float) -> None:
        if self.constraint == "none":
            return
        if self.constraint == "soft_cap":
            k = self.sigma_max * (1 - decay) + update_norm
            self.last_alpha = constraints.soft_cap_alpha(k, self.sigma_max)
        if self.constraint == "soft_cap" and self.last_alpha == 0:
            return  # no weight can have left the cap in this step
        # The soft cap is matmuls only and float32 is accurate enough for it (tests hold ‖W‖ ≤ σ_max
        # to 1e-5); the SVD-based projections run in float64.
        dtype = torch.float32 if self.constraint in ("soft_cap", "normalise") else torch.float64
        for indices, stacked in grouped_by_shape([p.data for p in self._matrices]):  # batched per shape
            w = stacked.to(torch.promote_types(stacked.dtype, dtype))
            if self.constraint == "normalise":
                w = constraints.normalise(w, self.sigma_max)
            elif self.constraint == "hammer":
                w = constraints.hammer(w, self.sigma_max)
            elif self.constraint == "hard_cap":
                w = constraints.hard_cap(w, self.sigma_max)
            else:
                w = constraints.soft_cap(w, self.last_alpha)
            for i, projected in zip(indices, w.to(stacked.dtype)):
                self._matrices[i].copy_(projected)
