"""Muon with weight constraints (Newhouse et al. 2025, "Training Transformers with Enforced Lipschitz
Constants"; docs/methods.md#muon-and-weight-constraints), on any backbone.

Optimizer: ``torch.optim.Muon``'s update for the constrained matrices (:class:`~stability.optim_muon.ShapeBatchedMuon`:
the same update, the matrices of one shape orthogonalised in one batch), its learning rate scaled by
sqrt(fan_out/fan_in) (:func:`muon_shape_factor`) so that an update has RMS→RMS norm ≈ lr,
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

``method: iterative`` (the default) computes every constraint with matmuls only, in float32, batched by
shape, without reading anything back to the host: the hard cap by the msign formula with a
Newton–Schulz msign (its input scaled by k under Muon, so the values at the cap need no growth
steps), ``normalise``, ``hammer`` and ``spectral_wd`` from the top singular triplet of a persistent
block power iteration with Rayleigh–Ritz (:class:`~stability.nn.spectral.SubspaceIteration`,
``power_iterations`` steps per training step, its vectors kept as buffers of each Linear), the soft cap as
a polynomial. ``method: exact`` uses an SVD per matrix in float64 (slow; for comparison). Either way the
certified bounds use norms measured from the weights, never the assumed σ_max. The soft cap's
measured update norm (AdamW, or ``update_norm: measured``) needs an eigensolver: one host sync per step.

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
from ..nn.precision import accumulation_dtype, float32_math, tf32_matmuls
from ..nn.spectral import RECOMPILE_LIMIT, SubspaceIteration, TopSingular, grouped_by_shape, rms_scale, spectral_norms
from ..optim import LR_SHAPE_FACTOR, nominal_lr
from ..optim_combined import CombinedOptimizer
from ..optim_muon import ShapeBatchedMuon, multiply_in_place
from .base import Stabilizer, register_stabilizer

NS_COEFFICIENTS = constraints.JORDAN_QUINTIC  # torch.optim.Muon's defaults (Keller Jordan's quintic)
CONSTRAINTS = ("none", "normalise", "hammer", "spectral_wd", "hard_cap", "soft_cap")
CAP_PRODUCTS = ("float32", "tf32x3")
LAYERS = ("hidden", "all")
METHODS = ("iterative", "exact")
POWER_CONSTRAINTS = ("normalise", "hammer", "spectral_wd")  # those that need the top singular triplet


class IncompatibleCheckpoint(ValueError):
    """An optimizer state that does not fit the network it is loaded into."""


def _upgraded_muon_state(saved: dict, grouping: list[tuple[float, float, list[tuple[str, nn.Parameter]]]],
                         module_order: list[str]) -> tuple[dict, list[tuple[int, float]]]:
    """The Muon state of the old layout (one group per role scale in first-seen order, each holding its matrices in
    module order) in the current one (one group per role scale and shape factor), and for each new group (the old
    group it came from, its shape factor): the scheduler's per-group rates follow the same map."""
    old_groups = saved["param_groups"]
    scale_of = {name: scale for scale, _, members in grouping for name, _ in members}
    scales = list(dict.fromkeys(scale_of[name] for name in module_order))
    old_names = [name for scale in scales for name in module_order if scale_of[name] == scale]  # the old flat order
    count = sum(len(group["params"]) for group in old_groups)
    if count != len(old_names) or len(old_groups) != len(scales):
        raise IncompatibleCheckpoint(
            f"the checkpoint's Muon state holds {count} matrices in {len(old_groups)} groups where this network's Muon "
            f"has {len(old_names)} in {len(scales)}: it was saved from another architecture or muon.layers and cannot "
            f"resume here (stability test and validate read only its weights)")
    old_index = {name: i for i, name in enumerate(old_names)}
    group_of = {i: g for g, group in enumerate(old_groups) for i in group["params"]}
    state, groups, bases, position = {}, [], [], 0
    for _, factor, members in grouping:
        source = group_of[old_index[members[0][0]]]
        indices = []
        for name, _ in members:
            if old_index[name] in saved["state"]:
                state[position] = saved["state"][old_index[name]]
            indices.append(position)
            position += 1
        group = {**{k: v for k, v in old_groups[source].items() if k != "params"}, "params": indices,
                 LR_SHAPE_FACTOR: factor, "lr": old_groups[source]["lr"] * factor, "adjust_lr_fn": "original"}
        if "initial_lr" in group:
            group["initial_lr"] *= factor
        groups.append(group)
        bases.append((source, factor))
    return {"state": state, "param_groups": groups}, bases


