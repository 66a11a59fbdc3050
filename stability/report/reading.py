"""Reading runs: every run directory under a root (``config.yaml`` beside TensorBoard events),
its status, its scalars and histograms, and its ``results.json`` (written at test) where present —
the test-time numbers are taken from it first."""
from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .. import tags
from ..callbacks.measuring import RESULTS_FILE

NOT_ATTACKS = ("clean", "attack_clean", "autoattack_clean")  # accuracies logged beside the attacks that are no attack


@dataclass
class RunRecord:
    path: Path
    config: dict[str, Any]
    status: str                                   # completed | diverged | unfinished (wallclock.py)
    scalars: dict[str, list[tuple[int, float]]]
    histograms: dict[str, list]                   # tag -> [(step, limits, counts)]
    configuration: str = ""
    sweep_order: int | None = None
    results: dict[str, Any] | None = None         # results.json of its test, if any

    @property
    def stabilizer(self) -> str:
        value = self.config.get("stabilizer", "none")
        return "+".join(value) if isinstance(value, list) else str(value)

    @property
    def seed(self) -> Any:
        return self.config.get("seed_everything")

    def last(self, *tags: str) -> float | None:
        """The last value of the first tag the run has."""
        for tag in tags:
            if self.scalars.get(tag):
                return self.scalars[tag][-1][1]
        return None

    def measured(self, group: str, stat: str) -> float | None:
        """A measurement's test-time value where the run has one, else its last value during fit."""
        return self.last(*(tags.measurement(group, stat, stage) for stage in self._stages))

    @property
    def _stages(self) -> tuple[str, ...]:
        """Where a measurement's value may come from: the test, else the last of fit — but never fit for an unfinished
        run whose test has begun (its other values are the test's: a stopped test's gap stays a gap)."""
        return ("test",) if self.status == "unfinished" and self.results else ("test", "fit")

    def _group(self, group: str) -> dict[str, float]:
        """``{stat: value}`` of a measurement group: test-time values where present, else the last of fit."""
        for stage in self._stages:
            prefix = tags.group(group, stage) + "/"
            found = {tag[len(prefix):]: values[-1][1] for tag, values in self.scalars.items()
                     if tag.startswith(prefix) and values}
            if found:
                return found
        return {}

    def robust(self) -> dict[str, float]:
        """``{attack label: accuracy}`` (with ``worst_<budget>``), without the clean accuracies."""
        values = self.results["robustness"]["accuracy"] if self._tested("robustness") else self._group(tags.ROBUST)
        return {k: v for k, v in values.items() if k not in NOT_ATTACKS}

    def attacks_at(self, budget: str) -> tuple[tuple[str, int], ...] | None:
        """The attacks its test ran at a budget (``L2_1.58``) with their points: what its ``worst_<budget>`` is the
        worst case over. None where the value is not from a test's results.json."""
        if not self._tested("robustness"):
            return None
        attacks = self.results["robustness"].get("attacks", {})
        return tuple(sorted((spec["attack"], int(spec["points"])) for label, spec in attacks.items()
                            if "_".join(label.rsplit("_", 2)[1:]) == budget))

    def certified(self) -> dict[str, float]:
        """``{budget: certified accuracy}``, e.g. ``L2_0.5``."""
        if self._tested("robustness"):
            return dict(self.results["robustness"]["certified"])
        return {k.removeprefix("acc_"): v for k, v in self._group(tags.CERTIFIED).items() if k.startswith("acc_")}

    def _tested(self, part: str) -> bool:
        """The run's results.json has this part's values (a test stopped before they were measured has only its
        points and the reason)."""
        values = (self.results or {}).get(part)
        return bool(values) and (part != "robustness" or "accuracy" in values)

    @property
    def local_method(self) -> str | None:
        """How the tested local Lipschitz values were computed: ``exact`` or ``power`` (results.json's
        ``local_method``; absent before 2026-11-29, when it was always power iteration), None without them."""
        if not self._tested("lipschitz") or "local_mean" not in self.results["lipschitz"]:
            return None
        return self.results["lipschitz"].get("local_method", "power")

    def lipschitz(self, stat: str) -> float | None:
        if self._tested("lipschitz") and stat in self.results["lipschitz"]:
            return self.results["lipschitz"][stat]
        return self.measured(tags.LIPSCHITZ, stat)

    def attention_mean(self, stat: str) -> float | None:
        """The mean over attention layers of a per-layer diagnostic's last value (``attention/<layer>/<stat>``)."""
        if self._stages == ("test",):  # these tags carry no stage: an unfinished test's gap stays a gap
            return None
        prefix, suffix = f"{tags.ATTENTION}/", f"/{stat}"
        values = [series[-1][1] for tag, series in self.scalars.items()
                  if tag.startswith(prefix) and tag.endswith(suffix) and series]
        return statistics.fmean(values) if values else None

    @functools.cached_property
    def summary(self) -> dict[str, float | None]:
        """The run's values for the table's columns (read once)."""
        times = [v for _, v in self.scalars.get(tags.TIME_TRAIN_EPOCH, [])]
        clean = self.results.get("clean_accuracy") if self.results else None
        attacked = self.results["robustness"]["accuracy"] if self._tested("robustness") else self._group(tags.ROBUST)
        row = {
            "clean acc": clean if clean is not None else self.last(tags.stage_metric("test", "acc"),
                                                                  tags.stage_metric("val", "acc")),
            "clean (attack subset)": attacked.get("attack_clean", attacked.get("clean")),
            "clean (AutoAttack subset)": attacked.get("autoattack_clean"),
            **self.robust(),
            **{f"cert {k}": v for k, v in self.certified().items()},
            "Lip local mean": self.lipschitz("local_mean"),
            "Lip local max": self.lipschitz("local_max"),
            "Lip no-embed mean": self.lipschitz("local_noembed_mean"),
            "g1 mean": self.attention_mean("g1_mean"),
            "certified log10": self.lipschitz("certified_log10"),
            "tightness": self.lipschitz("certified_tightness"),
            "paper bound log10": self.lipschitz("paper_bound_log10"),
            "task loss": self.last(tags.per_epoch(tags.TASK_LOSS)),
            "s/epoch": statistics.fmean(times) if times else None,
        }
        return row


