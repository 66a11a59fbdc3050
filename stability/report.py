"""``stability report RUNS_DIR``: one table and the plots comparing a set of runs.

Reads every run under RUNS_DIR (a directory with ``config.yaml`` and TensorBoard events: sweep
runs and plain ``runs/.../version_N`` alike), groups runs that differ only in their seed into one
configuration, and writes under ``results/<study>/`` (``--out``):

* ``report.md`` — one row per configuration: mean ± sample std over seeds of clean accuracy (and on
  the attack subset), every robust accuracy, local Lipschitz mean / max, the certified bound (log10, where finite), the last
  epoch's task loss and training time per epoch (training steps only), and the divergence rate.
  Test-time values (``--test_after_fit`` / ``stability test``) are used where a run has them, else
  the last values logged during fit. Diverged runs count in the divergence rate only;
* ``accuracy_vs_lipschitz.png``, ``robust_vs_budget.png``, ``loss_curves.png``,
  ``lipschitz_distribution.png``, and ``accuracy_vs_certified.png`` where runs have a certified bound.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

IGNORED_KEYS = ("seed_everything", "runs_dir", "run_dir", "ckpt_path", "trainer.logger",
                "trainer.enable_progress_bar", "trainer.callbacks")


@dataclass
class RunRecord:
    path: Path
    config: dict[str, Any]
    status: str                                   # completed | diverged
    scalars: dict[str, list[tuple[int, float]]]
    histograms: dict[str, list]                   # tag -> [(step, limits, counts)]
    configuration: str = ""
    sweep_order: Optional[int] = None

    @property
    def stabilizer(self) -> str:
        value = self.config.get("stabilizer", "none")
        return "+".join(value) if isinstance(value, list) else str(value)

    @property
    def seed(self) -> Any:
        return self.config.get("seed_everything")

    def last(self, *tags: str) -> Optional[float]:
        """The last value of the first tag the run has."""
        for tag in tags:
            if self.scalars.get(tag):
                return self.scalars[tag][-1][1]
        return None

    def robust(self) -> dict[str, float]:
        """``{attack label: accuracy}``: test-time values where present, else the last of fit."""
        for prefix in ("test_robust/", "robust/"):
            found = {tag[len(prefix):]: values[-1][1] for tag, values in self.scalars.items()
                     if tag.startswith(prefix) and tag != prefix + "clean" and values}
            if found:
                return found
        return {}

    @functools.cached_property
    def summary(self) -> dict[str, Optional[float]]:
        """The run's values for the table's columns (read once)."""
        times = [v for _, v in self.scalars.get("time/train_epoch_s", [])]
        row = {
            "clean acc": self.last("test/acc", "val/acc"),
            "clean (attack subset)": self.last("test_robust/clean", "robust/clean"),
            **{f"{k}": v for k, v in self.robust().items()},
            "Lip local mean": self.last("test_lipschitz/local_mean", "lipschitz/local_mean"),
            "Lip local max": self.last("test_lipschitz/local_max", "lipschitz/local_max"),
            "certified log10": self.last("test_lipschitz/certified_log10", "lipschitz/certified_log10"),
            "task loss": self.last("loss/task_epoch"),
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
    for events_file in sorted(run.glob("events.out.tfevents.*")):  # fit, then test: one file each
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0, "histograms": 0})
        events.Reload()
        tags = events.Tags()
        for tag in tags.get("scalars", []):
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
        for tag in tags.get("histograms", []):
            histograms.setdefault(tag, []).extend(
                (e.step, list(e.histogram_value.bucket_limit), list(e.histogram_value.bucket))
                for e in events.Histograms(tag))
    return scalars, histograms


def load_run(run: Path) -> Optional[RunRecord]:
    """The run's record, or None for a sweep run that did not finish."""
    sweep_run = run / "sweep_run.json"
    done = run / "done.json"
    if sweep_run.is_file() and not done.is_file():
        return None
    if done.is_file():
        status = json.loads(done.read_text())["status"]
    else:
        status = "diverged" if (run / "diverged.json").is_file() else "completed"
    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    scalars, histograms = read_events(run)
    record = RunRecord(run, config, status, scalars, histograms)
    if sweep_run.is_file():
        record.configuration = json.loads(sweep_run.read_text())["configuration"]
    return record


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


def label_configurations(records: list[RunRecord]) -> None:
    """Runs without a sweep's label get one from the config keys that differ between runs."""
    unlabelled = [r for r in records if not r.configuration]
    if not unlabelled:
        return
    flat = [flatten(r.config) for r in unlabelled]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if not k.startswith(IGNORED_KEYS) and len({repr(f.get(k)) for f in flat}) > 1]
    for record, values in zip(unlabelled, flat):
        parts = [f"{k.removeprefix('model.')}={values.get(k)}" for k in varying]
        record.configuration = ", ".join(parts) or record.stabilizer


