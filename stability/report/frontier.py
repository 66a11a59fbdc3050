"""The accuracy–bound frontier (Newhouse et al. 2025, Figures 1 and 3): the configurations that no other
configuration beats with a smaller Lipschitz bound.

A configuration (bound B, accuracy A) is on the frontier when every configuration with B' ≤ B has A' < A
(ties in B: only the most accurate). Means over seeds are compared; the report prints their ± beside them,
so a frontier point within another's error bar reads as a tie.
"""
from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Labels of the points (label, bound, accuracy) on the frontier, by increasing bound."""
    front, best = [], float("-inf")
    for label, _, accuracy in sorted(points, key=lambda p: (p[1], -p[2])):
        if accuracy > best:
            front.append(label)
            best = accuracy
    return front
