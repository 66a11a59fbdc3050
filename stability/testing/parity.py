"""Parity: one training step and the measurements of a module on two sides (devices, or dtypes), compared key by
key with tolerances that hold on any device — and that a planted error fails (tests/test_parity.py: a skipped Muon
step, a wrong orthogonalisation, a PGD step with the wrong sign, a dropped attention term each fail the comparison).

Two devices (or float32 against float64) compute the same function with different rounding. A comparison is right
by construction only where the quantity it compares is defined up to that rounding:

* **loss terms**: relative to the term;
* **gradients**: relative to the largest gradient entry of the whole network, not to the parameter's own. A parameter
  whose exact gradient is zero (a key bias under softmax's shift invariance, LayerNorm's bias on the keys) receives
  rounding noise whose sign differs between the sides; only its size, ≪ the network's gradient, is defined;
* **the step**: both sides take their optimizer's step and projection from the *same* gradients (the reference's,
  copied), so that the update is compared, not AdamW's ≈ ±lr reading of the noise above. Weights then agree relative
  to the tensor's size plus 1e-4 of the update's — Muon's matrices too: torch.optim.Muon runs Newton–Schulz in
  bfloat16, which multiplies rounding in the small singular directions of the momentum (slope 3.4 at 0, five times;
  its result is O(1) away from the exact iteration's, and two devices' bf16 results as far from each other, in
  Frobenius norm too), so for the comparison both sides run it in float32 (:func:`float32_newton_schulz`), where it
  agrees with float64 to 1e-4 — and each side's Muon update stays within its a-priori size
  (:meth:`~stability.stabilizers.base.Stabilizer.step_bounds`);
* **measurements** (local Jacobian norms, empirical lower bounds, certified bound and radii): relative to the
  measurement's own scale (the largest value of the vector), since a radius near 0 has no relative precision;
  1e-3, and 1e-2 for the empirical lower bound, the best point of a gradient ascent whose path rounding moves;
* **attacks**: PGD ℓ2's perturbation δ (a continuous function of the gradients, from the same seeded start) within
  1e-3·ε; FGSM's ℓ∞ perturbation ε·sign(∇) in the share of pixels whose sign differs (a gradient component ≈ 0 may
  round either way), at most 1%; and each attack's outcome per point, at most one point in the batch differing
  (a point on the decision boundary).

Every mismatch is a :class:`Difference` that prints the key, both values and the tolerance: a GPU run is rare and
short, and its log must say what differed and by how much.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..nn.precision import ieee_float32

LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
GRADIENT_RTOL = 1e-4  # of the largest gradient entry of the network
WEIGHT_RTOL, UPDATE_RTOL = 1e-4, 1e-4  # of the tensor's largest entry, and of its largest change in the step
MEASUREMENT_RTOL = 1e-3  # of the measurement's largest value
ASCENT_RTOL = 1e-2  # the empirical lower bound: the best point of a gradient ascent, whose path rounding moves
PGD_RTOL = 1e-3  # of ε: PGD ℓ2's perturbation
FGSM_SIGN_SHARE = 0.01  # the share of pixels whose FGSM sign may differ
OUTCOME_POINTS = 1  # points whose attack outcome may differ (on the decision boundary)
FGSM_EPS, PGD_EPS = 8 / 255, 0.5  # the budgets the measurements attack at


@dataclass(frozen=True)
class Difference:
    """One compared key: the largest entrywise difference and what it was allowed to be."""

    key: str
    reference: float  # the reference's value where the difference is largest
    other: float
    difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "OVER"
        return (f"{self.key}: {self.reference:.7g} vs {self.other:.7g}, |Δ| {self.difference:.2e} "
                f"(tolerance {self.tolerance:.2e}) {verdict}")


def difference(key: str, reference: torch.Tensor | float, other: torch.Tensor | float,
               tolerance: float) -> Difference:
    """The largest |other − reference| over the entries, with the values where it occurs."""
    a = torch.as_tensor(reference).detach().double().cpu().flatten()
    b = torch.as_tensor(other).detach().double().cpu().flatten()
    if a.shape != b.shape:
        return Difference(f"{key} (shape {tuple(a.shape)} vs {tuple(b.shape)})", float("nan"), float("nan"),
                          float("inf"), tolerance)
    if a.numel() == 0:
        return Difference(key, 0.0, 0.0, 0.0, tolerance)
    gaps = (b - a).abs().nan_to_num(nan=float("inf"))
    i = int(gaps.argmax())
    return Difference(key, float(a[i]), float(b[i]), float(gaps[i]), tolerance)


def scale(values: torch.Tensor | float) -> float:
    """The largest |entry| (0 for an empty tensor)."""
    t = torch.as_tensor(values).detach().double()
    return float(t.abs().max()) if t.numel() else 0.0


def failures(differences: Iterable[Difference]) -> list[Difference]:
    return [d for d in differences if not d.ok]


def describe(differences: Iterable[Difference], limit: int = 12) -> str:
    """The mismatches first, one a line, then how many keys agreed."""
    differences = list(differences)
    bad = failures(differences)
    lines = [str(d) for d in bad[:limit]] + ([f"… and {len(bad) - limit} more"] if len(bad) > limit else [])
    return "\n".join(lines + [f"{len(differences) - len(bad)} of {len(differences)} keys within tolerance"])


def _total(terms: dict[str, torch.Tensor]) -> torch.Tensor:
    from ..classifier import CROSS_ENTROPY

    return sum(t for name, t in terms.items() if name != CROSS_ENTROPY)


def newton_schulz(gradient: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (the quintic Newton–Schulz iteration on G/‖G‖_F, on the wide side) in at
    least float32 — torch's own runs it in bfloat16 — returned in the gradient's dtype."""
    a, b, c = coefficients
    x = gradient.to(torch.promote_types(gradient.dtype, torch.float32))
    wide = x.shape[0] > x.shape[1]
    x = x.mT if wide else x
    x = x / x.norm().clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if wide else x).to(gradient.dtype)