# ---------------------------------------------------------------------------------- reading
def find_runs(root: Path) -> list[Path]:
    """Run directories under ``root``: a ``config.yaml`` beside TensorBoard events."""
    found = []
    for config in sorted(root.rglob("config.yaml")):
        run = config.parent
        if ".interrupted" in run.relative_to(root).parts:
            continue
        if any(run.glob("events.out.tfevents.*")):
            found.append(run)
    return found


def read_events(run: Path) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    histograms: dict[str, list] = {}
    loaded = []
    for events_file in run.glob("events.out.tfevents.*"):  # fit, then test; a resumed fit adds one more
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0, "histograms": 0})
        events.Reload()
        loaded.append((_first_wall_time(events), events_file.name, events))
    for _, _, events in sorted(loaded, key=lambda entry: entry[:2]):  # oldest first: by when each began, not its name
        tags = events.Tags()
        for tag in tags.get("scalars", []):
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
        for tag in tags.get("histograms", []):
            histograms.setdefault(tag, []).extend(
                (e.step, list(e.histogram_value.bucket_limit), list(e.histogram_value.bucket))
                for e in events.Histograms(tag))
    return {tag: _newest_per_step(values) for tag, values in scalars.items()}, histograms


def _first_wall_time(events) -> float:
    try:
        return events.FirstEventTimestamp()
    except ValueError:  # an empty file
        return float("inf")


def _newest_per_step(values: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """One value per step, the newest file's: a run resumed from a checkpoint writes a new events file that repeats
    the steps logged after that checkpoint."""
    return sorted(dict(values).items())


def read_results(run: Path) -> dict[str, Any] | None:
    """The newest ``results.json`` of a run: beside its checkpoints or in the run directory."""
    found = [p for p in (run / "checkpoints" / RESULTS_FILE, run / RESULTS_FILE) if p.is_file()]
    return json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text()) if found else None


def load_run(run: Path, unfinished: bool = False) -> RunRecord | None:
    """The run's record, or None for a sweep run that did not finish (``unfinished``: its record so far, with status
    ``"unfinished"``)."""
    sweep_run = run / "sweep_run.json"
    done = run / "done.json"
    if sweep_run.is_file() and not done.is_file():
        if not unfinished:
            return None
        status = "unfinished"
    elif done.is_file():
        status = json.loads(done.read_text())["status"]
    else:
        status = "diverged" if (run / "diverged.json").is_file() else "completed"
    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    scalars, histograms = read_events(run)
    record = RunRecord(run, config, status, scalars, histograms, results=read_results(run))
    if sweep_run.is_file():
        record.configuration = json.loads(sweep_run.read_text())["configuration"]
    return record
