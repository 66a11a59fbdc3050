"""Lipschitz-margin training (Tsuzuku et al. 2018, "Lipschitz-Margin Training: Scalable
Certification of Perturbation Invariance for Deep Neural Networks"; docs/methods.md#certified-robustness).

The task loss becomes the cross-entropy of the logits with √2·L·ε added to every non-target logit,

    CE(τ·(z + √2·L·ε·(1 − e_y)), y) / τ,

so that a training point is fitted only with a margin that certifies it at ℓ2 radius ε. L is the
model's bound of pixels → logits, composed from the current weights. τ (``temperature``, 1 in the paper)
sharpens the softmax without touching the model, for the small logits of a Lipschitz network (as ``tau_ce``).

For the Lipschitz-transformer ViT, L is composed (:func:`~stability.lipschitz.transformer_bounds.pixel_bound`)
from σ₁ estimates of every matrix by a persistent power iteration — one step per training step, as
Tsuzuku et al. do (here a block of vectors with Rayleigh–Ritz, :class:`~stability.nn.spectral.SubspaceIteration`),
on vectors kept as buffers of the network — in float32 with autocast off, and it is differentiable through
them (σ̂ = uᵀWv with u, v held constant), so the loss also pulls the bound down; ``bound_gradient: false``
holds L constant for the step instead (the loss then moves the margins alone).
The estimates approach σ₁ from below, so the training L is at most the certified one; certification
(at test) always uses the exact bound. For LipsFormer (ViT) the certified bound is recomputed exactly
and held constant for the step (float64 and a host sync per step: that combination is not GPU-tuned).
Soft labels (MixUp, CutMix) add the margin in proportion to 1 − y.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..lipschitz.certified import certified_bound
from ..lipschitz.transformer_bounds import NotALipschitzTransformer, bound_matrices, pixel_bound
from ..nn.precision import float32_math
from ..nn.spectral import SubspaceIteration
from .base import ForwardStep, Stabilizer, register_stabilizer

PREFIX = "lipschitz_margin"


@register_stabilizer
class LipschitzMargin(Stabilizer):
    """``--stabilizer lipschitz_margin``.

    Args:
        eps: the ℓ2 radius (pixel units) to train a margin for.
        iterations: power-iteration steps per training step for the bound's σ₁'s (Lipschitz transformer).
        temperature: τ of CE(τ·(shifted logits))/τ.
        bound_gradient: differentiate the loss through L (it then also pulls the bound down); false holds L
            constant for the step.
    """

    name = "lipschitz_margin"
    summary = "task loss CE(τ·(z + √2·L·ε·(1 − e_y)))/τ: a margin that certifies each training point at ℓ2 radius ε"
    source = "Tsuzuku et al. 2018"
    prepare_order = 3  # after the architecture and the constraints: the bound of the final network
    needs = ("lipschitz_transformer",)  # or lipsformer: a model with a certified bound
    backbones = ("vit",)  # where the certified bounds are implemented

    def __init__(self, eps: float = 0.5, iterations: int = 1, temperature: float = 1.0,
                 bound_gradient: bool = True) -> None:
        if eps < 0:
            raise ValueError(f"lipschitz_margin: eps must be >= 0, got {eps}")
        if iterations < 1 or temperature <= 0:
            raise ValueError(f"lipschitz_margin: need iterations >= 1 and temperature > 0; got {iterations}, "
                             f"{temperature}")
        self.eps, self.iterations, self.temperature = eps, iterations, temperature
        self.bound_gradient = bound_gradient
        self.bound_source = ""
        self._names: list[str] = []
        self._power: SubspaceIteration | None = None
        self.last_bound: torch.Tensor | None = None  # the L of the last training step (detached, on the device)

    def prepare(self, network: nn.Module) -> None:
        bound, reason = certified_bound(network)
        if bound is None:
            raise ValueError(f"lipschitz_margin needs a model with a certified Lipschitz bound ({reason}); combine it "
                             f"with lipschitz_transformer (or lipsformer on ViT)")
        try:
            matrices = bound_matrices(network)
        except NotALipschitzTransformer:
            self.bound_source = "certified bound, exact, constant per step (LipsFormer)"
            return
        self.bound_source = ("power-iteration σ₁ estimates, " + ("differentiable" if self.bound_gradient else
                             "constant per step") + " (Lipschitz transformer)")
        self._names = list(matrices)
        self._power = SubspaceIteration([(network, f"{PREFIX}_{i}") for i in range(len(self._names))],
                                     [tuple(m.shape) for m in matrices.values()])
        self._power.step([m.detach() for m in matrices.values()], iterations=30)  # warm start

    def estimated_sigmas(self, network: nn.Module) -> dict[str, torch.Tensor]:
        """σ̂ = uᵀWv of every matrix of the bound after one power-iteration step, float32, differentiable in W."""
        matrices = bound_matrices(network)
        weights = [matrices[name] for name in self._names]
        sigmas: dict[str, torch.Tensor] = {}
        for group in self._power.step(weights, self.iterations):
            stacked = torch.stack([weights[i] for i in group.indices]).to(group.weight.dtype)  # with the graph
            values = torch.einsum("gm,gmn,gn->g", group.u, stacked, group.v)
            sigmas.update({self._names[i]: value for i, value in zip(group.indices, values.unbind(0))})
        return sigmas

    def margin_bound(self, network: nn.Module) -> torch.Tensor:
        """L: the bound of the current weights (with its graph where it is differentiable)."""
        if self._power is not None:
            with float32_math(network.mean.device.type):
                return pixel_bound(network, differentiable=True, sigmas=self.estimated_sigmas(network))[0]
        bound, reason = certified_bound(network)
        if bound is None:
            raise RuntimeError(f"lipschitz_margin: the model lost its certified bound ({reason})")
        return network.mean.new_tensor(bound.value)

    def task_loss(self, step: ForwardStep, default) -> torch.Tensor:
        bound = self.margin_bound(step.network)
        self.last_bound = bound.detach()
        if not self.bound_gradient:
            bound = self.last_bound
        margin = math.sqrt(2) * bound.float() * self.eps
        shifted = step.logits.float() + margin * (1 - step.soft_targets())  # float32 under autocast too
        return default(self.temperature * shifted) / self.temperature

    def signals(self) -> dict[str, torch.Tensor]:
        return {"bound": self.last_bound} if self.last_bound is not None else {}