@contextlib.contextmanager
def float32_newton_schulz() -> Iterator[None]:
    """torch.optim.Muon's Newton–Schulz in float32 inside the block (its bfloat16 result is defined only in size
    across devices: module docstring)."""
    from torch.optim import _muon

    from .. import optim_muon

    original, batched = _muon._zeropower_via_newtonschulz, optim_muon.orthogonalise
    _muon._zeropower_via_newtonschulz = lambda grad, coefficients, steps, eps: newton_schulz(
        grad, coefficients, steps, eps)
    optim_muon.orthogonalise = lambda stack, coefficients, steps, eps: torch.stack(
        [newton_schulz(m, coefficients, steps, eps) for m in stack])
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz, optim_muon.orthogonalise = original, batched


def step_bounds(module) -> dict[int, float]:
    """id(parameter) → an a-priori bound on the Frobenius norm of its change in one step, from the stabilizers."""
    bounds: dict[int, float] = {}
    for stab in module.stabilizers:
        bounds.update(stab.step_bounds())
    return bounds


def compare_training_step(module, images: torch.Tensor, labels: torch.Tensor, device: str | torch.device,
                          dtype: torch.dtype = torch.float32) -> tuple[list[Difference], torch.nn.Module]:
    """``module`` (the reference, on the CPU in float32, as given) against a copy on ``device`` in ``dtype``: the
    loss terms of one training forward, the gradients, and every parameter and buffer after one optimizer step and
    projection taken from the reference's gradients (IEEE float32 matmuls: no TF32; Muon's Newton–Schulz in float32),
    and the size of each side's update where a stabilizer bounds it a priori. Both modules are stepped; returns the
    differences and the stepped copy."""
    other = copy.deepcopy(module).to(device=device, dtype=dtype)
    out: list[Difference] = []
    with ieee_float32():
        ref_terms = module.losses(images, labels)[1]
        other_terms = other.losses(images.to(device=device, dtype=dtype), labels.to(device))[1]
        for name, value in ref_terms.items():
            out.append(difference(f"loss {name}", value, other_terms[name], LOSS_RTOL * scale(value) + LOSS_ATOL))
        for side, terms in ((module, ref_terms), (other, other_terms)):
            side.zero_grad(set_to_none=True)
            _total(terms).backward()
        ref_params = dict(module.named_parameters())
        other_params = dict(other.named_parameters())
        largest = max((scale(p.grad) for p in ref_params.values() if p.grad is not None), default=0.0)
        for name, p in ref_params.items():
            if p.grad is not None:
                out.append(difference(f"gradient {name}", p.grad, other_params[name].grad,
                                      GRADIENT_RTOL * largest + 1e-12))
        before = {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}
        optimizers = [(side, side.build_optimizer()) for side in (module, other)]
        for name, p in other_params.items():  # the same gradients on both sides: the update is what is compared
            reference = ref_params[name].grad
            p.grad = None if reference is None else reference.to(device=p.device, dtype=p.dtype)
        with float32_newton_schulz():
            for side, optimizer in optimizers:
                label = "reference" if side is module else "other"
                sized = step_bounds(side)
                start = {name: p.detach().clone() for name, p in side.named_parameters() if id(p) in sized}
                optimizer.step()
                for name, p in side.named_parameters():  # the optimizer's step alone, before any projection
                    if name in start:
                        bound = sized[id(p)]
                        change = float(torch.linalg.vector_norm((p.detach() - start[name]).double()))
                        out.append(Difference(f"update size ({label}) {name}", bound, change,
                                              max(0.0, change - bound), 1e-6 * bound))
                side.after_optimizer_step(0)
    other_state = other.state_dict()
    for key, value in module.state_dict().items():
        if key in before:
            tolerance = WEIGHT_RTOL * scale(value) + UPDATE_RTOL * scale(value - before[key]) + 1e-9
            out.append(difference(f"after the step {key}", value, other_state[key], tolerance))
    return out, other


