"""Runs compared at equal cost (Prach et al., CVPR 2024, compare 1-Lipschitz layers at equal training time): for each
budget, every metric a run logged at validation, taken at the last epoch whose cumulative training cost fits in it.

Costs (``--cost``):

* ``wall``: the training steps' wall-clock time (``time/train_epoch_s``, summed; ``--timing.enabled true``), in
  minutes — what this machine took, with whatever else was running on it;
* ``flops``: the matrix FLOPs of the training steps (``cost/train_tflops``, logged by default), in TFLOP — the same
  on every machine; elementwise work is not counted;
* ``gpu``: the training steps' time predicted on the reference GPU by the CPU model of a GPU step
  (``cost/gpu_train_s``), in seconds.

Each cell is the metric's value at the last epoch within the budget at which the run logged it, with that epoch's
number: a metric measured every N epochs lines up by its step, and one a run never logged within the budget is an
empty cell, never a missing row. A resumed run's epochs count once (the events are read one value per step).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import tags
from .reading import RunRecord


@dataclass(frozen=True)
class Cost:
    name: str
    tag: str
    unit: str
    cumulative: bool  # the tag holds the total so far (else per epoch, summed here)
    scale: float = 1.0  # tag value → unit
    how: str = ""


COSTS = {
    "wall": Cost("wall-clock time of the training steps", tags.TIME_TRAIN_EPOCH, "min", False, 1 / 60,
                 "--timing.enabled true"),
    "flops": Cost("matrix FLOPs of the training steps", tags.COST_TRAIN_TFLOPS, "TFLOP", True, 1.0,
                  "--cost.enabled true (the default)"),
    "gpu": Cost("training steps' time predicted on the reference GPU", tags.COST_GPU_TRAIN_S, "GPU s", True, 1.0,
                "--cost.enabled true with a --cost.gpu_model"),
}
METRIC_GROUPS = (tags.stage_metric("val", "acc"), f"{tags.ROBUST}/", f"{tags.CERTIFIED}/")
LIPSCHITZ_METRICS = tuple(f"{tags.LIPSCHITZ}/{stat}" for stat in ("local_mean", "local_max", "certified_log10"))
DEFAULT_FRACTIONS = (0.125, 0.25, 0.5, 1.0)


class CostNotLogged(ValueError):
    """No run logged the cost asked for."""


def epoch_costs(run: RunRecord, cost: str) -> list[tuple[int, float]]:
    """(the last step of each epoch, the run's cumulative cost at its end, in the cost's unit)."""
    spec = COSTS[cost]
    series = run.scalars.get(spec.tag, [])
    if spec.cumulative:
        return [(step, value * spec.scale) for step, value in series]
    total, out = 0.0, []
    for step, value in series:
        total += value
        out.append((step, total * spec.scale))
    return out


def by_epoch(series: list[tuple[int, float]], ends: list[int]) -> list[float | None]:
    """The value logged in each epoch's window [end_k, end_{k+1}) of global steps (validation logs at its epoch's
    last step; None where an epoch has none): joined by step, not by position."""
    values: list[float | None] = [None] * len(ends)
    for step, value in series:
        epoch = bisect.bisect_right(ends, step) - 1
        if epoch >= 0:
            values[epoch] = value
    return values


def metrics_of(runs: Iterable[RunRecord]) -> list[str]:
    """The validation metrics any of the runs logged: accuracy, each robust and certified accuracy, and the Lipschitz
    estimates (local mean and max, the certified bound), in a fixed order."""
    found = {tag for run in runs for tag in run.scalars if tag.startswith(METRIC_GROUPS) or tag in LIPSCHITZ_METRICS}
    order = [tags.stage_metric("val", "acc")]
    order += sorted(t for t in found if t.startswith(f"{tags.ROBUST}/"))
    order += sorted((t for t in found if t.startswith(f"{tags.CERTIFIED}/")), key=_radius_order)
    order += [t for t in LIPSCHITZ_METRICS if t in found]
    return [t for t in order if t in found]


def _radius_order(tag: str) -> tuple:
    tail = tag.rsplit("_", 1)[-1]
    try:
        return (tag.rsplit("_", 1)[0], float(tail))
    except ValueError:
        return (tag, 0.0)


def at_budget(run: RunRecord, cost: str, budget: float, metrics: list[str],
              together: bool = False) -> dict[str, tuple[float, int] | None]:
    """{metric: (value, epochs) of the last epoch within ``budget`` at which the run logged it, or None}. With
    ``together``, one epoch for all: the last at which every metric was logged."""
    costs = epoch_costs(run, cost)
    ends = [step for step, _ in costs]
    within = [i for i, (_, spent) in enumerate(costs) if spent <= budget * (1 + 1e-12)]
    values = {m: by_epoch(run.scalars.get(m, []), ends) for m in metrics}
    out: dict[str, tuple[float, int] | None] = dict.fromkeys(metrics)
    if together:
        for epoch in reversed(within):
            if all(values[m][epoch] is not None for m in metrics):
                return {m: (values[m][epoch], epoch + 1) for m in metrics}
        return out
    for m in metrics:
        for epoch in reversed(within):
            if values[m][epoch] is not None:
                out[m] = (values[m][epoch], epoch + 1)
                break
    return out


def logged(runs: list[RunRecord], cost: str) -> list[RunRecord]:
    return [run for run in runs if epoch_costs(run, cost)]


def default_budgets(runs: list[RunRecord], cost: str) -> list[float]:
    """Fractions 1/8, 1/4, 1/2, 1 of the longest run's cost, to three significant digits."""
    longest = max(epoch_costs(run, cost)[-1][1] for run in logged(runs, cost))
    return [float(f"{fraction * longest:.3g}") for fraction in DEFAULT_FRACTIONS]


