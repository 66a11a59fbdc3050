"""The certified bound of a model: the smallest of those its stabilizers certify."""
from __future__ import annotations

from torch import nn

from ..lipschitz.certified import Bound, certified_bound


def certified_bound_of(stabilizers, network: nn.Module) -> tuple[Bound | None, str]:
    """(the smallest certified bound any selected stabilizer gives, "") or (None, why there is none)."""
    bounds = [b for s in stabilizers if (b := Bound.of(s.lipschitz_bound(network))) is not None]
    if bounds:
        return min(bounds, key=lambda b: b.value), ""
    _, reason = certified_bound(network)
    return None, reason or "no selected stabilizer certifies a bound"
