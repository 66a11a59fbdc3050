"""The report's figures: accuracy vs local Lipschitz (and vs the certified bound), robust accuracy
vs budget per attack, training-loss curves and local-Lipschitz distributions."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .. import tags
from .aggregate import Configuration, parse_label
from .frontier import pareto_front


def _panels(count: int, width: float, height: float, **options):
    """pyplot (Agg), a figure and its row of ``count`` axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(width, height), squeeze=False, constrained_layout=True, **options)
    return plt, fig, list(axes[0])


def _figure(width: float = 7.5, height: float = 4.8):
    plt, fig, axes = _panels(1, width, height)
    return plt, fig, axes[0]


def line_styles(configurations: list[Configuration]) -> dict[str, dict[str, Any]]:
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
    """Legend names: ``stabilizer=X`` becomes ``X:``, a stabilizer's own options lose their prefix, and a
    setting that tells no two configurations apart (one value in every configuration that sets it, and more
    than one sets it) is left out, unless two names would then be the same. The report's table keeps the
    full labels."""
    parts = {c.label: c.label.split(", ") for c in configurations}
    values: dict[str, set[str]] = {}
    holders: dict[str, int] = {}
    for config in configurations:
        for part in parts[config.label]:
            key, _, value = part.partition("=")
            values.setdefault(key, set()).add(value)
            holders[key] = holders.get(key, 0) + 1
    alike = {key for key, seen in values.items() if len(seen) == 1 and holders[key] > 1}

    def names(dropped: set[str]) -> dict[str, str]:
        out = {}
        for config in configurations:
            kept = [_without_prefixes(part, config.stabilizer.split("+")) for part in parts[config.label]
                    if not part.startswith("stabilizer=") and part.partition("=")[0] not in dropped]
            out[config.label] = f"{config.stabilizer}: {', '.join(kept)}" if kept else config.stabilizer
        return out

    short = names(alike)
    return short if len(set(short.values())) == len(short) else names(set())


def _without_prefixes(part: str, stabilizers: list[str]) -> str:
    for name in stabilizers:
        part = part.removeprefix(f"{name}.")
    return part


def _legend(ax, count: int) -> None:
    if count > 6:
        handles, names = ax.get_legend_handles_labels()
        columns = 2 if max(map(len, names)) <= 70 else 1
        ax.figure.legend(handles, names, fontsize=7, loc="outside lower center", ncol=columns, frameon=False)
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
    plt, fig, ax = _figure(9, 5 + (0.2 * len(configurations) if len(configurations) > 6 else 0))
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


