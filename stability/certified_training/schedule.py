"""The radius a certified-training loss asks for at each step: a ramp from a small start, and an overshoot of the
radius the model will be evaluated at (docs/methods.md#certified-training).

* GloRo's code (klasleino/gloro, ``gloro.training.schedules``; its MNIST command ``[0.01]-log-[50%:1.1]``) trains at
  1.1 × the evaluated radius ε, starting from 0.01·ε and reaching 1.1·ε at half of training, on the curve
  ε(t) = log((e^ε₁ − e^ε₀)·t + e^ε₀) for t from 0 to 1 along the ramp (concave: fast at first), then constant.
* BCP (Lee et al. 2020, sungyoon-lee/bcp) ramps ε linearly from 0 after one clean epoch over 20 of 60 epochs.

Progress is the fraction of the run's optimizer steps already taken (step / total steps); a loss called without a
known total (outside a trainer) gets the final value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

RAMPS = ("none", "linear", "log")
Ramp = Literal["none", "linear", "log"]


@dataclass(frozen=True)
class EpsilonSchedule:
    """ε(progress) for a loss that certifies radius ``eps``.

    Args:
        eps: the radius the model is evaluated at (ℓ2, pixel units).
        overshoot: train at ``overshoot``·eps (GloRo: 1.1).
        ramp: ``none`` (the final value throughout), ``linear`` or ``log`` (GloRo's logarithmic curve).
        ramp_start, ramp_end: fractions of training where the ramp starts and ends (before: the start value;
            after: the final value).
        start: the start value as a fraction of ``eps``, the evaluated radius (GloRo: 0.01; BCP: 0).
    """

    eps: float
    overshoot: float = 1.0
    ramp: Ramp = "none"
    ramp_start: float = 0.0
    ramp_end: float = 0.5
    start: float = 0.01

    def __post_init__(self) -> None:
        if self.eps < 0 or self.overshoot <= 0:
            raise ValueError(f"need eps >= 0 and overshoot > 0; got eps {self.eps}, overshoot {self.overshoot}")
        if self.ramp not in RAMPS:
            raise ValueError(f"ramp must be one of {list(RAMPS)}, got {self.ramp!r}")
        if not 0 <= self.ramp_start < self.ramp_end <= 1:
            raise ValueError(f"need 0 <= ramp_start < ramp_end <= 1 (fractions of training); got {self.ramp_start}, "
                             f"{self.ramp_end}")
        if not 0 <= self.start <= 1:
            raise ValueError(f"start is a fraction of eps in [0, 1], got {self.start}")
        if self.ramp == "log" and self.start == 0 and self.eps == 0:
            raise ValueError("a log ramp needs eps > 0")

    @property
    def final(self) -> float:
        """The radius trained at once the ramp is over: overshoot·eps."""
        return self.overshoot * self.eps

    def at(self, progress: float | None) -> float:
        """ε at ``progress`` ∈ [0, 1] of training (None: unknown, the final value)."""
        end = self.final
        if self.ramp == "none" or progress is None:
            return end
        t = min(1.0, max(0.0, (progress - self.ramp_start) / (self.ramp_end - self.ramp_start)))
        begin = min(self.start * self.eps, end)
        if self.ramp == "linear":
            return begin + (end - begin) * t
        return math.log((math.exp(end) - math.exp(begin)) * t + math.exp(begin))


def linear_weight(final: float, progress: float | None, rising: bool) -> float:
    """A weight that rises linearly from 0 to ``final`` over training (``rising``), or ``final`` throughout
    (GloRo's ``TradesScheduler('linear')`` for the TRADES λ)."""
    if not rising or progress is None:
        return final
    return final * min(1.0, max(0.0, progress))


__all__ = ["RAMPS", "EpsilonSchedule", "linear_weight"]