def sweep_order(root: Path, records: list[RunRecord]) -> None:
    """Order configurations as the sweep file lists them, where there is one."""
    spec_file = root / "sweep.yaml"
    if not spec_file.is_file():
        return
    from .sweep import Spec

    order = {run.configuration: i for i, run in reversed(list(enumerate(
        Spec.from_dict(yaml.safe_load(spec_file.read_text()), str(spec_file)).runs())))}
    for record in records:
        record.sweep_order = order.get(record.configuration)


# ------------------------------------------------------------------------------ aggregating
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
        out = []
        for run in self.finished:
            value = run.summary.get(column)
            if value is not None and math.isfinite(value):
                out.append(value)
        return out


def group(records: list[RunRecord]) -> list[Configuration]:
    groups: dict[str, Configuration] = {}
    key = (lambda r: (r.sweep_order if r.sweep_order is not None else math.inf, str(r.path)))
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


def columns(configurations: list[Configuration]) -> list[str]:
    robust = []
    for config in configurations:
        for run in config.runs:
            robust += [k for k in run.robust() if k not in robust]
    robust.sort(key=_budget_key)
    fixed_end = ["Lip local mean", "Lip local max", "certified log10", "task loss", "s/epoch"]
    present = [c for c in fixed_end if any(config.values(c) for config in configurations)]
    subset = ["clean (attack subset)"] if robust else []
    return ["clean acc", *subset, *robust, *present]


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
    head = ["configuration", "seeds", "diverged", *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in configurations:
        cells = [config.label, str(len(config.runs)), f"{config.diverged}/{len(config.runs)}"]
        cells += [mean_std(config.values(c), 2 if c == "s/epoch" else 3) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- plotting
def _figure(width: float = 7.5, height: float = 4.8):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), constrained_layout=True)
    return plt, fig, ax


def _styles(configurations: list[Configuration]) -> dict[str, dict[str, Any]]:
    """Colour, marker, line style and a short legend name per configuration: one colour per
    stabilizer (one per configuration when a stabilizer has more than six), a marker / line style
    per configuration within it."""
    import matplotlib

    stabilizers = list(dict.fromkeys(c.stabilizer for c in configurations))
    counts = {name: sum(c.stabilizer == name for c in configurations) for name in stabilizers}
    per_configuration = max(counts.values()) > 6
    palette = matplotlib.colormaps["tab20" if per_configuration else "tab10"].colors
    markers, dashes = "osD^v<>pP*X", ["-", "--", ":", "-."]
    names = short_names(configurations)
    styles, seen = {}, {}
    for index, config in enumerate(configurations):
        n = seen.get(config.stabilizer, 0)
        seen[config.stabilizer] = n + 1
        colour = palette[(index if per_configuration else stabilizers.index(config.stabilizer)) % len(palette)]
        styles[config.label] = {"color": colour, "marker": markers[n % len(markers)],
                                "linestyle": dashes[n % len(dashes)], "name": names[config.label]}
    return styles


def short_names(configurations: list[Configuration]) -> dict[str, str]:
    """Legend names: ``stabilizer=X`` becomes ``X:``, a stabilizer's own options lose its prefix, and
    settings shared by every configuration of that stabilizer are left out."""
    parts = {c.label: c.label.split(", ") for c in configurations}
    names = {}
    for config in configurations:
        family = [parts[c.label] for c in configurations if c.stabilizer == config.stabilizer]
        shared = set.intersection(*(set(f) for f in family)) if len(family) > 1 else set()
        kept = [part.removeprefix(f"{config.stabilizer}.") for part in parts[config.label]
                if part not in shared and not part.startswith("stabilizer=")]
        names[config.label] = f"{config.stabilizer}: {', '.join(kept)}" if kept else config.stabilizer
    return names


def _legend(ax, count: int) -> None:
    if count > 6:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(fontsize=8)


def _finish(plt, fig, ax, drawn: int, path: Path, title: str) -> bool:
    """Title, grid, legend, save; False (and nothing written) when no configuration was drawn."""
    if drawn:
        fig.suptitle(title)
        ax.grid(alpha=0.3, which="both")
        _legend(ax, drawn)
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return bool(drawn)


