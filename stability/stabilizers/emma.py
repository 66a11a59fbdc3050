"""EMMA, efficient margin maximisation (Hu, Wang, Leino & Fredrikson 2023, "Unlocking Deterministic Robustness
Certification on ImageNet", NeurIPS; code: hukkai/liresnet ``emma_loss``; docs/methods.md#certified-training).

Each non-target logit is raised by its own share of the radius: z_j + ε_j·ε·K_yj with
ε_j = clip((z_y − z_j)/(ε·K_yj), 0.01, 1), held constant (no gradient through ε_j), then the cross-entropy. A pair
that already certifies ε is pushed at ε; a pair that cannot is pushed only at the radius it has, so points far
from ε do not dominate the loss, as they do under the plain margin (``lipschitz_margin``), which asks every pair
for all of ε. K_yj as ``gloro``'s, from :class:`~stability.lipschitz.training_bound.TrainingBound`.
"""
from __future__ import annotations

import torch

from ..certified_training import MarginBound, emma_loss
from .base import ForwardStep, register_stabilizer
from .certified_loss import CertifiedLoss


@register_stabilizer
class EMMA(CertifiedLoss):
    """``--stabilizer emma`` (with ``lipschitz_transformer`` on ViT; alone on ``--model.backbone lipcnn``).

    Args:
        eps: the ℓ2 radius (pixel units) the model is to certify.
        overshoot, ramp, ramp_start, ramp_end, ramp_from, temperature, iterations, bound_gradient: as ``gloro``.
    """

    name = "emma"
    summary = ("task loss CE(z_j + clip((z_y − z_j)/(ε·K_yj), 0.01, 1)·ε·K_yj): each pair pushed at the radius it can "
               "reach")
    source = "Hu et al. 2023"
    takes_label_smoothing = False

    def __init__(self, eps: float = 0.5, overshoot: float = 1.0, ramp: str = "none", ramp_start: float = 0.0,
                 ramp_end: float = 0.5, ramp_from: float = 0.01, temperature: float = 1.0, iterations: int = 1,
                 bound_gradient: bool = True) -> None:
        super().__init__(eps, overshoot, ramp, ramp_start, ramp_end, ramp_from, temperature, iterations,
                         bound_gradient)

    def loss_of(self, step: ForwardStep, bound: MarginBound, eps: float, default) -> torch.Tensor:
        return emma_loss(step.logits, step.targets, bound, eps, self.temperature)
