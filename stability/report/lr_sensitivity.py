"""Learning-rate sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", §2 and Figure 1): how much a method's final loss depends on its learning rate.

For a family of configurations that differ only in their learning rate η, over the η a sweep ran (log-uniform in
practice):

    LR sensitivity = E_η[min(ℓ(η), ℓ₀)] − min_η ℓ(η),

ℓ(η) the final validation loss, ℓ₀ the loss at initialisation — here log K for K classes, the loss of the uniform
prediction, which is what these classifiers start at (their heads start small or at zero) — and a diverged run
counting as ℓ₀. It is computed per seed (each seed over the same learning rates) and reported as mean ± sample
std over seeds. Beside it: the largest stable learning rate (no seed diverged, and the mean final loss keeps at
least half of the best learning rate's improvement over ℓ₀) and the divergence rate over all the family's runs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .. import tags
from .aggregate import Configuration, mean_std

LR_KEYS_END = "lr"  # model.lr (labelled "lr") or a stabilizer's own, e.g. muon.lr


def _parts(label: str) -> list[tuple[str, str]]:
    return [tuple(part.split("=", 1)) if "=" in part else (part, "") for part in label.split(", ")]


def _is_lr(key: str) -> bool:
    return key.rpartition(".")[2] == LR_KEYS_END


@dataclass
class LRFamily:
    """Configurations that differ only in their learning rate."""

    label: str
    lr_key: str
    points: dict[float, Configuration] = field(default_factory=dict)  # η → configuration (its seeds)

    @property
    def lrs(self) -> list[float]:
        return sorted(self.points)

    def initial_loss(self) -> float:
        """ℓ₀ = log K."""
        run = next(iter(self.points.values())).runs[0]
        return math.log(int((run.config.get("model") or {}).get("num_classes", 10)))

    def final_loss(self, run) -> float:
        """min(final validation loss, ℓ₀); ℓ₀ for a diverged run or a non-finite loss."""
        cap = self.initial_loss()
        value = run.last(tags.stage_metric("val", "loss"))
        if run.status == "diverged" or value is None or not math.isfinite(value):
            return cap
        return min(value, cap)

    def losses_by_seed(self) -> dict[object, dict[float, float]]:
        """seed → {η: capped final loss}, only for seeds that ran at every η of the family."""
        table: dict[object, dict[float, float]] = {}
        for lr, config in self.points.items():
            for run in config.runs:
                table.setdefault(run.seed, {})[lr] = self.final_loss(run)
        return {seed: losses for seed, losses in table.items() if len(losses) == len(self.points)}

    def sensitivity(self) -> list[float]:
        """LR sensitivity per seed."""
        return [statistics.fmean(losses.values()) - min(losses.values())
                for losses in self.losses_by_seed().values()]

    def mean_losses(self) -> dict[float, tuple[float, float]]:
        """η → (mean, sample std) of the capped final loss over seeds."""
        out = {}
        for lr, config in sorted(self.points.items()):
            values = [self.final_loss(run) for run in config.runs]
            out[lr] = (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
        return out

    def largest_stable_lr(self) -> float | None:
        """The largest η at which no seed diverged and the mean final loss keeps at least half of the family's
        best improvement over ℓ₀: ℓ(η) ≤ ℓ₀ − (ℓ₀ − ℓ*)/2, ℓ* the best mean final loss. (A run that ends just
        under ℓ₀ has learned nothing; "below ℓ₀" alone would call it stable.)"""
        cap = self.initial_loss()
        means = self.mean_losses()
        threshold = cap - (cap - min(mean for mean, _ in means.values())) / 2
        stable = [lr for lr, config in self.points.items()
                  if means[lr][0] <= threshold and all(run.status != "diverged" for run in config.runs)]
        return max(stable) if stable else None

    def divergence(self) -> tuple[int, int]:
        runs = [run for config in self.points.values() for run in config.runs]
        return sum(run.status == "diverged" for run in runs), len(runs)


def lr_families(configurations: list[Configuration]) -> list[LRFamily]:
    """Families of configurations whose labels differ only in one learning-rate setting (≥ 2 learning rates);
    a label with two (say ``lr`` fixed and ``muon.lr`` swept) belongs to the family of the one that varies."""
    families: dict[str, LRFamily] = {}
    for config in configurations:
        parts = _parts(config.label)
        for key, value in parts:
            if not _is_lr(key):
                continue
            try:
                lr = float(value)
            except ValueError:
                continue
            rest = ", ".join(f"{k}={v}" if v else k for k, v in parts if k != key) or config.stabilizer
            family = families.setdefault(f"{rest} [{key}]", LRFamily(rest, key))
            family.points[lr] = config
    return [family for family in families.values() if len(family.points) >= 2]


def lr_table(families: list[LRFamily]) -> str:
    """One row per family: the learning rates, LR sensitivity (mean ± std over seeds), the best final loss and
    where, the largest stable learning rate and the divergence rate."""
    lines = ["| configuration | learning rates | seeds | LR sensitivity | best final loss (at η) | largest stable η "
             "| diverged |", "|---|---|---|---|---|---|---|"]
    for family in families:
        means = family.mean_losses()
        best = min(means, key=lambda lr: means[lr][0])
        stable = family.largest_stable_lr()
        diverged, runs = family.divergence()
        seeds = len(family.losses_by_seed())
        lrs = family.lrs
        lines.append(f"| {family.label} | {family.lr_key} {lrs[0]:g}–{lrs[-1]:g} ({len(lrs)}) | {seeds} "
                     f"| {mean_std(family.sensitivity())} | {means[best][0]:.3g} ({best:g}) "
                     f"| {'none' if stable is None else f'{stable:g}'} | {diverged}/{runs} |")
    return "\n".join(lines)


def facet_key(families: list[LRFamily]) -> str | None:
    """A setting every family has, with 2–4 values and fewer values than families (say the depth): the plot draws
    one panel per value. The one with the fewest values; None when there is none."""
    if len(families) < 2:
        return None
    settings = [dict(_parts(family.label)) for family in families]
    candidates = []
    for key in sorted(set.intersection(*(set(d) for d in settings)) - {"stabilizer"}):
        values = {d[key] for d in settings}
        if 2 <= len(values) <= 4 and len(values) < len(families):
            candidates.append((len(values), key))
    return min(candidates)[1] if candidates else None


def short_legends(families: list[LRFamily], drop: str | None = None) -> list[str]:
    """Legends that keep what tells the families apart: the stabilizer and the settings but ``drop`` (the panel's);
    a setting that every family having it shares is left out too, unless two legends of a panel would then be
    the same (the report's table keeps the full labels)."""
    settings = [_parts(family.label) for family in families]
    panel = [dict(parts).get(drop, "") for parts in settings]
    values: dict[str, set[str]] = {}
    for parts in settings:
        for key, value in parts:
            values.setdefault(key, set()).add(value)

    def legends(dropped: set[str]) -> list[str]:
        out = []
        for family, parts in zip(families, settings):
            name = ", ".join(f"{k}={v}" if v else k for k, v in parts
                             if k == "stabilizer" or k not in dropped).removeprefix("stabilizer=")
            out.append(name if family.lr_key in ("lr", "model.lr") else f"{name} (η: {family.lr_key})")
        return out

    dropped = {drop} if drop else set()
    for key in sorted(k for k, v in values.items() if len(v) == 1 and k not in ("stabilizer", drop)):
        trial = legends(dropped | {key})
        if len(set(zip(panel, trial))) == len(trial):
            dropped.add(key)
    return legends(dropped)


def plot_loss_vs_lr(families: list[LRFamily], path, title: str) -> bool:
    """Final validation loss (capped at ℓ₀) against the learning rate, one curve per family (Wortsman et al.,
    Figure 1): mean over seeds with its std; a cross marks a learning rate where some seed diverged. One panel per
    value of a setting all families vary together (:func:`facet_key`, e.g. the depth), one colour per method."""
    import matplotlib

    from .plots import _panels

    if not families:
        return False
    facet = facet_key(families)
    panels: dict[str, list[int]] = {}
    for index, family in enumerate(families):
        panels.setdefault(dict(_parts(family.label)).get(facet, "") if facet else "", []).append(index)
    legends = short_legends(families, facet)
    methods = list(dict.fromkeys(legends))
    palette = matplotlib.colormaps["tab20"].colors
    styles = ["-", "--", ":", "-."]
    width = 6.5 * len(panels) if len(panels) > 1 else 9
    plt, fig, axes = _panels(len(panels), width, 5.5 + 0.18 * len(methods), sharey=True)
    handles: dict[str, object] = {}
    for ax, (value, members) in zip(axes, panels.items()):
        for index in members:
            family, legend = families[index], legends[index]
            number = methods.index(legend)
            colour, style = palette[number % len(palette)], styles[(number // len(palette)) % len(styles)]
            means, lrs, cap = family.mean_losses(), family.lrs, family.initial_loss()
            handles[legend] = ax.errorbar(lrs, [means[lr][0] for lr in lrs], yerr=[means[lr][1] for lr in lrs],
                                          color=colour, linestyle=style, marker="o", markersize=4, capsize=2,
                                          linewidth=1.3)
            diverged = [lr for lr in lrs if any(run.status == "diverged" for run in family.points[lr].runs)]
            ax.scatter(diverged, [cap] * len(diverged), marker="x", s=60, color=colour, zorder=3)
        for cap in {families[index].initial_loss() for index in members}:
            ax.axhline(cap, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3, which="both")
        if facet:
            ax.set_title(f"{facet}={value}", fontsize=10)
    axes[0].set_ylabel("final validation loss (capped at the initial loss log K)")
    columns = 2 if max(map(len, methods)) <= 60 and len(methods) > 6 else 1
    fig.legend([handles[m] for m in methods], methods, fontsize=7, loc="outside lower center", ncol=columns,
               frameon=False)
    fig.suptitle(f"{title}: final loss vs learning rate (× a seed diverged; dotted: log K)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