def parse_budgets(text: str) -> list[float]:
    """Budgets from ``a,b,c``: positive numbers, or a ValueError that names the bad value."""
    budgets = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--budgets {text!r}: {part.strip()!r} is not a number (give numbers in the cost's unit, "
                             f"comma-separated, e.g. 5,10,30)") from None
        if not value > 0 or math.isinf(value):
            raise ValueError(f"--budgets {text!r}: {part.strip()!r} is not a positive finite number")
        budgets.append(value)
    return budgets


def check_logged(runs: list[RunRecord], cost: str, where: Path | str) -> None:
    if cost not in COSTS:
        raise ValueError(f"--cost {cost!r}: choose one of {sorted(COSTS)}")
    if not logged(runs, cost):
        spec = COSTS[cost]
        raise CostNotLogged(f"--cost {cost}: no run under {where} logged {spec.tag} (runs log it with {spec.how}); "
                            f"costs they logged: {[c for c in COSTS if logged(runs, c)] or 'none'}")


def short(tag: str) -> str:
    return tag.removeprefix("val/").replace("certified/acc_", "cert ").replace("lipschitz/", "Lip ") \
        .replace("robust/", "")


def tables(runs: list[RunRecord], names: dict[str, str], cost: str, budgets: list[float]) -> str:
    """One Markdown table per budget: a row per run, a column per metric, each cell ``value (epochs)``."""
    spec = COSTS[cost]
    metrics = metrics_of(runs)
    out = []
    for budget in budgets:
        lines = [f"**{budget:g} {spec.unit}**", "", "| run | " + " | ".join(short(m) for m in metrics) + " |",
                 "|---|" + "---|" * len(metrics)]
        for run in runs:
            cells = at_budget(run, cost, budget, metrics)
            text = ["—" if cell is None else f"{cell[0]:.3f} ({cell[1]} ep)" for cell in cells.values()]
            lines.append(f"| {names[str(run.path)]} | " + " | ".join(text) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats at the same or a lower cost (higher is better), by cost: a staircase."""
    best, front = -math.inf, []
    for spent, value in sorted(points):
        if value > best:
            best = value
            front.append((spent, value))
    return front


def plot(runs: list[RunRecord], names: dict[str, str], cost: str, path: Path, title: str) -> bool:
    """Each metric against cost: a curve per run and, for the accuracies, the frontier across runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = metrics_of(runs)
    if not metrics:
        return False
    spec = COSTS[cost]
    columns = min(3, len(metrics))
    rows = math.ceil(len(metrics) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False,
                             constrained_layout=True)
    palette = matplotlib.colormaps["tab10"].colors
    for index, metric in enumerate(metrics):
        ax = axes[index // columns][index % columns]
        points = []
        for number, run in enumerate(runs):
            costs = epoch_costs(run, cost)
            values = by_epoch(run.scalars.get(metric, []), [step for step, _ in costs])
            curve = [(spent, v) for (_, spent), v in zip(costs, values) if v is not None]
            if curve:
                ax.plot(*zip(*curve), marker="o", markersize=3, color=palette[number % len(palette)],
                        label=names[str(run.path)])
                points += curve
        higher_is_better = not metric.startswith(f"{tags.LIPSCHITZ}/")
        if higher_is_better and points:
            front = frontier(points)
            xs = [c for c, _ in front] + [max(c for c, _ in points)]
            ys = [v for _, v in front] + [front[-1][1]]
            ax.step(xs, ys, where="post", color="black", linestyle="--", linewidth=1, label="frontier")
        ax.set_title(short(metric), fontsize=9)
        ax.set_xlabel(f"{cost}: {spec.unit}", fontsize=8)
        ax.grid(alpha=0.3)
    for index in range(len(metrics), rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)), fontsize=7)
    fig.suptitle(f"{title}: at equal {spec.name}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def section(runs: list[RunRecord], names: dict[str, str], cost: str, budgets: list[float] | None, out: Path,
            study: str) -> list[str]:
    """The report's section at equal cost (and its figure ``equal_cost_<cost>.png`` in ``out``)."""
    runs = logged(runs, cost)
    spec = COSTS[cost]
    budgets = budgets or default_budgets(runs, cost)
    figure = f"equal_cost_{cost}.png"
    drawn = plot(runs, names, cost, out / figure, study)
    lines = [f"## At equal cost: {spec.name}", "",
             f"Budgets in {spec.unit} (`{spec.tag}`" + ("" if spec.cumulative else ", summed over epochs")
             + f"): {', '.join(f'{b:g}' for b in budgets)}. Each cell: the metric at the last epoch within the budget "
               f"at which the run logged it (validation), with that epoch's number; — where it logged none. "
             + ("FLOPs count the matrix products (forward, backward, the stabilizers' and the optimizer's), not the "
                "elementwise work. " if cost == "flops" else "")
             + ("Predicted by the CPU model of a GPU step (its error is stated in the README). " if cost == "gpu"
                else "")
             + ("Wall-clock time depends on the machine and on what else ran on it. " if cost == "wall" else ""),
             "", tables(runs, names, cost, budgets), ""]
    if drawn:
        lines += [f"![{figure[:-4]}]({figure})", ""]
    return lines


__all__ = ["COSTS", "CostNotLogged", "at_budget", "by_epoch", "check_logged", "default_budgets", "epoch_costs",
           "frontier", "logged", "metrics_of", "parse_budgets", "section", "tables"]
