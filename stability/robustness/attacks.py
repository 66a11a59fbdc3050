"""Robust accuracy under FGSM, PGD and AutoAttack from torchattacks (docs/methods.md#robustness-evaluation).

Inputs are in [0, 1] (normalisation lives inside the network). Every attack is seeded
explicitly (the global RNG is restored afterwards, so evaluation never perturbs training), and
gradients are enabled even when called under ``torch.no_grad`` or Lightning's
``inference_mode``. AutoAttack is torchattacks' version, which runs fewer iterations than the
reference implementation: it is labelled ``autoattack_tap``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torchattacks
from torch import nn

ATTACKS = ("fgsm", "pgd", "autoattack")
NORMS = ("Linf", "L2")


@dataclass(frozen=True)
class AttackSpec:
    """One attack at one budget: name, norm and ε (pixel units, [0, 1] scale)."""

    name: str
    norm: str
    eps: float

    @property
    def label(self) -> str:
        """e.g. ``pgd_Linf_8/255`` for ℓ∞ budgets given as k/255, ``pgd_L2_0.5`` otherwise."""
        name = "autoattack_tap" if self.name == "autoattack" else self.name
        k = self.eps * 255
        eps = f"{round(k)}/255" if self.norm == "Linf" and abs(k - round(k)) < 1e-6 else f"{self.eps:g}"
        return f"{name}_{self.norm}_{eps}"


def build_attack(spec: AttackSpec, network: nn.Module, num_classes: int, pgd_steps: int, pgd_alpha: float | None,
                 seed: int):
    if spec.name not in ATTACKS:
        raise ValueError(f"unknown attack {spec.name!r}; choose from {ATTACKS}")
    if spec.norm not in NORMS:
        raise ValueError(f"unknown norm {spec.norm!r}; choose from {NORMS}")
    alpha = pgd_alpha if pgd_alpha is not None else 2.5 * spec.eps / pgd_steps
    if spec.name == "autoattack":
        return torchattacks.AutoAttack(network, norm=spec.norm, eps=spec.eps, version="standard",
                                       n_classes=num_classes, seed=seed)
    if spec.norm == "L2":
        if spec.name == "fgsm":
            return torchattacks.PGDL2(network, eps=spec.eps, alpha=spec.eps, steps=1, random_start=False)
        return torchattacks.PGDL2(network, eps=spec.eps, alpha=alpha, steps=pgd_steps, random_start=True)
    if spec.name == "fgsm":
        return torchattacks.FGSM(network, eps=spec.eps)
    return torchattacks.PGD(network, eps=spec.eps, alpha=alpha, steps=pgd_steps, random_start=True)


@contextlib.contextmanager
def gradients_allowed():
    """Leave inference mode and no_grad, whatever the caller (Lightning validate/test) set."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def robust_accuracy(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, specs: Sequence[AttackSpec],
                    num_classes: int, pgd_steps: int = 10, pgd_alpha: float | None = None, seed: int = 0,
                    batch_size: int = 256) -> dict[str, float]:
    """``{"clean": acc, spec.label: robust acc, ...}`` on the same points."""
    was_training = network.training
    network.eval()
    results: dict[str, float] = {}
    try:
        with gradients_allowed():
            images, labels = images.clone(), labels.clone()  # ordinary tensors, even from inference mode
            with torch.no_grad():
                results["clean"] = _accuracy(network, images, labels, batch_size)
            for spec in specs:
                if spec.eps == 0:
                    results[spec.label] = results["clean"]
                    continue
                with torch.random.fork_rng(devices=[images.device] if images.is_cuda else []):
                    torch.manual_seed(seed)
                    attack = build_attack(spec, network, num_classes, pgd_steps, pgd_alpha, seed)
                    adversarial = torch.cat([attack(images[i:i + batch_size], labels[i:i + batch_size])
                                             for i in range(0, len(labels), batch_size)])
                with torch.no_grad():
                    results[spec.label] = _accuracy(network, adversarial, labels, batch_size)
    finally:
        network.train(was_training)
    return results


def _accuracy(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> float:
    correct = sum(int((network(images[i:i + batch_size]).argmax(-1) == labels[i:i + batch_size]).sum())
                  for i in range(0, len(labels), batch_size))
    return correct / max(1, len(labels))
