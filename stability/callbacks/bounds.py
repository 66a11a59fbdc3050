"""The certified bound of a model: the smallest of those its stabilizers certify."""
from __future__ import annotations

from torch import nn

from ..lipschitz.certified import Bound, certified_bound
from ..lipschitz.conv_bounds import is_lipconvnet
from .precision import float64_copy


def certified_bound_of(stabilizers, network: nn.Module) -> tuple[Bound | None, str]:
    """(the smallest certified bound the architecture or any selected stabilizer gives, "") or (None, why there is
    none). An architecture that is Lipschitz by construction (the convolutional anchor) certifies without a
    stabilizer."""
    bounds = [b for s in stabilizers if (b := Bound.of(s.lipschitz_bound(network))) is not None]
    if is_lipconvnet(network):
        own, _ = certified_bound(network)
        bounds.append(own)
    if bounds:
        return min(bounds, key=lambda b: b.value), ""
    _, reason = certified_bound(network)
    return None, reason or "no selected stabilizer certifies a bound"


def exact_certificate(stabilizers, network: nn.Module) -> tuple[Bound | None, str, nn.Module | None]:
    """(bound, "", a float64 copy of the network) where the model has a certified bound — the bound composed from the
    copy, whose logits a certificate then uses — else (None, why, None). Float64 at measurement time: rounding can
    then only make a certificate smaller (stability/robustness/certified.py)."""
    bound, reason = certified_bound_of(stabilizers, network)
    if bound is None:
        return None, reason, None
    exact = float64_copy(network)
    bound, reason = certified_bound_of(stabilizers, exact)
    return bound, reason, exact
