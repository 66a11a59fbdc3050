"""``stability report RUNS_DIR``: one table and the plots comparing a set of runs.

Reads every run under RUNS_DIR (a directory with ``config.yaml`` and TensorBoard events: sweep
runs and plain ``runs/.../version_N`` alike), groups runs that differ only in their seed into one
configuration, and writes under ``results/<study>/`` (``--out``):

* ``report.md`` — one row per configuration: mean ± sample std over seeds of clean accuracy (and on
  the attack subset), every robust accuracy, local Lipschitz mean / max (and from the patch embedding on),
  JaSMin's mean g₁ where attention was measured, the certified bound (log10, where finite), the last epoch's
  task loss and training time per epoch (training steps only), and the divergence rate.
  Test-time values (``--test_after_fit`` / ``stability test``) are used where a run has them, else
  the last values logged during fit. Diverged runs count in the divergence rate only;
* ``accuracy_vs_lipschitz.png``, ``robust_vs_budget.png``, ``loss_curves.png``,
  ``lipschitz_distribution.png``, and ``accuracy_vs_certified.png`` where runs have a certified bound;
  ``accuracy_vs_paper_bound.png`` where they have the Lipschitz transformer's paper bound, with the
  accuracy–bound frontier marked and named in ``report.md``;
* where configurations differ only in their learning rate: Wortsman et al.'s LR sensitivity, the largest stable
  learning rate and the divergence rate per family (a table in ``report.md``), and ``loss_vs_lr.png``;
* the runs at equal cost (:mod:`.equal_cost`): for each budget of training cost — matrix FLOPs (``--cost flops``,
  the default where runs logged them), wall-clock time (``wall``) or the time predicted on a reference GPU (``gpu``)
  — every validation metric of every run at its last epoch within the budget, and ``equal_cost_<cost>.png``.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .. import exit_codes, tags
from . import equal_cost
from .aggregate import group, label_configurations, sweep_order, table
from .lr_sensitivity import lr_families, lr_table, plot_loss_vs_lr
from .plots import (
    line_styles,
    plot_accuracy_vs_lipschitz,
    plot_accuracy_vs_paper_bound,
    plot_certified_vs_empirical,
    plot_lipschitz_distribution,
    plot_loss_curves,
    plot_robust_vs_budget,
    short_names,
)
from .reading import find_runs, load_run


def write_report(runs_dir: Path, out: Path, study: str, command: str, cost: str | None = None,
                 budgets: list[float] | None = None, unfinished: bool = False) -> Path:
    records = [r for r in (load_run(p, unfinished) for p in find_runs(runs_dir)) if r is not None]
    training = [r for r in records if r.status == "unfinished" and not r.results]  # no test values yet
    records = [r for r in records if r not in training]
    if not records:
        still = f" ({len(training)} still training: listed with --unfinished once their test has begun)" \
            if training else ""
        raise ValueError(f"no finished runs under {runs_dir} (a run is a directory with config.yaml and "
                         f"TensorBoard events; sweep runs count once done.json is written, or with --unfinished "
                         f"once their test has begun){still}")
    if cost is not None:
        equal_cost.check_logged(records, cost, runs_dir)
    else:  # the machine-independent cost where the runs logged it
        cost = next((c for c in ("flops", "wall") if equal_cost.logged(records, c)), None)
    label_configurations(records)
    sweep_order(runs_dir, records)
    configurations = group(records)
    styles = line_styles(configurations)
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
        "certified_vs_empirical.png": plot_certified_vs_empirical(configurations, styles,
                                                                  out / "certified_vs_empirical.png", study),
    }
    front = plot_accuracy_vs_paper_bound(configurations, styles, out / "accuracy_vs_paper_bound.png", study)
    plots["accuracy_vs_paper_bound.png"] = bool(front)
    test_time = any(tags.stage_metric("test", "acc") in r.scalars or (r.results or {}).get("clean_accuracy")
                    is not None for r in records)
    lines = [f"# {study}", "", f"Made by `{command}` from {len(records)} runs in `{runs_dir}`.", "",
             "Mean ± sample std over seeds, and where a cell's values come from fewer runs than the "
             "configuration's, how many (k/n); " + ("test-set values (after fit)" if test_time else
                                                 "last values logged during fit (validation subset)")
             + "; diverged runs count only in `diverged`. Robust columns: empirical robust accuracy, "
               "attack_norm_ε (`autoattack` is the official AutoAttack, `autoattack_tap` torchattacks' weaker one; "
               "`worst`: the share of points that survive every attack at that budget, averaged only over the runs "
               "that ran the most attacks there) on the attacked points, "
               "whose clean accuracy is `clean (attack subset)` (`clean (AutoAttack subset)` where AutoAttack ran "
               "on fewer); `cert norm_ε`: certified accuracy from the model's certified Lipschitz bound; "
               "`Lip local`: ‖J_f(x)‖₂ per point, the exact norm (`--lipschitz.method` exact, or auto on at most "
               "2 × iterations classes, the default since 2026-11-29) or its power-iteration estimate (a lower "
               "bound; results.json's `local_method`, absent before, says which): a local value, never a "
               "certificate; `Lip no-embed`: the same from the patch embedding on (JaSMin's Fig. 4); `g1 mean`: "
               "JaSMin's g₁ of the attention rows, mean over points, heads and layers; `certified log10`: log10 of the "
               "certified global bound where the model has one, "
               "`tightness` that bound over the largest local estimate; `paper bound log10`: the Lipschitz "
               "transformer's bound as its paper composes it (per-token RMS norms; it certifies nothing in pixels); "
               "`task loss`: last epoch's training objective; `s/epoch`: training steps only. Distributions are "
               "drawn from TensorBoard's histograms, so their quantiles have the resolution of its buckets.", "",
             table(configurations), ""]
    lines += local_methods_note(records)
    if unfinished:
        lines += unfinished_section(records, training)
    if front:
        lines += ["On the accuracy–bound frontier (no configuration with a smaller paper's bound is more accurate; "
                  "means over seeds): " + "; ".join(f"`{label}`" for label in front) + ".", ""]
    families = lr_families(configurations)
    if families:
        plots["loss_vs_lr.png"] = plot_loss_vs_lr(families, out / "loss_vs_lr.png", study)
        lines += ["## Learning-rate sensitivity", "",
                  "Configurations that differ only in their learning rate η (Wortsman et al. 2023): LR sensitivity = "
                  "mean over η of min(ℓ(η), ℓ₀) − min over η of ℓ(η), ℓ the final validation loss, ℓ₀ = log K the "
                  "loss at initialisation, a diverged run counting as ℓ₀; mean ± std over seeds. Largest stable η: no "
                  "seed diverged and the mean final loss keeps at least half of the best η's improvement over ℓ₀, "
                  "ℓ(η) ≤ ℓ₀ − (ℓ₀ − ℓ*)/2.", "", lr_table(families), ""]
    for name, drawn in plots.items():
        if drawn:
            lines += [f"![{name[:-4]}]({name})", ""]
    if cost is not None:
        names = run_names(records)
        lines += equal_cost.section(records, names, cost, budgets, out, study)
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def unfinished_section(records, training) -> list[str]:
    """What each unfinished run still lacks: the measurement its test stopped in (its values in the table are on the
    points measured), or, for a run still training, its last epoch and validation accuracy (not in the table)."""
    lines = []
    for record in records:
        if record.status == "unfinished":
            results = record.results or {}
            robustness = results.get("robustness") or {}
            attacks = robustness.get("attacks") or {}
            measured = ", ".join(f"{label} on {a['points']}" for label, a in attacks.items())
            stops = [part["interrupted"] for part in (results.get("lipschitz"), robustness)
                     if isinstance(part, dict) and part.get("interrupted")]
            stopped = "; ".join(stops) or ("its test has finished, the sweep has not yet recorded the run as done"
                                           if results.get("complete") else "its test has not finished")
            lines.append(f"- `{record.path.name}`: {stopped}; the table has what its test measured"
                         + (f" ({measured} points)" if measured else ""))
    for record in training:
        epochs = record.scalars.get(tags.per_epoch(tags.TASK_LOSS), [])
        accuracy = record.last(tags.stage_metric("val", "acc"))
        planned = (record.config.get("trainer") or {}).get("max_epochs")
        state = "trained" if planned is not None and len(epochs) >= planned else "training"
        lines.append(f"- `{record.path.name}`: {state}, {len(epochs)} of {planned} epochs"
                     + (f", validation accuracy {accuracy:.3f}" if accuracy is not None else "")
                     + ("; its test has written no results yet" if state == "trained" else "") + "; not in the table")
    if not lines:
        return []
    return ["## Unfinished runs", "", "Included with `--unfinished`: a run whose test has begun enters the table with "
            "the values its test measured so far (none from its training: a gap stays a gap); a run still training "
            "does not.", "", *lines, ""]


def run_names(records) -> dict[str, str]:
    """A short, distinct name per run: its configuration's legend name, with its seed where seeds differ."""
    from types import SimpleNamespace

    names = short_names([SimpleNamespace(label=r.configuration or r.path.name, stabilizer=r.stabilizer)
                         for r in records])
    seeds = {r.configuration: set() for r in records}
    for r in records:
        seeds[r.configuration].add(r.seed)
    return {str(r.path): names[r.configuration or r.path.name] + (f", seed {r.seed}" if len(seeds[r.configuration]) > 1
                                                                  else "") for r in records}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stability report", description=__doc__.split("\n")[0])
    p.add_argument("runs_dir", help="a sweep directory or any directory of runs")
    p.add_argument("--study", help="study name (default: the directory's name)")
    p.add_argument("--out", help="output directory (default results/<study>)")
    p.add_argument("--cost", choices=sorted(equal_cost.COSTS), default=None,
                   help="compare at equal cost: flops (matrix FLOPs, machine-independent; the default where logged), "
                        "wall (wall-clock training time) or gpu (time predicted on the reference GPU)")
    p.add_argument("--budgets", default=None, help="budgets in the cost's unit (TFLOP, minutes, GPU seconds), "
                                                   "comma-separated; default 1/8, 1/4, 1/2 and all of the longest run")
    p.add_argument("--unfinished", action="store_true",
                   help="also sweep runs that have not finished: those whose test has begun, with the values measured "
                        "so far (named in an 'Unfinished runs' section), and a line for each still training")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir)
    if not runs_dir.is_dir():
        print(f"stability report: error: {runs_dir} is not a directory", file=sys.stderr)
        return exit_codes.BAD_INPUT
    study = args.study or runs_dir.resolve().name
    out = Path(args.out) if args.out else Path("results") / study
    command = "stability report " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:]))
    try:
        budgets = None if args.budgets is None else equal_cost.parse_budgets(args.budgets)
        report = write_report(runs_dir, out, study, command, args.cost, budgets, args.unfinished)
    except ValueError as err:
        print(f"stability report: error: {err}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(f"wrote {report}")
    return 0


def local_methods_note(records) -> list[str]:
    """A line under the table where its runs measured ``Lip local`` by different methods (the exact norm and power
    iteration, its lower bound), naming how many of each; nothing where they agree."""
    methods: dict[str, int] = {}
    for record in records:
        if record.local_method:
            methods[record.local_method] = methods.get(record.local_method, 0) + 1
    if len(methods) < 2:
        return []
    counts = ", ".join(f"{'the exact norm' if m == 'exact' else 'power iteration'} in {n} run{'s' * (n != 1)}"
                       for m, n in sorted(methods.items()))
    return [f"`Lip local` mixes methods: {counts} (results.json's `local_method`). Power iteration is a lower "
            "bound of the exact norm; with 10 iterations it came within 0.1 % of it on a trained micro ViT.", ""]
