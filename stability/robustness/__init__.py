"""Adversarial robustness evaluation (torchattacks), usable without Lightning."""
from .attacks import ATTACKS, AttackSpec, robust_accuracy

__all__ = ["ATTACKS", "AttackSpec", "robust_accuracy"]