def measurements(module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Every measurement the monitors take, as they take them (float32, eval mode, gradients allowed): local Jacobian
    norms (with and without the patch embedding), the empirical lower bound, FGSM / PGD outcomes and perturbations,
    attention statistics, the certified bound and radii where a bound exists, and the stabilizers' labelled bounds."""
    import torchattacks

    from ..callbacks import LipschitzMonitor
    from ..callbacks.bounds import certified_bound_of
    from ..lipschitz.attention import point_statistics
    from ..robustness import AttackSettings, AttackSpec, certified_radii, evaluate_batch
    from ..robustness.attacks import evaluating, gradients_allowed
    from ..robustness.pgd import PGD

    network = module.network
    out = LipschitzMonitor(iterations=2, exclude_patch_embed=True).measure_points(network, 0, images)
    specs = [AttackSpec("fgsm", "Linf", FGSM_EPS), AttackSpec("pgd", "L2", PGD_EPS)]
    settings = AttackSettings(10, pgd_steps=2)
    out["outcomes"] = evaluate_batch(network, images, labels, specs, settings)
    with gradients_allowed(), evaluating(network):  # the perturbations behind those outcomes, as the attacks make them
        x = images.detach().clone()
        out["fgsm_delta"] = torchattacks.FGSM(network, eps=FGSM_EPS)(x, labels) - x
        alpha = 2.5 * PGD_EPS / settings.pgd_steps
        out["pgd_delta"] = PGD(network, "L2", PGD_EPS, alpha, settings.pgd_steps, seed=settings.seed)(x, labels) - x
    with evaluating(network):
        out["attention"] = point_statistics(network, images)
    bound, _ = certified_bound_of(module.stabilizers, network)
    if bound is not None:
        with evaluating(network), torch.no_grad():
            out["radii"] = certified_radii(network(images), labels, bound)
        out["bound"] = bound.value
    out["labelled"] = {k: v for s in module.stabilizers for k, v in s.labelled_bounds(network).items()}
    return out


MEASURED = ("local", "local_noembed", "lower_bound", "radii", "bound")


def compare_measurements(reference: dict, other: dict) -> list[Difference]:
    """The numeric measurements of :func:`measurements`, each relative to its own largest value, and the attacks as
    the module docstring says."""
    out = [difference(key, reference[key], other[key],
                      (ASCENT_RTOL if key == "lower_bound" else MEASUREMENT_RTOL) * scale(reference[key]) + 1e-9)
           for key in MEASURED if key in reference]
    if "pgd_delta" in reference:
        out.append(difference("pgd δ (L2)", reference["pgd_delta"], other["pgd_delta"], PGD_RTOL * PGD_EPS))
        ref_sign, other_sign = reference["fgsm_delta"].sign().cpu(), other["fgsm_delta"].sign().cpu()
        flipped = float((ref_sign != other_sign).double().mean())
        out.append(Difference("fgsm δ (Linf): share of pixels whose sign differs", 0.0, flipped, flipped,
                              FGSM_SIGN_SHARE))
        for key, mask in reference["outcomes"].items():
            differing = int((mask.cpu() != other["outcomes"][key].cpu()).sum())
            out.append(Difference(f"outcome {key}: points that differ", 0.0, differing, differing, OUTCOME_POINTS))
    return out


__all__ = ["Difference", "compare_measurements", "compare_training_step", "describe", "difference", "failures",
           "float32_newton_schulz", "measurements", "newton_schulz", "step_bounds"]
