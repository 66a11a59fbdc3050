"""Empirical robust accuracy: which points survive FGSM, PGD or AutoAttack
(docs/methods.md#robustness-evaluation).

* ``autoattack`` is the official AutoAttack (Croce & Hein 2020, the ``pyautoattack`` package, the
  code RobustBench depends on): standard version by default — APGD-CE, APGD-T (9 target classes),
  FAB-T and Square (5,000 queries), 100 iterations each; ℓ∞, ℓ2 and ℓ1; ``plus`` and ``rand`` too.
* ``autoattack_tap`` is torchattacks' AutoAttack (10 iterations per attack): weaker, optimistic.
* ``fgsm`` comes from torchattacks (ℓ2 FGSM is one full-size normalised gradient step); ``pgd`` is torchattacks'
  PGD / PGDL2 step for step, with its random start drawn on a seeded CPU generator (:mod:`.pgd`), so that every
  device attacks from the same points.

Inputs are in [0, 1] (normalisation lives inside the network). Every attack runs in float32, in
eval mode, with gradients enabled even under ``torch.no_grad`` or Lightning's ``inference_mode``,
seeded explicitly (the global RNG is restored afterwards, so evaluation never perturbs training).

Points are processed in fixed batches and batch b is attacked with seed ``seed + b``, so a point's
outcome depends only on its batch, not on how batches are spread over processes: one process and
several give identical results. A point *survives* an attack when the network still classifies the
attacked image correctly; the worst case over the attacks run at one budget (RobustBench's
convention) is the share of points that survive every one of them.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torchattacks
from pyautoattack import AutoAttack
from torch import nn

from ..nn.aol import frozen_aol_weights
from ..nn.precision import float32_math
from .pgd import PGD

ATTACKS = ("fgsm", "pgd", "autoattack", "autoattack_tap")
NORMS = {"fgsm": ("Linf", "L2"), "pgd": ("Linf", "L2"), "autoattack": ("Linf", "L2", "L1"),
         "autoattack_tap": ("Linf", "L2")}
AUTOATTACK_VERSIONS = ("standard", "plus", "rand")


def budget_label(norm: str, eps: float) -> str:
    """``Linf_8/255`` for ℓ∞ budgets that are k/255, ``L2_0.5`` otherwise."""
    k = eps * 255
    value = f"{round(k)}/255" if norm == "Linf" and abs(k - round(k)) < 1e-6 else f"{eps:g}"
    return f"{norm}_{value}"


@dataclass(frozen=True)
class AttackSpec:
    """One attack at one budget: name, norm and ε (pixel units, [0, 1] scale)."""

    name: str
    norm: str
    eps: float

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; choose from {ATTACKS}")
        if self.norm not in NORMS[self.name]:
            raise ValueError(f"unknown norm {self.norm!r} for {self.name}; choose from {NORMS[self.name]}")
        if self.eps < 0:
            raise ValueError(f"attack budget must be >= 0, got {self.eps}")

    @property
    def budget(self) -> str:
        return budget_label(self.norm, self.eps)

    @property
    def label(self) -> str:
        """e.g. ``pgd_Linf_8/255``, ``autoattack_L2_0.5`` (official), ``autoattack_tap_Linf_2/255``."""
        return f"{self.name}_{self.budget}"


@dataclass(frozen=True)
class AttackSettings:
    """How the attacks run: PGD steps and step size (2.5·ε/steps by default), AutoAttack's version,
    the base seed, and the number of classes (torchattacks' AutoAttack needs it)."""

    num_classes: int
    pgd_steps: int = 10
    pgd_alpha: float | None = None
    autoattack_version: str = "standard"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.autoattack_version not in AUTOATTACK_VERSIONS:
            raise ValueError(f"unknown AutoAttack version {self.autoattack_version!r}; "
                             f"choose from {AUTOATTACK_VERSIONS}")
        if self.pgd_steps < 1:
            raise ValueError(f"pgd_steps must be >= 1, got {self.pgd_steps}")


@contextlib.contextmanager
def gradients_allowed() -> Iterator[None]:
    """Leave inference mode and no_grad, whatever the caller (Lightning validate/test) set."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


@contextlib.contextmanager
def frozen_weights(network: torch.nn.Module, frozen: bool = True) -> Iterator[None]:
    """The network's parameters need no gradient inside the block (restored after). A measurement differentiates with
    respect to its inputs only, but a compiled backward computes the gradient of every input of its graph that needs
    one, and ``loss.backward()`` (the official AutoAttack's) accumulates one into every parameter that needs one;
    eager ``torch.autograd.grad`` computes only those asked for."""
    # (an inference tensor cannot take requires_grad back outside inference mode; it needs no gradient anyway)
    needing = [p for p in network.parameters() if p.requires_grad and not p.is_inference()] if frozen else []
    for p in needing:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in needing:
            p.requires_grad_(True)


def input_gradient(network: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                   weights: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """An attack's unit of work: the cross-entropy's gradient at ``images`` (and at ``weights``: FAB's backward
    reaches them on a network whose weights need gradients; the monitors' attacks freeze them), through
    ``torch.autograd.grad`` (no ``.grad`` is touched). Copies of the inputs are ordinary
    tensors, also when they were made under inference mode; call it inside :func:`gradients_allowed`."""
    x = images.detach().clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(network(x), labels.clone())
    return torch.autograd.grad(loss, [x, *weights])


@contextlib.contextmanager
def evaluating(network: nn.Module) -> Iterator[None]:
    """Eval mode, no autocast and IEEE float32 matmuls (no TF32) inside the block: measurements are
    float32 whatever precision the run trains in. The weights do not change inside: AOL layers compute their
    effective weights once (:func:`~stability.nn.aol.frozen_aol_weights`), not at each of the passes."""
    was_training = network.training
    network.eval()
    tensor = next(itertools.chain(network.parameters(), network.buffers()), None)
    device = "cpu" if tensor is None else tensor.device.type
    try:
        with float32_math(device), frozen_aol_weights(network):
            yield
    finally:
        network.train(was_training)


def _attack(spec: AttackSpec, network: nn.Module, settings: AttackSettings, seed: int, device: torch.device):
    alpha = settings.pgd_alpha if settings.pgd_alpha is not None else 2.5 * spec.eps / settings.pgd_steps
    if spec.name == "autoattack":
        attack = AutoAttack(network, eps=spec.eps, norm=spec.norm, seed=seed, version=settings.autoattack_version,
                            device=device)
        return lambda x, y: attack.run_standard_evaluation(x, y, batch_size=len(y))[0]
    if spec.name == "autoattack_tap":
        return torchattacks.AutoAttack(network, norm=spec.norm, eps=spec.eps, version=settings.autoattack_version,
                                       n_classes=settings.num_classes, seed=seed)
    if spec.name == "pgd":  # torchattacks' PGD step for step, its random start drawn on a seeded CPU generator
        return PGD(network, spec.norm, spec.eps, alpha, settings.pgd_steps, random_start=True, seed=seed)
    if spec.norm == "L2":
        return torchattacks.PGDL2(network, eps=spec.eps, alpha=spec.eps, steps=1, random_start=False)
    return torchattacks.FGSM(network, eps=spec.eps)


def correct(network: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the network classifies each image correctly."""
    with torch.no_grad():
        return network(images).argmax(-1) == labels


def survivors(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, spec: AttackSpec,
              settings: AttackSettings, batch_index: int = 0) -> torch.Tensor:
    """(B,) bool: the points of one batch classified correctly both as they are and after ``spec`` (seed
    ``settings.seed + batch_index``). ε = 0 is clean correctness.

    A point the network gets wrong is not robust, whatever an attack does to it: x itself lies in its ε-ball,
    so robust accuracy ≤ clean accuracy on the same points (FGSM or PGD can push a wrong point into the right
    class; the official AutoAttack never attacks wrong points)."""
    with gradients_allowed(), evaluating(network), frozen_weights(network):
        images, labels = images.detach().float().clone(), labels.clone()  # ordinary tensors, even from inference mode
        clean = correct(network, images, labels)
        if spec.eps == 0:
            return clean
        seed = settings.seed + batch_index
        with torch.random.fork_rng(devices=[images.device] if images.is_cuda else []):
            torch.manual_seed(seed)
            adversarial = _attack(spec, network, settings, seed, images.device)(images, labels)
        return clean & correct(network, adversarial.detach(), labels)


def evaluate_batch(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, specs: Sequence[AttackSpec],
                   settings: AttackSettings, batch_index: int = 0) -> dict[str, torch.Tensor]:
    """``{"clean": (B,) bool, spec.label: (B,) bool, ...}`` for one batch of points."""
    with gradients_allowed(), evaluating(network):
        results = {"clean": correct(network, images.detach().float(), labels)}
    for spec in specs:
        results[spec.label] = survivors(network, images, labels, spec, settings, batch_index)
    return results


def worst_case(masks: dict[str, torch.Tensor], specs: Sequence[AttackSpec]) -> dict[str, torch.Tensor]:
    """``{"worst_<budget>": (n,) bool}``: survived every attack run at that budget (ε > 0), on the
    points all of them ran on (a prefix, when an attack ran on fewer points)."""
    budgets: dict[str, list[str]] = {}
    for spec in specs:
        if spec.eps > 0:
            budgets.setdefault(spec.budget, []).append(spec.label)
    out = {}
    for budget, labels in budgets.items():
        n = min(len(masks[label]) for label in labels)
        survived = torch.ones(n, dtype=torch.bool)
        for label in labels:
            survived &= masks[label][:n].cpu()
        out[f"worst_{budget}"] = survived
    return out


def accuracies(masks: dict[str, torch.Tensor]) -> dict[str, float]:
    return {label: float(mask.float().mean()) if len(mask) else float("nan") for label, mask in masks.items()}


def robust_accuracy(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, specs: Sequence[AttackSpec],
                    num_classes: int, pgd_steps: int = 10, pgd_alpha: float | None = None, seed: int = 0,
                    batch_size: int = 256, autoattack_version: str = "standard") -> dict[str, float]:
    """``{"clean": acc, spec.label: robust acc, ..., "worst_<budget>": acc}`` on the same points,
    attacked ``batch_size`` at a time (batch b with seed ``seed + b``)."""
    settings = AttackSettings(num_classes, pgd_steps, pgd_alpha, autoattack_version, seed)
    batches = [evaluate_batch(network, images[i:i + batch_size], labels[i:i + batch_size], specs, settings, b)
               for b, i in enumerate(range(0, len(labels), batch_size))]
    masks = {label: torch.cat([batch[label].cpu() for batch in batches]) for label in batches[0]}
    return accuracies({**masks, **worst_case(masks, specs)})