def plot_accuracy_vs_lipschitz(configurations, styles, path: Path, title: str, certified: bool = False) -> bool:
    """Clean accuracy against the local estimate (or, with ``certified``, the certified bound:
    the frontier of Lipschitz-enforced training), one point per configuration."""
    column = "certified log10" if certified else "Lip local mean"
    plt, fig, ax = _figure(9, 5)
    drawn = 0
    for config in configurations:
        lip, acc = config.values(column), config.values("clean acc")
        if not lip or not acc:
            continue
        if certified:
            lip = [10 ** v for v in lip]
        style = styles[config.label]
        ax.errorbar(statistics.fmean(lip), statistics.fmean(acc),
                    xerr=statistics.stdev(lip) if len(lip) > 1 and not certified else None,
                    yerr=statistics.stdev(acc) if len(acc) > 1 else None,
                    color=style["color"], marker=style["marker"], linestyle="none", capsize=3,
                    markersize=7, label=style["name"])
        drawn += 1
    ax.set_xscale("log")
    ax.set_xlabel("certified global Lipschitz bound, mean over seeds (log scale)" if certified
                  else "local Lipschitz estimate ‖J_f(x)‖₂, mean over points (log scale)")
    ax.set_ylabel("clean accuracy")
    what = "certified bound" if certified else "Lipschitz"
    return _finish(plt, fig, ax, drawn, path, f"{title}: accuracy vs {what} (mean ± std over seeds)")


