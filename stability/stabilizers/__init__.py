"""Stabilizers by name. ``--stabilizer NAME[,NAME…]`` picks them; each one's options are its
constructor arguments (``--NAME.option value`` on the command line, ``NAME:`` in YAML).

Every module of this package is imported here, so a stabilizer registers itself
(:func:`~stability.stabilizers.base.register_stabilizer`) by being defined in one.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any

from .base import REGISTRY, ForwardStep, Stabilizer, register_stabilizer

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


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
    for a in names:
        for b in names:
            if b in REGISTRY[a].conflicts:
                raise ValueError(f"stabilizers {a!r} and {b!r} cannot be combined: {REGISTRY[a].conflicts[b]}")
    stabilizers = []
    for name in names:
        try:
            stabilizers.append(REGISTRY[name](**options.get(name, {})))
        except TypeError as err:
            raise ValueError(f"bad options for stabilizer {name!r}: {err}") from err
    return stabilizers


def methods_table(link_prefix: str = "") -> str:
    """The Markdown table of every registered stabilizer, ``none`` first (README and
    docs/methods.md carry it; a test keeps them equal). Links are relative to ``link_prefix``."""
    rows = ["| name | what | source | file |", "| --- | --- | --- | --- |"]
    for name, cls in sorted(REGISTRY.items(), key=lambda item: (item[0] != "none", item[0])):
        path = f"stability/stabilizers/{cls.__module__.rpartition('.')[2]}.py"
        rows.append(f"| `{name}` | {cls.summary} | {cls.source or '—'} | [{path}]({link_prefix}{path}) |")
    return "\n".join(rows)


__all__ = ["REGISTRY", "ForwardStep", "Stabilizer", "build_stabilizers", "methods_table", "register_stabilizer",
           "stabilizer_names"]
