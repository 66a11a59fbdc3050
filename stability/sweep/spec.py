"""A sweep's specification: the sweep file (or command line) expanded into runs, and the
``stability fit`` command line of each run."""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SPEC_KEYS = {"name", "description", "config", "args", "variants", "grid", "seeds"}
VARIANT_KEYS = ("grid", "seeds", "args", "config")  # a variant's keys that are not config overrides


@dataclass(frozen=True)
class Run:
    """One ``stability fit``: its overrides (in order), seed and directory name."""

    overrides: tuple[tuple[str, Any], ...]
    seed: int
    extra: tuple[tuple[str, Any], ...] = ()  # a variant's own ``args``: in the command, not in the name
    config: tuple[str, ...] | None = None  # a variant's own --config files, in place of the sweep's

    @property
    def name(self) -> str:
        own = [f"config={'+'.join(Path(c).stem for c in self.config)}"] if self.config is not None else []
        parts = own + [f"{k}={_short(v)}" for k, v in self.overrides] + [f"seed={self.seed}"]
        name = re.sub(r"[^A-Za-z0-9._=+,-]+", "_", ",".join(parts))
        if len(name) > 120:  # keep it readable and unique
            digest = hashlib.sha1(name.encode()).hexdigest()[:8]
            name = f"{name[:100]}..{digest}"
        return name

    @property
    def configuration(self) -> str:
        """The run's configuration without its seed (what a report groups by)."""
        own = [f"config={'+'.join(Path(c).stem for c in self.config)}"] if self.config is not None else []
        return ", ".join(own + [f"{k}={_short(v)}" for k, v in self.overrides]) or "(base)"


@dataclass
class Spec:
    name: str
    config: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    variants: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    grid: dict[str, list] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    description: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "sweep file") -> Spec:
        raw = {k: v for k, v in raw.items() if not str(k).startswith("x-")}  # YAML anchors' holders
        unknown = set(raw) - SPEC_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}; valid keys: {sorted(SPEC_KEYS)}")
        if not raw.get("name"):
            raise ValueError(f"{source}: give the sweep a name (name: ... or --name)")
        config = raw.get("config") or []
        spec = cls(name=str(raw["name"]), config=[config] if isinstance(config, str) else list(config),
                   args=dict(raw.get("args") or {}), variants=list(raw.get("variants") or [{}]),
                   grid=dict(raw.get("grid") or {}), seeds=[int(s) for s in raw.get("seeds", [0])],
                   description=str(raw.get("description", "")))
        for key, values in spec.grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"{source}: grid values of {key!r} must be a non-empty list; got {values!r}")
        for variant in spec.variants:
            if not isinstance(variant, dict):
                raise ValueError(f"{source}: each variant is a mapping of overrides; got {variant!r}")
        if not spec.seeds:
            raise ValueError(f"{source}: seeds must not be empty")
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "config": self.config, "args": self.args,
                "variants": self.variants, "grid": self.grid, "seeds": self.seeds}

    def runs(self) -> list[Run]:
        """Every variant × its own grid × the shared grid × seeds (the variant's own ``seeds`` where it
        has them), in that order, without duplicates. A variant's ``args`` reach its commands but not its
        name or label (e.g. evaluating some configurations on more points); its ``config`` (a list of files)
        replaces the sweep's ``--config`` files for its runs (another architecture beside the base one)."""
        runs, seen = [], set()
        for variant in self.variants:
            fixed = {k: v for k, v in variant.items() if k not in VARIANT_KEYS}
            own_grid = dict(variant.get("grid") or {})
            extra = tuple(dict(variant.get("args") or {}).items())
            config = variant.get("config")
            config = None if config is None else tuple([config] if isinstance(config, str) else config)
            for values in _product({**own_grid, **self.grid}):
                overrides = tuple({**fixed, **values}.items())
                for seed in variant.get("seeds", self.seeds):
                    run = Run(overrides, int(seed), extra, config)
                    if run.name not in seen:
                        seen.add(run.name)
                        runs.append(run)
        return runs

    def command(self, run: Run, run_dir: Path) -> list[str]:
        """The ``stability fit`` command line of ``run``."""
        cmd = [sys.executable, "-m", "stability", "fit"]
        for path in self.config if run.config is None else run.config:
            cmd += ["--config", str(path)]
        for key, value in {**self.args, **dict(run.extra), **dict(run.overrides)}.items():
            cmd.append(f"--{key}={_cli_value(value)}")
        return cmd + [f"--seed_everything={run.seed}", f"--run_dir={run_dir}",
                      "--trainer.enable_progress_bar=false"]


def _product(grid: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(_short(v) for v in value)
    if isinstance(value, dict):
        return "+".join(f"{k}-{_short(v)}" for k, v in value.items())
    return str(value)


def _cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def load_spec(path: str | None, cli: argparse.Namespace) -> Spec:
    """The sweep file (if any) with the command line's name, configs, grids and overrides added."""
    raw: dict[str, Any] = {}
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"sweep file {path!r} not found")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a sweep file is a mapping with keys {sorted(SPEC_KEYS)}")
    if cli.name:
        raw["name"] = cli.name
    if cli.config:
        raw["config"] = [*(raw.get("config") or []), *cli.config]
    for item in cli.set or []:
        key, value = _key_value(item, "--set")
        raw.setdefault("args", {})[key] = yaml.safe_load(value)
    for item in cli.grid or []:
        key, values = _key_value(item, "--grid")
        raw.setdefault("grid", {})[key] = [yaml.safe_load(v) for v in _split_top_level(values)]
    if cli.seeds:
        raw["seeds"] = [int(s) for s in cli.seeds.split(",")]
    return Spec.from_dict(raw, path or "command line")


def _key_value(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} takes KEY=VALUE; got {item!r}")
    return key.lstrip("-"), value


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and braces: ``a,[b,c]`` → ``a``, ``[b,c]``."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]
