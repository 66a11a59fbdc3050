"""Lipschitz-margin training (Tsuzuku et al. 2018, "Lipschitz-Margin Training: Scalable
Certification of Perturbation Invariance for Deep Neural Networks"; docs/methods.md#certified-training).

The task loss becomes the cross-entropy of the logits with √2·L·ε added to every non-target logit,

    CE(τ·(z + √2·L·ε·(1 − e_y)), y) / τ,

so that a training point is fitted only with a margin that certifies it at ℓ2 radius ε. L is the
model's bound of pixels → logits, composed from the current weights
(:class:`~stability.lipschitz.training_bound.TrainingBound`: power-iteration σ₁ estimates on the Lipschitz
transformer, differentiable unless ``bound_gradient: false``; the construction's 1 per layer on the convolutional
anchor; LipsFormer's exact bound). ``pairwise: true`` adds ε·K_yj instead, K_yj = L_h·‖w_y − w_j‖ the per-pair
constant of the linear head (the certificate's own refinement, stability/robustness/certified.py). τ
(``temperature``, 1 in the paper) sharpens the softmax without touching the model, for the small logits of a
Lipschitz network (as ``tau_ce``). ε follows the shared schedule (a ramp, an overshoot: ``gloro``'s options).
Soft labels (MixUp, CutMix) add the √2·L margin in proportion to 1 − y.
"""
from __future__ import annotations

import torch

from ..certified_training import MarginBound, margin_logits
from .base import ForwardStep, register_stabilizer
from .certified_loss import CertifiedLoss


@register_stabilizer
class LipschitzMargin(CertifiedLoss):
    """``--stabilizer lipschitz_margin``.

    Args:
        eps: the ℓ2 radius (pixel units) to train a margin for.
        iterations: power-iteration steps per training step for the bound's σ₁'s (Lipschitz transformer).
        temperature: τ of CE(τ·(shifted logits))/τ.
        bound_gradient: differentiate the loss through L (it then also pulls the bound down); false holds L
            constant for the step.
        pairwise: the per-pair constant of the linear head (ε·K_yj) instead of √2·L·ε.
        overshoot, ramp, ramp_start, ramp_end, ramp_from: the radius's schedule
            (:class:`~stability.stabilizers.certified_loss.CertifiedLoss`).
    """

    name = "lipschitz_margin"
    summary = "task loss CE(τ·(z + √2·L·ε·(1 − e_y)))/τ: a margin that certifies each training point at ℓ2 radius ε"
    source = "Tsuzuku et al. 2018"

    def __init__(self, eps: float = 0.5, iterations: int = 1, temperature: float = 1.0,
                 bound_gradient: bool = True, pairwise: bool = False, overshoot: float = 1.0, ramp: str = "none",
                 ramp_start: float = 0.0, ramp_end: float = 0.5, ramp_from: float = 0.01) -> None:
        super().__init__(eps, overshoot, ramp, ramp_start, ramp_end, ramp_from, temperature, iterations,
                         bound_gradient)
        self.pairwise = pairwise

    def loss_of(self, step: ForwardStep, bound: MarginBound, eps: float, default) -> torch.Tensor:
        if self.pairwise and bound.head is None:
            raise ValueError("lipschitz_margin: pairwise needs a model whose logits are a linear head with a bounded "
                             "input (its bound names none)")
        shifted = margin_logits(step.logits, step.targets, bound, eps, self.pairwise)
        return default(self.temperature * shifted) / self.temperature  # the module's CE, its label smoothing too
