"""Grouping runs into configurations (runs that differ only in their seed), labelling them, and the
report's table: mean ± sample std over seeds per column."""
from __future__ import annotations

import inspect
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..stabilizers import REGISTRY
from ..sweep.spec import Spec
from .reading import RunRecord

IGNORED_KEYS = ("seed_everything", "runs_dir", "run_dir", "ckpt_path", "trainer.logger",
                "trainer.enable_progress_bar", "trainer.callbacks")
STABILIZER_GROUPS = frozenset(REGISTRY)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        if set(config) <= {"class_path", "init_args"} and "class_path" in config:
            out = {prefix.rstrip("."): config["class_path"].rpartition(".")[2]}
            out.update(flatten(config.get("init_args") or {}, prefix))
            return out
        out = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(config) if isinstance(config, list) else config}


def own_settings(record: RunRecord) -> dict[str, Any]:
    """The run's flattened config without the option groups of stabilizers it did not select
    (the CLI writes every group, with defaults, into config.yaml)."""
    selected = set(record.stabilizer.split("+"))
    return {k: v for k, v in flatten(record.config).items()
            if k.partition(".")[0] not in STABILIZER_GROUPS or k.partition(".")[0] in selected}


def label_configurations(records: list[RunRecord]) -> None:
    """Runs without a sweep's label get one from the config keys that differ between runs."""
    unlabelled = [r for r in records if not r.configuration]
    if not unlabelled:
        return
    flat = [own_settings(r) for r in unlabelled]
    keys = sorted({k for f in flat for k in f})
    def varies(key: str) -> bool:
        """A stabilizer's option labels the runs that selected the stabilizer, when it differs between
        them or from its default; any other key, when it differs between runs."""
        name, _, option = key.partition(".")
        if name not in STABILIZER_GROUPS:
            return len({repr(f.get(key)) for f in flat}) > 1
        values = {repr(f[key]) for f in flat if key in f}
        default = inspect.signature(REGISTRY[name]).parameters.get(option)
        return len(values) > 1 or (default is not None and values != {repr(default.default)})

    varying = [k for k in keys if not k.startswith(IGNORED_KEYS) and varies(k)]
    for record, values in zip(unlabelled, flat):
        parts = [f"{k.removeprefix('model.')}={values[k]}" for k in varying if k in values]
        record.configuration = ", ".join(parts) or record.stabilizer


def sweep_order(root: Path, records: list[RunRecord]) -> None:
    """Order configurations as the sweep file lists them, where there is one."""
    spec_file = root / "sweep.yaml"
    if not spec_file.is_file():
        return


    order = {run.configuration: i for i, run in reversed(list(enumerate(
        Spec.from_dict(yaml.safe_load(spec_file.read_text()), str(spec_file)).runs())))}
    for record in records:
        record.sweep_order = order.get(record.configuration)


@dataclass
class Configuration:
    label: str
    stabilizer: str
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def finished(self) -> list[RunRecord]:
        return [r for r in self.runs if r.status != "diverged"]

    @property
    def diverged(self) -> int:
        return sum(r.status == "diverged" for r in self.runs)

    def values(self, column: str) -> list[float]:
        """The column's finite values over the finished runs. A worst case (``worst_<budget>``) is averaged only over
        the runs that ran the most attacks at that budget (then on the most points): a worst case over PGD alone is
        not one over PGD and AutoAttack."""
        runs = [r for r in self.finished if r.summary.get(column) is not None and math.isfinite(r.summary[column])]
        if column.startswith("worst_") and runs:
            bases = {id(r): r.attacks_at(column[len("worst_"):]) or () for r in runs}
            strongest = max(bases.values(), key=lambda basis: (len(basis), sum(points for _, points in basis)))
            runs = [r for r in runs if bases[id(r)] == strongest]
        return [r.summary[column] for r in runs]


def group(records: list[RunRecord]) -> list[Configuration]:
    groups: dict[str, Configuration] = {}
    def key(r):
        return ((r.sweep_order if r.sweep_order is not None else math.inf, str(r.path)))
    for record in sorted(records, key=key):
        groups.setdefault(record.configuration, Configuration(record.configuration, record.stabilizer))
        groups[record.configuration].runs.append(record)
    return list(groups.values())


def mean_std(values: list[float], digits: int = 3) -> str:
    if not values:
        return "—"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {statistics.stdev(values):.2g}"


def covered(config: Configuration, column: str) -> str:
    """The column's mean ± std, with how many of the configuration's runs it is over where that is not all of them."""
    values = config.values(column)
    cell = mean_std(values, 2 if column == "s/epoch" else 3)
    return f"{cell} ({len(values)}/{len(config.finished)})" if 0 < len(values) < len(config.finished) else cell


def columns(configurations: list[Configuration]) -> list[str]:
    """The table's columns: clean accuracy (on the whole split, then on the attacked points), robust
    accuracies by norm, attack and ε (worst case included), certified accuracies, Lipschitz, cost."""
    robust, certified = [], []
    for config in configurations:
        for run in config.runs:
            robust += [k for k in run.robust() if k not in robust]
            certified += [f"cert {k}" for k in run.certified() if f"cert {k}" not in certified]
    robust.sort(key=_budget_key)
    certified.sort(key=lambda c: _budget_key(f"cert_{c[len('cert '):]}"))
    fixed_end = ["Lip local mean", "Lip local max", "Lip no-embed mean", "g1 mean", "certified log10", "tightness",
                 "paper bound log10", "task loss", "s/epoch"]
    present = [c for c in fixed_end if any(config.values(c) for config in configurations)]
    subsets = [c for c in ("clean (attack subset)", "clean (AutoAttack subset)")
               if robust and any(config.values(c) for config in configurations)]
    return ["clean acc", *subsets, *robust, *certified, *present]


def _budget_key(label: str) -> tuple:
    attack, norm, eps = parse_label(label)
    return (norm, attack, eps)


def parse_label(label: str) -> tuple[str, str, float]:
    """``pgd_Linf_8/255`` → (``pgd``, ``Linf``, 8/255)."""
    attack, norm, eps = label.rsplit("_", 2)
    numerator, _, denominator = eps.partition("/")
    return attack, norm, float(numerator) / (float(denominator) if denominator else 1.0)


def table(configurations: list[Configuration]) -> str:
    cols = columns(configurations)
    unfinished = any(r.status == "unfinished" for config in configurations for r in config.runs)
    head = ["configuration", "seeds", "diverged", *(["unfinished"] if unfinished else []), *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in configurations:
        cells = [config.label, str(len(config.runs)), f"{config.diverged}/{len(config.runs)}"]
        if unfinished:
            cells.append(f"{sum(r.status == 'unfinished' for r in config.runs)}/{len(config.runs)}")
        cells += [covered(config, c) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
