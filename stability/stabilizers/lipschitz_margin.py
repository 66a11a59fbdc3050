"""Lipschitz-margin training (Tsuzuku et al. 2018, "Lipschitz-Margin Training: Scalable
Certification of Perturbation Invariance for Deep Neural Networks"; docs/methods.md#certified-robustness).

The task loss becomes the cross-entropy of the logits with √2·L·ε added to every non-target logit,

    CE(z + √2·L·ε·(1 − e_y), y),

so that a training point is fitted only with a margin that certifies it at ℓ2 radius ε. L is the
model's certified bound of pixels → logits, composed from the current weights: differentiably
through the measured σ₁'s for the Lipschitz-transformer ViT (so the loss also pulls the bound
down, as in the paper), otherwise the bound's value held constant for the step (LipsFormer).
Soft labels (MixUp, CutMix) add the margin in proportion to 1 − y.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..lipschitz.certified import certified_bound
from ..lipschitz.transformer_bounds import NotALipschitzTransformer, pixel_bound
from .base import ForwardStep, Stabilizer, register_stabilizer


@register_stabilizer
class LipschitzMargin(Stabilizer):
    """``--stabilizer lipschitz_margin``. Args: eps, the ℓ2 radius (pixel units) to train a margin for."""

    name = "lipschitz_margin"
    summary = "task loss CE(z + √2·L·ε·(1 − e_y)): a margin that certifies each training point at ℓ2 radius ε"
    source = "Tsuzuku et al. 2018"
    prepare_order = 3  # after the architecture and the constraints: the bound of the final network
    needs = ("lipschitz_transformer",)  # or lipsformer: a model with a certified bound
    backbones = ("vit",)  # where the certified bounds are implemented

    def __init__(self, eps: float = 0.5) -> None:
        if eps < 0:
            raise ValueError(f"lipschitz_margin: eps must be >= 0, got {eps}")
        self.eps = eps
        self.bound_source = ""

    def prepare(self, network: nn.Module) -> None:
        bound, reason = certified_bound(network)
        if bound is None:
            raise ValueError(f"lipschitz_margin needs a model with a certified Lipschitz bound ({reason}); combine it "
                             f"with lipschitz_transformer (or lipsformer on ViT)")
        try:
            pixel_bound(network)
            self.bound_source = "differentiable (measured σ₁, Lipschitz transformer)"
        except NotALipschitzTransformer:
            self.bound_source = "constant per step (measured)"

    def margin_bound(self, network: nn.Module) -> torch.Tensor:
        """L: the certified bound of the current weights (with its graph where it is differentiable)."""
        try:
            return pixel_bound(network, differentiable=True)[0]
        except NotALipschitzTransformer:
            bound, reason = certified_bound(network)
            if bound is None:
                raise RuntimeError(f"lipschitz_margin: the model lost its certified bound ({reason})") from None
            return torch.tensor(bound.value, dtype=torch.float64)

    def task_loss(self, step: ForwardStep, default) -> torch.Tensor:
        logits, targets = step.logits, step.targets
        soft = targets if targets.ndim == 2 else nn.functional.one_hot(targets, logits.shape[-1]).to(logits.dtype)
        margin = math.sqrt(2) * self.margin_bound(step.network).to(logits) * self.eps
        return default(logits + margin * (1 - soft))