def plot_accuracy_vs_paper_bound(configurations, styles, path: Path, title: str) -> list[str]:
    """Clean accuracy against the paper's Lipschitz bound (log scale), one point per configuration, with the
    accuracy–bound frontier drawn through the configurations on it (:func:`~.frontier.pareto_front`);
    returns their labels (empty: nothing drawn)."""
    points = []
    for config in configurations:
        bound, acc = config.values("paper bound log10"), config.values("clean acc")
        if bound and acc:
            points.append((config.label, statistics.fmean(bound), statistics.fmean(acc),
                           statistics.stdev(acc) if len(acc) > 1 else None))
    if len(points) < 2:
        return []
    front = pareto_front([(label, bound, acc) for label, bound, acc, _ in points])
    plt, fig, ax = _figure(9, 5 + (0.2 * len(points) if len(points) > 6 else 0))
    for label, bound, acc, err in points:
        style = styles[label]
        ax.errorbar(10 ** bound, acc, yerr=err, color=style["color"], marker=style["marker"], linestyle="none",
                    capsize=3, markersize=9 if label in front else 6, label=style["name"],
                    markeredgecolor="black" if label in front else style["color"])
    on_front = sorted((p for p in points if p[0] in front), key=lambda p: p[1])
    ax.step([10 ** p[1] for p in on_front], [p[2] for p in on_front], where="post", color="black", alpha=0.5,
            linewidth=1, label="frontier")
    ax.set_xscale("log")
    ax.set_xlabel("the paper's Lipschitz bound (per-token RMS norms), mean over seeds (log scale)")
    ax.set_ylabel("clean accuracy")
    _finish(plt, fig, ax, len(points), path, f"{title}: accuracy vs the paper's bound (black edge: on the frontier)")
    return front


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
            subset = "clean (AutoAttack subset)" if attack.startswith("autoattack") else "clean (attack subset)"
            clean = config.values(subset) or config.values("clean (attack subset)")  # the points attacked
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
    plt, fig, ax = _figure(9, 5 + (0.2 * len(configurations) if len(configurations) > 6 else 0))
    drawn = 0
    for config in configurations:
        curves = [r.scalars.get(tags.per_step(tags.TASK_LOSS)) or r.scalars.get(tags.per_step(tags.TRAIN_LOSS))
                  for r in config.runs]
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
            if run.status == "diverged" and run.scalars.get(tags.HP_DIVERGED_AT_STEP):
                ax.axvline(run.scalars[tags.HP_DIVERGED_AT_STEP][-1][1], color=style["color"], linestyle=":",
                           alpha=0.7)
        drawn += 1
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("task loss (cross-entropy, log scale)")
    caption = "training loss (every seed; a vertical dotted line marks where a run diverged)"
    return _finish(plt, fig, ax, drawn, path, f"{title}: {caption}")


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
    styles = line_styles(configurations)
    for config in configurations:
        keys, counts = pooled_histogram(config, tags.LIPSCHITZ, "local")
        if not keys:
            continue
        q05, q25, q50, q75, q95 = weighted_quantiles(keys, counts, [.05, .25, .5, .75, .95])
        stats.append({"label": styles[config.label]["name"], "whislo": q05, "q1": q25, "med": q50, "q3": q75,
                      "whishi": q95,
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


def plot_certified_vs_empirical(configurations, styles, path: Path, title: str) -> bool:
    """Per configuration with a certified bound: certified accuracy against the ℓ2 radius — the
    share of points whose certified radius exceeds it, from the pooled histogram of certified radii
    (solid; bucket resolution) and exactly at the logged radii (filled markers) — next to the
    empirical worst-case ℓ2 robust accuracy at the attacked budgets (dashed, hollow markers)."""
    drawable = [c for c in configurations if any(k.startswith("cert L2_") for k in _certified_columns(c))]
    plt, fig, ax = _figure(9, 5 + 0.2 * len(drawable))
    logged: list[float] = []  # every radius measured exactly, of every configuration
    for config in drawable:
        exact = {parse_label(f"cert_{k[len('cert '):]}")[2]: config.values(k) for k in _certified_columns(config)
                 if k.startswith("cert L2_")}
        logged += exact
        style = styles[config.label]
        limits, counts = pooled_histogram(config, tags.CERTIFIED, "radius")
        if counts:  # a bucket counts as certified at r only if its lower edge exceeds r: never an overstatement
            total, lowers = sum(counts), [float("-inf"), *limits[:-1]]
            grid = [0.0, *(limit for limit in limits if limit > 0)]
            survival = [sum(c for lower, c in zip(lowers, counts) if lower > r) / total for r in grid]
            ax.step(grid, survival, where="post", color=style["color"], alpha=0.8)
        radii = sorted(r for r, v in exact.items() if v)
        ax.plot(radii, [statistics.fmean(exact[r]) for r in radii], color=style["color"], marker=style["marker"],
                linestyle="none", label=style["name"])
        empirical = sorted((parse_label(k)[2], statistics.fmean(config.values(k))) for k in
                           {k for r in config.runs for k in r.robust() if k.startswith("worst_L2_")}
                           if config.values(k))
        if empirical:
            ax.plot(*zip(*empirical), color=style["color"], marker=style["marker"], linestyle="--", alpha=0.8,
                    markerfacecolor="none")
    if logged:  # the radii that were measured; a constant classifier's huge certificates would hide them
        ax.set_xlim(0, 1.25 * max(logged))
    ax.set_xlabel("ℓ2 radius (pixel units)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    return _finish(plt, fig, ax, len(drawable), path,
                   f"{title}: certified (filled, solid) vs empirical worst-case (hollow, dashed) ℓ2 accuracy")


def _certified_columns(config: Configuration) -> list[str]:
    return sorted({f"cert {k}" for r in config.finished for k in r.certified()})


def pooled_histogram(config: Configuration, group: str, name: str) -> tuple[list[float], list[float]]:
    """A TensorBoard histogram of every finished run of a configuration (test-time where present),
    pooled: (bucket upper limits, counts)."""
    merged: dict[float, float] = {}
    for run in config.finished:
        entries = (run.histograms.get(tags.measurement(group, name, "test"))
                   or run.histograms.get(tags.measurement(group, name, "fit")))
        if entries:
            _, limits, counts = entries[-1]
            for limit, count in zip(limits, counts):
                merged[limit] = merged.get(limit, 0.0) + count
    keys = sorted(merged)
    return keys, [merged[k] for k in keys]