def muon_shape_factor(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor of a matrix's group lr that makes torch.optim.Muon step by lr·√(fan_out/fan_in).

    The paper's update is −η·√(d_out/d_in)·msign(M): RMS→RMS norm η for every shape. torch.optim.Muon
    multiplies the group lr by √max(1, A/B) (``adjust_lr_fn="original"``, A × B = d_out × d_in), on every
    torch since 2.9; ``"spectral_unclamped"`` (√(A/B)) exists only in releases after 2.12. So the group lr
    carries min(1, √(A/B)): √max(1, A/B)·min(1, √(A/B)) = √(A/B) on every torch the suite supports."""
    fan_out, fan_in = shape[:2]
    return min(1.0, (fan_out / fan_in) ** 0.5)


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


def max_rms_norm(matrices: list[torch.Tensor], dtype: torch.dtype = torch.float64) -> float:
    """max ‖W‖_RMS→RMS over the matrices (exact; a host sync). ``float32`` adds a relative margin of 1e-4
    for its rounding, so that the value stays an upper bound."""
    scales = torch.tensor([rms_scale(w) for w in matrices], dtype=torch.float64)
    norms = spectral_norms([w.detach() for w in matrices], dtype=dtype).double().cpu()
    margin = 1.0 if dtype == torch.float64 else 1.0 + 1e-4
    return float((norms * scales).max()) * margin


def constrained_linears(network: nn.Module, layers: str = "hidden") -> list[tuple[str, nn.Linear]]:
    """(name, module) of the Linear layers ``layers`` selects, in module order."""
    chosen = {id(m) for m in linear_layers(network, layers)}
    return [(name, m) for name, m in network.named_modules() if id(m) in chosen]


def constrained_matrices(network: nn.Module, layers: str = "hidden") -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the Linear layers ``layers`` selects, in module order."""
    return [(f"{name}.weight", m.weight) for name, m in constrained_linears(network, layers)]


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
        method: ``iterative`` (matmuls only: Newton–Schulz, persistent power iteration) or ``exact`` (SVD).
        power_iterations: power-iteration steps per training step (normalise, hammer, spectral_wd).
        cap_products: how the hard cap's float32 products run: ``float32`` (IEEE, TF32 off) or ``tf32x3`` (on a GPU
            with TF32 units, each as three TF32 products of its operands' high and low parts: the same cap to float32
            rounding, faster where IEEE float32 products are slow; elsewhere the same as ``float32``).
    """

    name = "muon"
    summary = ("torch.optim.Muon (Q, K, V apart) + AdamW, weight decay and a spectral constraint (normalise, "
               "hammer, spectral weight decay, hard / soft cap) after every step")
    source = "Newhouse et al. 2025"
    prepare_order = 2  # after the stabilizers that change the architecture: constrain the final matrices
    backbones = ("vit", "swin", "cswin", "hybrid")  # the hybrid: its blocks (the AOL stem is 1-Lipschitz already)

    def __init__(self, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.0,
                 constraint: Literal["none", "normalise", "hammer", "spectral_wd", "hard_cap", "soft_cap"] = "soft_cap",
                 sigma_max: float = 1.0, spectral_wd: float = 0.1, optimizer: Literal["muon", "adamw"] = "muon",
                 layers: Literal["hidden", "all"] = "hidden", split_qkv: bool = True,
                 update_scales: dict[str, float] | None = None,
                 update_norm: Literal["bound", "measured"] = "bound",
                 method: Literal["iterative", "exact"] = "iterative", power_iterations: int = 2,
                 cap_products: Literal["float32", "tf32x3"] = "float32") -> None:
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
        if method not in METHODS:
            raise ValueError(f"muon: method must be one of {METHODS}, got {method!r}")
        if power_iterations < 1:
            raise ValueError(f"muon: power_iterations must be >= 1, got {power_iterations}")
        if cap_products not in CAP_PRODUCTS:
            raise ValueError(f"muon: cap_products must be one of {CAP_PRODUCTS}, got {cap_products!r}")
        unknown = sorted(set(update_scales or {}) - set(ROLES))
        if unknown:
            raise ValueError(f"muon: update_scales has unknown roles {unknown}; valid: {list(ROLES)}")
        self.lr, self.momentum, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.weight_decay, self.constraint, self.sigma_max = weight_decay, constraint, sigma_max
        self.spectral_wd, self.optimizer, self.layers, self.split_qkv = spectral_wd, optimizer, layers, split_qkv
        self.update_scales, self.update_norm = dict(update_scales or {}), update_norm
        self.method, self.power_iterations, self.cap_products = method, power_iterations, cap_products
        self._linears: list[nn.Linear] = []
        self._matrices: list[nn.Parameter] = []
        self._power: SubspaceIteration | None = None
        self._before: list[torch.Tensor] = []
        self._stepped = False
        self._muon: torch.optim.Optimizer | None = None
        self._compiled_constraint = None
        self._compile_constraint = False  # set by compile_terms; the compiled function is made on first use
        self.last_alpha = 0.0

    def compile_terms(self) -> None:
        """Trained compiled: the per-step power iteration of the projection (a block power iteration with
        Rayleigh–Ritz over every weight) as one compiled graph, and each shape group's constraint (the caps' matrix
        polynomials and sign iterations; the hard cap's of every shape at once) as one of its own, called inside the
        float32 context (no gradient: the whole call runs at that precision), made on first use (again after a copy).
        Two entries a graph (the first takes α and the step bound as constants, the second, once they change, as
        inputs), and one more each time the hard cap's first sign changes its iteration count (which follows the step
        bound, so the learning rate's schedule: a few in a run)."""
        if self._power is not None:
            self._power.compile()
        if self.constraint != "none" and self.method != "exact":
            self._compile_constraint = True
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled_constraint": None}  # a compiled function does not pickle

    def prepare(self, network: nn.Module) -> None:
        """Split fused qkv projections, constrain the matrices from the start (exactly: this runs once)."""
        if self.split_qkv:
            split_qkv(network)
        self._linears = [m for _, m in constrained_linears(network, self.layers)]
        self._matrices = [m.weight for m in self._linears]
        if not self._matrices:
            raise ValueError(f"muon: the network has no Linear weights in layers={self.layers!r} to constrain")
        if self.method == "iterative" and self.constraint in POWER_CONSTRAINTS:
            self._power = SubspaceIteration.of_weights(self._linears, "muon")
        largest = max_rms_norm(self._matrices)  # the soft cap maps the largest norm there is
        self._project(largest, exact=True)
        if self._power is not None:
            self._power.step(self._matrices, iterations=30)  # warm start: the vectors of the projected weights

    def constrained_parameters(self, network: nn.Module) -> list[nn.Parameter]:
        return [p for _, p in constrained_matrices(network, self.layers)] if self.constraint != "none" else []

    def signals(self) -> dict[str, float]:
        return {"soft_cap_alpha": self.last_alpha} if self.constraint == "soft_cap" else {}

    def build_optimizer(self, network, default):
        """Muon (or AdamW) on the matrices, one group per role and (Muon) shape factor, the module's default
        optimizer on the rest. Each group's lr is ``lr`` × the role's ``update_scales`` × (Muon)
        :func:`muon_shape_factor`; the factor is kept in the group, so the decay and the soft cap use the
        nominal rate."""
        ids = {id(p) for _, p in constrained_matrices(network, self.layers)}
        rest = default((n, p) for n, p in network.named_parameters() if id(p) not in ids)
        param_groups = [{"params": [p for _, p in members], "lr": self.lr * scale * factor, LR_SHAPE_FACTOR: factor}
                        for scale, factor, members in self._grouping(network)]
        if self.optimizer == "muon":
            self._muon = ShapeBatchedMuon(param_groups, lr=self.lr, weight_decay=0.0, momentum=self.momentum,
                                          nesterov=self.nesterov, ns_steps=self.ns_steps, adjust_lr_fn="original")
        else:
            self._muon = torch.optim.AdamW(param_groups, lr=self.lr, weight_decay=0.0)
        self._matrices = [p for group in self._muon.param_groups for p in group["params"]]
        return CombinedOptimizer([self._muon, rest], before_update=self._before_update)

    def _grouping(self, network: nn.Module) -> list[tuple[float, float, list[tuple[str, nn.Parameter]]]]:
        """[(role scale, shape factor, [(name, matrix)])]: the Muon groups, in first-seen order."""
        groups: dict[tuple[float, float], list[tuple[str, nn.Parameter]]] = {}
        for name, p in constrained_matrices(network, self.layers):
            scale = self.update_scales.get(linear_role(name.removesuffix(".weight")), 1.0)
            factor = muon_shape_factor(p.shape) if self.optimizer == "muon" else 1.0
            groups.setdefault((scale, factor), []).append((name, p))
        return [(scale, factor, members) for (scale, factor), members in groups.items()]

    def on_load_checkpoint(self, checkpoint: dict, network: nn.Module) -> None:
        """A Muon checkpoint saved before the groups were split by shape factor (torch's ``adjust_lr_fn`` was
        ``spectral_unclamped``, which torch 2.9–2.12 do not have; the groups were one per role) is brought to the
        current layout in place, so that it resumes: each matrix keeps its momentum, each group's learning rate (and
        the scheduler's base rate) takes its shape factor. A state that does not fit the network stops the run with
        one line saying why."""
        if self.optimizer != "muon" or not checkpoint.get("optimizer_states"):
            return
        combined = checkpoint["optimizer_states"][0]
        saved = combined.get("optimizers", [None])[0] if isinstance(combined, dict) else None
        if not saved or all(LR_SHAPE_FACTOR in group for group in saved["param_groups"]):
            return
        module_order = [name for name, _ in constrained_matrices(network, self.layers)]
        upgraded, bases = _upgraded_muon_state(saved, self._grouping(network), module_order)
        combined["optimizers"][0] = upgraded
        for scheduler in checkpoint.get("lr_schedulers", []):
            for key in ("base_lrs", "_last_lr"):
                if key in scheduler:
                    old = scheduler[key]
                    scheduler[key] = [old[i] * factor for i, factor in bases] + old[len(saved["param_groups"]):]

    def step_bounds(self) -> dict[int, float]:
        """id(matrix) → an a-priori bound on the Frobenius norm of its change in one Muon step, decay aside:
        ‖ΔW‖_F ≤ √rank·‖ΔW‖₂ ≤ √min(A, B)·η·√(A/B)·B (B: :func:`newton_schulz_bound`). Each side of a cross-device
        comparison is held to it (stability/testing/parity.py)."""
        if self.optimizer != "muon" or self._muon is None:
            return {}
        bound = newton_schulz_bound(self.ns_steps)
        return {id(p): min(p.shape) ** 0.5 * nominal_lr(group) * (p.shape[0] / p.shape[1]) ** 0.5 * bound
                for group in self._muon.param_groups for p in group["params"]}

    def _etas(self) -> list[float]:
        """The current nominal learning rate η of each matrix (the schedule sets it on every group): the size of
        its Muon update in RMS→RMS norm, and the rate of its decay."""
        return [nominal_lr(group) for group in self._muon.param_groups for _ in group["params"]]

    @property
    def measures_update(self) -> bool:
        """The soft cap needs the update's norm measured where no a-priori bound holds (AdamW)."""
        return self.constraint == "soft_cap" and (self.optimizer != "muon" or self.update_norm == "measured")

    @torch.no_grad()
    def _before_update(self) -> None:
        """After the gradients, before the update: the decoupled decay W ← (1 − λη)W (the update does not
        depend on W, so this equals W ← W + ΔW − λη·W_old) and, where needed, a copy to measure ΔW."""
        if self.weight_decay:
            multiply_in_place(self._matrices, [1 - self.weight_decay * eta for eta in self._etas()])
        # a copy of every matrix in one multi-tensor launch (×1 is exact, signed zeros too)
        self._before = list(torch._foreach_mul([p.detach() for p in self._matrices], 1.0)) if self.measures_update \
            else []
        self._stepped = True

    @torch.no_grad()
    def after_optimizer_step(self, network: nn.Module, global_step: int = 0) -> None:
        if not getattr(self, "_stepped", False):
            return
        self._stepped = False
        etas = self._etas()
        largest = self.sigma_max * (1 - self.weight_decay * min(etas))  # the least decay: the largest norm
        if self.measures_update:
            largest += max_rms_norm(list(torch._foreach_sub(self._matrices, self._before)),
                                    dtype=accumulation_dtype(self._matrices[0].dtype))
        elif self.optimizer == "muon":
            largest += max(etas) * newton_schulz_bound(self.ns_steps)
        else:
            largest = None  # AdamW without a measured update: no a-priori bound on the step
        self._before = []
        self._project(largest)

    @torch.no_grad()
    def _project(self, largest: float | None, exact: bool = False) -> None:
        """Apply the constraint to every matrix, batched by shape. ``largest`` (k) bounds every ‖W‖ after
        the step where known: the soft cap's α maps it to σ_max, the hard cap scales by it."""
        if self.constraint == "none":
            return
        if self.constraint == "soft_cap":
            self.last_alpha = constraints.soft_cap_alpha(largest, self.sigma_max)
            if self.last_alpha == 0:
                return  # no weight can have left the cap in this step
        exact = exact or self.method == "exact"
        weights = [m.weight for m in self._linears]
        device = weights[0].device
        groups = self._power.step(weights, self.power_iterations) if (self._power is not None and not exact) \
            else None
        compiled = getattr(self, "_compile_constraint", False) and not exact
        together = self.constraint == "hard_cap" and not exact  # every shape's sign iterations in one batch
        # float32 products as three TF32 products each where asked for and a GPU has TF32 units (the same cap)
        split = (together and getattr(self, "cap_products", "float32") == "tf32x3"
                 and weights[0].dtype == torch.float32 and constraints.split_products_on(device))
        if compiled and self._compiled_constraint is None:
            self._compiled_constraint = torch.compile(self._cap_all if together else self._constrain, fullgraph=True)
        constrain = self._compiled_constraint if compiled else self._cap_all if together else self._constrain
        with float32_math(device.type), tf32_matmuls(split):
            groups = list(groups or self._groups_by_shape(weights, exact))
            if compiled:  # a graph for each shape (the hard cap: one for all); α and the bound its inputs
                for group in groups:
                    torch._dynamo.mark_static(group.weight)
            projected = constrain([group.weight for group in groups], largest, split) if together else \
                [constrain(group, largest, exact, self.last_alpha) for group in groups]
            for group, stack in zip(groups, projected):
                torch._foreach_copy_([weights[i] for i in group.indices], list(stack.unbind(0)))

    @staticmethod
    def _groups_by_shape(weights: list[torch.Tensor], exact: bool) -> list[TopSingular]:
        return [TopSingular(indices, stacked.to(torch.float64 if exact else accumulation_dtype(stacked.dtype)), None,
                            None, None)
                for indices, stacked in grouped_by_shape([w.detach() for w in weights])]

    def _cap_all(self, stacks: list[torch.Tensor], largest: float | None, split: bool = False) -> list[torch.Tensor]:
        """The hard cap of every shape group's stack (G, m, n), their sign iterations batched together; ``split``:
        each product as three TF32 products (:func:`constraints.tf32_parts`), TF32 on around the call."""
        return constraints.hard_caps(stacks, self.sigma_max, bound=largest, split=split)

    def _constrain(self, group: TopSingular, largest: float | None, exact: bool, alpha: float) -> torch.Tensor:
        """The constrained matrices of one shape group (G, m, n); ``alpha``: the soft cap's α this step."""
        w = group.weight
        top = None if exact or group.sigma is None else (group.sigma, group.u, group.v)
        if self.constraint == "normalise":
            return constraints.normalise(w, self.sigma_max, None if top is None else top[0])
        if self.constraint == "hammer":
            return constraints.hammer(w, self.sigma_max, top)
        if self.constraint == "spectral_wd":
            return constraints.spectral_weight_decay(w, self.spectral_wd, top)
        if self.constraint == "hard_cap":
            if exact:
                return constraints.hard_cap_svd(w, self.sigma_max)
            return constraints.hard_cap(w, self.sigma_max, bound=largest)
        return constraints.soft_cap(w, alpha)
