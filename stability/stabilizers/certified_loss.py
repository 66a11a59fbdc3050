"""What the certified-training losses share (``lipschitz_margin``, ``gloro``, ``emma``): the radius they ask for
at each step (:class:`~stability.certified_training.EpsilonSchedule`), the model's bound at each step
(:class:`~stability.lipschitz.training_bound.TrainingBound`), a temperature, and the signals they log. Not a
stabilizer itself (it is not registered); each loss is one subclass.
"""
from __future__ import annotations

import torch
from torch import nn

from ..certified_training import EpsilonSchedule, MarginBound
from ..lipschitz.training_bound import TrainingBound
from .base import ForwardStep, Stabilizer


class CertifiedLoss(Stabilizer):
    """Args shared by every certified-training loss:
        eps: the ℓ2 radius (pixel units) the model is to certify.
        overshoot: train at overshoot·eps (GloRo: 1.1).
        ramp: ``none``, ``linear`` or ``log`` (GloRo's logarithmic curve) from ``ramp_from``·eps to overshoot·eps.
        ramp_start, ramp_end: fractions of training where the ramp starts and ends.
        ramp_from: the ramp's start as a fraction of eps (GloRo 0.01: ``[0.01]-log-[50%:1.1]``; BCP 0).
        temperature: τ of CE(τ·logits)/τ (1 in the papers).
        iterations: power-iteration steps per training step for a bound composed from σ₁ estimates.
        bound_gradient: differentiate the loss through the bound (false: it is constant for the step).
    """

    prepare_order = 3  # after the architecture and the constraints: the bound of the final network
    needs = ("lipschitz_transformer",)  # on ViT; the convolutional anchor (lipcnn) certifies on its own
    backbones = ("vit", "lipcnn", "hybrid")  # where certified bounds are implemented

    def __init__(self, eps: float, overshoot: float, ramp: str, ramp_start: float, ramp_end: float, ramp_from: float,
                 temperature: float, iterations: int, bound_gradient: bool) -> None:
        if temperature <= 0:
            raise ValueError(f"{self.name}: temperature must be > 0, got {temperature}")
        try:
            self.schedule = EpsilonSchedule(eps, overshoot, ramp, ramp_start, ramp_end, ramp_from)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        self.eps, self.overshoot, self.ramp = eps, overshoot, ramp
        self.ramp_start, self.ramp_end, self.ramp_from = ramp_start, ramp_end, ramp_from
        self.temperature, self.iterations, self.bound_gradient = temperature, iterations, bound_gradient
        self.training_bound = TrainingBound(self.name, iterations, bound_gradient)
        self.last_bound: torch.Tensor | None = None  # L of the last training step (detached, on the device)
        self.last_eps: float | None = None  # the radius the last training step asked for

    @property
    def bound_source(self) -> str:
        return self.training_bound.source

    def prepare(self, network: nn.Module) -> None:
        self.training_bound.prepare(network)

    def compile_terms(self) -> None:
        self.training_bound.compile()

    def margin_bound(self, network: nn.Module) -> MarginBound:
        """The bound of the current weights (with its graph where it is differentiable)."""
        return self.training_bound(network)

    def step_eps(self, step: ForwardStep) -> float:
        """The radius asked for at this step (the schedule at the run's progress)."""
        self.last_eps = self.schedule.at(step.progress)
        return self.last_eps

    def task_loss(self, step: ForwardStep, default) -> torch.Tensor:
        bound = self.margin_bound(step.network)
        self.last_bound = bound.total.detach()
        return self.loss_of(step, bound, self.step_eps(step), default)

    def loss_of(self, step: ForwardStep, bound: MarginBound, eps: float, default) -> torch.Tensor:
        """The objective at this step, from the logits, the bound and the radius (``default``: the module's
        cross-entropy of given logits, with its label smoothing)."""
        raise NotImplementedError

    def signals(self) -> dict[str, float | torch.Tensor]:
        out: dict[str, float | torch.Tensor] = {}
        if self.last_bound is not None:
            out["bound"] = self.last_bound
        if self.last_eps is not None:
            out["eps"] = self.last_eps
        return out

    def hparams(self) -> dict:
        return {k: v for k, v in super().hparams().items() if k not in ("last_eps",)}


__all__ = ["CertifiedLoss"]