def plot_robust_vs_budget(configurations, styles, path: Path, title: str) -> bool:
    attacks = sorted({parse_label(k)[:2] for c in configurations for r in c.runs for k in r.robust()})
    if not attacks:
        return False
    plt, fig, _ = _figure(max(4.2 * len(attacks), 9.0), 4.6 + 0.22 * math.ceil(len(configurations) / 2))
    fig.clear()
    axes = fig.subplots(1, len(attacks), squeeze=False)[0]
    for ax, (attack, norm) in zip(axes, attacks):
        for config in configurations:
            labels = sorted({k for r in config.runs for k in r.robust() if parse_label(k)[:2] == (attack, norm)},
                            key=lambda k: parse_label(k)[2])
            clean = config.values("clean (attack subset)")  # the points the attacks ran on
            if not labels or not clean:
                continue
            budgets = [0.0] + [parse_label(k)[2] for k in labels]
            means = [statistics.fmean(clean)] + [statistics.fmean(config.values(k)) if config.values(k)
                                                 else math.nan for k in labels]
            style = styles[config.label]
            scale = 255 if norm == "Linf" else 1
            ax.plot([b * scale for b in budgets], means, color=style["color"], marker=style["marker"],
                    linestyle=style["linestyle"], label=style["name"])
        ax.set_xlabel("ε (×1/255)" if norm == "Linf" else "ε (ℓ2, pixel units)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{attack.upper()} {norm}")
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    fig.suptitle(f"{title}: robust accuracy vs budget on the attack subset (ε = 0: clean; mean over seeds)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_loss_curves(configurations, styles, path: Path, title: str) -> bool:
    plt, fig, ax = _figure(9, 5)
    drawn = 0
    for config in configurations:
        curves = [r.scalars.get("loss/task_step") or r.scalars.get("train/loss_step") for r in config.runs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        style = styles[config.label]
        for i, curve in enumerate(curves):  # every seed, one label per configuration
            steps, values = zip(*curve)
            values = [v if math.isfinite(v) else math.nan for v in values]
            ax.plot(steps, values, color=style["color"], linestyle=style["linestyle"], alpha=0.8, linewidth=1.2,
                    label=style["name"] if i == 0 else None)
        for run in config.runs:
            if run.status == "diverged" and run.scalars.get("hp/diverged_at_step"):
                ax.axvline(run.scalars["hp/diverged_at_step"][-1][1], color=style["color"], linestyle=":",
                           alpha=0.7)
        drawn += 1
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("task loss (cross-entropy, log scale)")
    return _finish(plt, fig, ax, drawn, path, f"{title}: training loss (every seed; dotted: divergence)")


def weighted_quantiles(limits: list[float], counts: list[float], qs: list[float]) -> list[float]:
    """Quantiles of a TensorBoard histogram (bucket upper limits and counts), each bucket at the
    geometric middle of its limits."""
    lower = [limits[0] if i == 0 else limits[i - 1] for i in range(len(limits))]
    middle = [math.sqrt(a * b) if a > 0 and b > 0 and math.isfinite(a * b) else b for a, b in zip(lower, limits)]
    pairs = [(m, c) for m, c in zip(middle, counts) if c > 0 and math.isfinite(m)]
    total = sum(c for _, c in pairs)
    out = []
    for q in qs:
        running = 0.0
        for value, count in pairs:
            running += count
            if running >= q * total:
                out.append(value)
                break
        else:
            out.append(pairs[-1][0])
    return out


def plot_lipschitz_distribution(configurations, path: Path, title: str) -> bool:
    stats, colors = [], []
    styles = _styles(configurations)
    for config in configurations:
        limits, counts = [], []
        for run in config.finished:
            entries = run.histograms.get("test_lipschitz/local") or run.histograms.get("lipschitz/local")
            if entries:
                _, run_limits, run_counts = entries[-1]
                limits.append(run_limits)
                counts.append(run_counts)
        if not limits:
            continue
        merged: dict[float, float] = {}
        for run_limits, run_counts in zip(limits, counts):
            for limit, count in zip(run_limits, run_counts):
                merged[limit] = merged.get(limit, 0.0) + count
        keys = sorted(merged)
        q05, q25, q50, q75, q95 = weighted_quantiles(keys, [merged[k] for k in keys], [.05, .25, .5, .75, .95])
        stats.append({"label": styles[config.label]["name"], "whislo": q05, "q1": q25, "med": q50, "q3": q75, "whishi": q95,
                      "fliers": []})
        colors.append(styles[config.label]["color"])
    if not stats:
        return False
    plt, fig, ax = _figure(max(6.0, 0.55 * len(stats) + 3), 5.2)
    boxes = ax.bxp(stats, patch_artist=True, showfliers=False)
    for patch, color in zip(boxes["boxes"], colors):
        patch.set_facecolor(color)
        patch.set_alpha(0.55)
    ax.set_yscale("log")
    ax.set_ylabel("‖J_f(x)‖₂ per point (log scale)")
    fig.suptitle(f"{title}: local Lipschitz distribution\n(box: quartiles, whiskers: 5–95%; all seeds pooled)")
    ax.tick_params(axis="x", labelrotation=35, labelsize=7)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    ax.grid(alpha=0.3, axis="y", which="both")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- writing
def write_report(runs_dir: Path, out: Path, study: str, command: str) -> Path:
    records = [r for r in (load_run(p) for p in find_runs(runs_dir)) if r is not None]
    if not records:
        raise ValueError(f"no finished runs under {runs_dir} (a run is a directory with config.yaml and "
                         f"TensorBoard events; sweep runs count once done.json is written)")
    label_configurations(records)
    sweep_order(runs_dir, records)
    configurations = group(records)
    styles = _styles(configurations)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "accuracy_vs_lipschitz.png": plot_accuracy_vs_lipschitz(configurations, styles,
                                                                out / "accuracy_vs_lipschitz.png", study),
        "accuracy_vs_certified.png": plot_accuracy_vs_lipschitz(configurations, styles,
                                                                out / "accuracy_vs_certified.png", study, True),
        "robust_vs_budget.png": plot_robust_vs_budget(configurations, styles, out / "robust_vs_budget.png", study),
        "loss_curves.png": plot_loss_curves(configurations, styles, out / "loss_curves.png", study),
        "lipschitz_distribution.png": plot_lipschitz_distribution(configurations, out / "lipschitz_distribution.png",
                                                                  study),
    }
    test_time = any("test/acc" in r.scalars for r in records)
    lines = [f"# {study}", "", f"Made by `{command}` from {len(records)} runs in `{runs_dir}`.", "",
             "Mean ± sample std over seeds; " + ("test-set values (after fit)" if test_time else
                                                 "last values logged during fit (validation subset)")
             + "; diverged runs count only in `diverged`. Robust columns: attack_norm_ε on the evaluation subset; "
               "`Lip local`: power-iteration estimate of ‖J_f(x)‖₂ per point; `certified log10`: log10 of a "
               "certified global bound where the model has one; `task loss`: last epoch's training "
               "cross-entropy; `s/epoch`: training steps only. The Lipschitz distributions are drawn from "
               "TensorBoard's histograms, so their quantiles have the resolution of its buckets.", "",
             table(configurations), ""]
    for name, drawn in plots.items():
        if drawn:
            lines += [f"![{name[:-4]}]({name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="stability report", description=__doc__.split("\n")[0])
    p.add_argument("runs_dir", help="a sweep directory or any directory of runs")
    p.add_argument("--study", help="study name (default: the directory's name)")
    p.add_argument("--out", help="output directory (default results/<study>)")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir)
    if not runs_dir.is_dir():
        print(f"stability report: error: {runs_dir} is not a directory", file=sys.stderr)
        return 2
    study = args.study or runs_dir.resolve().name
    out = Path(args.out) if args.out else Path("results") / study
    command = "stability report " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:]))
    try:
        report = write_report(runs_dir, out, study, command)
    except ValueError as err:
        print(f"stability report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    return 0
