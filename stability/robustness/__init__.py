"""Adversarial robustness evaluation (official AutoAttack, torchattacks) and certified accuracy,
usable without Lightning."""
from .attacks import ATTACKS, AttackSettings, AttackSpec, evaluate_batch, robust_accuracy, survivors, worst_case
from .certified import certified_at, certified_radii, l2_radius

__all__ = ["ATTACKS", "AttackSettings", "AttackSpec", "certified_at", "certified_radii", "evaluate_batch",
           "l2_radius", "robust_accuracy", "survivors", "worst_case"]
