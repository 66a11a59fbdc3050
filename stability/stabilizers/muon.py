"""Muon with weight constraints (Newhouse et al. 2025, "Training Transformers with Enforced Lipschitz
Constants"; docs/methods.md#muon-and-weight-constraints), on any backbone.

Optimizer: ``torch.optim.Muon`` for the constrained matrices, its learning rate scaled by
sqrt(fan_out/fan_in) (``adjust_lr_fn="spectral_unclamped"``) so that an update has RMS→RMS norm ≈ lr,
times a per-role factor ``update_scales`` (the reference's mass allocation, e.g. Q/K/V 0.889, W_O
and MLP 0.296, embedding and head 0.056 at blocks mass 16); AdamW (the module's ``lr``,
``weight_decay``, ``betas``) for every other parameter. ``optimizer: adamw`` trains the matrices
with AdamW instead (the paper's AdamW baselines). Q, K and V are separate matrices: a fused qkv
projection is split into three (``split_qkv``), so each is orthogonalised and constrained on its own.

After every step, on each matrix, in RMS→RMS units ‖W‖ = sqrt(d_in/d_out)·σ₁(W), target σ_max:

* ``weight_decay``: W ← W − λη·W_old (decoupled, with the current Muon lr η; with Muon this alone
  bounds ‖W‖ ≤ 1/λ);
* then the ``constraint``: ``none`` (decay only), ``normalise`` (W / max(1, ‖W‖/σ_max)), ``hammer``
  (σ₁ set to σ_max), ``spectral_wd`` (top singular value × (1 − ``spectral_wd``)), ``hard_cap``
  (U·min(Σ, σ_max)·Vᵀ) or ``soft_cap`` (the α-polynomial with α mapping k to σ_max, where
  k = σ_max(1 − λη) + u bounds every weight's norm after the step: u is Muon's a-priori update bound
  η·B (:func:`newton_schulz_bound`), or the measured max_W ‖ΔW‖_RMS for AdamW).

``layers`` picks the matrices: ``hidden`` (every Linear but the head) or ``all`` (the head too, and
the patch embedding where it is a Linear, as in ``lipschitz_transformer``).
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from ..models import ROLES, linear_layers, linear_role, split_qkv
from ..nn import constraints
from ..nn.spectral import grouped_by_shape, rms_scale, spectral_norms
from ..optim_combined import CombinedOptimizer
from .base import Stabilizer, register_stabilizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)
CONSTRAINTS = ("none", "normalise", "hammer", "spectral_wd", "hard_cap", "soft_cap")
LAYERS = ("hidden", "all")


@functools.cache
def newton_schulz_bound(steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                        margin: float = 1.04) -> float:
    """B: an a-priori bound on the RMS→RMS norm of a Muon update over its learning rate.

    torch.optim.Muon divides the momentum X by its Frobenius norm (so every singular value is in
    [0, 1], as σ₁ ≤ ‖X‖_F), applies ``steps`` Newton–Schulz iterations X ← aX + b(XXᵀ)X + c(XXᵀ)²X —
    which act on each singular value alone, s ↦ p(s) = as + bs³ + cs⁵, keeping the singular vectors —
    and steps by −η·√(d_out/d_in)·X. So the update's singular values are η·√(d_out/d_in)·p^{∘steps}(s)
    and its RMS→RMS norm is η·max_s p^{∘steps}(s) ≤ η·max_{x∈[0,1]} p^{∘steps}(x). With the default
    coefficients that maximum is 1.2024 (the iteration overshoots 1 near x ≈ 0.004). The iterations
    run in bfloat16, which moves the result by rounding: ``margin`` (4%) covers that — the largest σ₁
    seen over random and ill-conditioned matrices of every shape used here was 1.2034
    (tests/test_muon.py checks it, and that ‖W‖ ≤ σ_max holds over many steps). With k = σ_max(1 − λη)
    + η·B ≥ every ‖W‖ after a step (triangle inequality, from ‖W‖ ≤ σ_max before it), the soft cap
    maps them all to at most σ_max."""
    x = torch.linspace(0, 1, 1_000_001, dtype=torch.float64)
    a, b, c = coefficients
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return float(x.abs().max()) * margin


def max_rms_norm(matrices: list[torch.Tensor]) -> float:
    """max ‖W‖_RMS→RMS over the matrices."""
    scales = torch.tensor([rms_scale(w) for w in matrices], dtype=torch.float64)
    return float((spectral_norms([w.detach() for w in matrices]).cpu() * scales).max())


def constrained_matrices(network: nn.Module, layers: str = "hidden") -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the Linear layers ``layers`` selects, in module order."""
    chosen = {id(m) for m in linear_layers(network, layers)}
    return [(f"{name}.weight", m.weight) for name, m in network.named_modules() if id(m) in chosen]


