"""Stabilizers by name. ``--stabilizer NAME[,NAME…]`` picks them; each one's options are its
constructor arguments (``--NAME.option value`` on the command line, ``NAME:`` in YAML)."""
from __future__ import annotations

from typing import Any, Sequence

from .base import ForwardStep, Stabilizer
from .jasmin import JaSMin
from .lipsformer import LipsFormer
from .muon import MuonConstrained
from .none import NoStabilizer
from .specformer import Specformer
from .spectral_norm import SpectralNorm

REGISTRY: dict[str, type[Stabilizer]] = {cls.name: cls for cls in (NoStabilizer, LipsFormer, JaSMin, Specformer, SpectralNorm, MuonConstrained)}


def stabilizer_names(spec: str | Sequence[str]) -> list[str]:
    """Parse ``"a,b"``, ``"a+b"`` or ``["a", "b"]`` into a checked list of registered names.

    ``none`` on its own means the baseline; combined with others it is dropped.
    """
    names = [spec] if isinstance(spec, str) else list(spec)
    names = [part.strip() for name in names for part in name.replace("+", ",").split(",") if part.strip()]
    if not names:
        raise ValueError(f"no stabilizer given; choose from {sorted(REGISTRY)}")
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown stabilizer {', '.join(map(repr, unknown))}; valid names: {sorted(REGISTRY)}")
    if len(set(names)) != len(names):
        raise ValueError(f"stabilizer listed twice in {names}")
    return [n for n in names if n != "none"] or ["none"]


def build_stabilizers(spec: str | Sequence[str], options: dict[str, dict[str, Any]] | None = None) -> list[Stabilizer]:
    """Instantiate the named stabilizers with ``options[name]`` as keyword arguments.

    Options for a stabilizer that is not selected are an error, not silently dropped.
    """
    names = stabilizer_names(spec)
    options = dict(options or {})
    stray = sorted(set(options) - set(names))
    if stray:
        raise ValueError(f"options given for stabilizer(s) {stray} that are not selected (selected: {names})")
    stabilizers = []
    for name in names:
        try:
            stabilizers.append(REGISTRY[name](**options.get(name, {})))
        except TypeError as err:
            raise ValueError(f"bad options for stabilizer {name!r}: {err}") from err
    return stabilizers


__all__ = ["ForwardStep", "JaSMin", "LipsFormer", "MuonConstrained", "NoStabilizer", "Specformer", "SpectralNorm", "REGISTRY", "Stabilizer", "build_stabilizers", "stabilizer_names"]