@register_stabilizer
class MuonConstrained(Stabilizer):
    """``--stabilizer muon``.

    Args:
        lr: Muon learning rate (RMS→RMS update size); AdamW keeps the module's ``lr``.
        momentum, nesterov, ns_steps: passed to torch.optim.Muon.
        weight_decay: λ of the decoupled decay on the matrices.
        constraint: one of none, normalise, hammer, spectral_wd, hard_cap, soft_cap.
        sigma_max: the target RMS→RMS norm.
        spectral_wd: strength of the ``spectral_wd`` constraint (per step).
        optimizer: ``muon`` or ``adamw`` (the constraints alone, e.g. hammer was made for Adam).
        layers: ``hidden`` (every Linear but the head) or ``all``.
        split_qkv: hold fused qkv projections as separate Q, K, V matrices.
        update_scales: factor of the learning rate per role (embed, qkv, proj, mlp, head, other);
            missing roles keep 1.
        update_norm: how the soft cap knows the size of Muon's update: ``bound`` (a priori, see
            :func:`newton_schulz_bound`) or ``measured`` (the exact norm of every update; AdamW always).
    """

    name = "muon"
    summary = ("torch.optim.Muon (Q, K, V apart) + AdamW, weight decay and a spectral constraint (normalise, "
               "hammer, spectral weight decay, hard / soft cap) after every step")
    source = "Newhouse et al. 2025"
    prepare_order = 2  # after the stabilizers that change the architecture: constrain the final matrices

    def __init__(self, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.0,
                 constraint: Literal["none", "normalise", "hammer", "spectral_wd", "hard_cap", "soft_cap"] = "soft_cap",
                 sigma_max: float = 1.0, spectral_wd: float = 0.1, optimizer: Literal["muon", "adamw"] = "muon",
                 layers: Literal["hidden", "all"] = "hidden", split_qkv: bool = True,
                 update_scales: dict[str, float] | None = None,
                 update_norm: Literal["bound", "measured"] = "bound") -> None:
        if constraint not in CONSTRAINTS:
            raise ValueError(f"muon: constraint must be one of {CONSTRAINTS}, got {constraint!r}")
        if optimizer not in ("muon", "adamw"):
            raise ValueError(f"muon: optimizer must be 'muon' or 'adamw', got {optimizer!r}")
        if layers not in LAYERS:
            raise ValueError(f"muon: layers must be one of {LAYERS}, got {layers!r}")
        if sigma_max <= 0 or lr <= 0 or weight_decay < 0 or not 0 <= spectral_wd < 1:
            raise ValueError(f"muon: need sigma_max > 0, lr > 0, weight_decay >= 0, 0 <= spectral_wd < 1; got "
                             f"{sigma_max}, {lr}, {weight_decay}, {spectral_wd}")
        if update_norm not in ("bound", "measured"):
            raise ValueError(f"muon: update_norm must be 'bound' or 'measured', got {update_norm!r}")
        unknown = sorted(set(update_scales or {}) - set(ROLES))
        if unknown:
            raise ValueError(f"muon: update_scales has unknown roles {unknown}; valid: {list(ROLES)}")
        self.lr, self.momentum, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.weight_decay, self.constraint, self.sigma_max = weight_decay, constraint, sigma_max
        self.spectral_wd, self.optimizer, self.layers, self.split_qkv = spectral_wd, optimizer, layers, split_qkv
        self.update_scales, self.update_norm = dict(update_scales or {}), update_norm
        self._matrices: list[nn.Parameter] = []
        self._before: list[torch.Tensor] = []
        self._stepped = False
        self._muon: torch.optim.Optimizer | None = None
        self.last_alpha = 0.0

    def prepare(self, network: nn.Module) -> None:
        """Split fused qkv projections and constrain the matrices from the start."""
        if self.split_qkv:
            split_qkv(network)
        self._matrices = [p for _, p in constrained_matrices(network, self.layers)]
        if not self._matrices:
            raise ValueError(f"muon: the network has no Linear weights in layers={self.layers!r} to constrain")
        self._project(largest=max_rms_norm(self._matrices))  # the soft cap maps the largest norm there is

    def constrained_parameters(self, network: nn.Module) -> list[nn.Parameter]:
        return [p for _, p in constrained_matrices(network, self.layers)] if self.constraint != "none" else []

    def build_optimizer(self, network, default):
        """Muon (or AdamW) on the matrices, one group per role, the module's default optimizer on the rest."""
        named = constrained_matrices(network, self.layers)
        ids = {id(p) for _, p in named}
        rest = default((n, p) for n, p in network.named_parameters() if id(p) not in ids)
        groups: dict[float, list[nn.Parameter]] = {}
        for name, p in named:
            groups.setdefault(self.update_scales.get(linear_role(name.removesuffix(".weight")), 1.0), []).append(p)
        param_groups = [{"params": params, "lr": self.lr * scale} for scale, params in groups.items()]
        if self.optimizer == "muon":
            self._muon = torch.optim.Muon(param_groups, lr=self.lr, weight_decay=0.0, momentum=self.momentum,
                                          nesterov=self.nesterov, ns_steps=self.ns_steps,
                                          adjust_lr_fn="spectral_unclamped")
        else:
            self._muon = torch.optim.AdamW(param_groups, lr=self.lr, weight_decay=0.0)
        self._matrices = [p for group in self._muon.param_groups for p in group["params"]]
        return CombinedOptimizer([self._muon, rest], before_update=self._before_update)

    def _etas(self) -> list[float]:
        """The current learning rate of each matrix (the schedule sets it on every group)."""
        return [group["lr"] for group in self._muon.param_groups for _ in group["params"]]

    @property
    def measures_update(self) -> bool:
        """The soft cap needs the update's norm measured where no a-priori bound holds (AdamW)."""
        return self.constraint == "soft_cap" and (self.optimizer != "muon" or self.update_norm == "measured")

    @torch.no_grad()
    def _before_update(self) -> None:
        """After the gradients, before the update: the decoupled decay W ← (1 − λη)W (the update does not
        depend on W, so this equals W ← W + ΔW − λη·W_old) and, where needed, a copy to measure ΔW."""
        if self.weight_decay:
            for p, eta in zip(self._matrices, self._etas()):
                p.mul_(1 - self.weight_decay * eta)
        self._before = [p.detach().clone() for p in self._matrices] if self.measures_update else []
        self._stepped = True

    @torch.no_grad()
    def after_optimizer_step(self, network: nn.Module) -> None:
        if not getattr(self, "_stepped", False):
            return
        self._stepped = False
        etas = self._etas()
        largest = self.sigma_max * (1 - self.weight_decay * min(etas))  # the least decay: the largest norm
        if self.constraint == "soft_cap":
            if self.measures_update:
                largest += max_rms_norm([p - b for p, b in zip(self._matrices, self._before)])
            else:
                largest += max(etas) * newton_schulz_bound(self.ns_steps)
        self._before = []
        self._project(largest)

    @torch.no_grad()
    def _project(self, largest: float) -> None:
        """Apply the constraint; the soft cap's α maps ``largest`` (k) to σ_max."""
        if self.constraint == "none":
            return
        if self.constraint == "soft_cap":
            self.last_alpha = constraints.soft_cap_alpha(largest, self.sigma_max)
            if self.last_alpha == 0:
                return  # no weight can have left the cap in this step
        # The soft cap and normalise are matmuls and one norm, accurate enough in float32 (tests hold
        # ‖W‖ ≤ σ_max to 1e-5); the SVD-based projections run in float64.
        dtype = torch.float32 if self.constraint in ("soft_cap", "normalise") else torch.float64
        for indices, stacked in grouped_by_shape([p.data for p in self._matrices]):  # batched per shape
            w = stacked.to(torch.promote_types(stacked.dtype, dtype))
            if self.constraint == "normalise":
                w = constraints.normalise(w, self.sigma_max)
            elif self.constraint == "hammer":
                w = constraints.hammer(w, self.sigma_max)
            elif self.constraint == "spectral_wd":
                w = constraints.spectral_weight_decay(w, self.spectral_wd)
            elif self.constraint == "hard_cap":
                w = constraints.hard_cap(w, self.sigma_max)
            else:
                w = constraints.soft_cap(w, self.last_alpha)
            for i, projected in zip(indices, w.to(stacked.dtype)):
                self._matrices[i].copy_(projected)
