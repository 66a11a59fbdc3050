"""Models compared at equal training-time budgets, as Prach et al. (CVPR 2024) compare 1-Lipschitz layers: for each
run of a sweep and each budget, the validation accuracy and certified accuracy of the last epoch whose cumulative
training time (``time/train_epoch_s``, the training steps only) fits in the budget.

    python experiments/wallclock.py runs/sweeps/certified_long --budgets 15,30,60,120 \\
        --out results/certified_transformers/wallclock.md

The certified studies' view of ``stability report RUNS --cost wall`` (stability/report/equal_cost.py), which
compares any runs at equal wall-clock time, FLOPs or predicted GPU time on every metric they logged. Needs runs that
log ``time/train_epoch_s`` (``--timing.enabled true``) and certified accuracy at validation
(``--robustness.every_n_epochs 1``). Unfinished runs are included, marked with their epochs so far. The runs
shared the same machine; runs that trained at the same time shared its cores, which the times include.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stability import tags  # noqa: E402
from stability.report import equal_cost  # noqa: E402
from stability.report.plots import short_names  # noqa: E402
from stability.report.reading import find_runs, load_run  # noqa: E402

RADII = ("0.5", "1.58")
METRICS = [tags.stage_metric("val", "acc"), *(f"{tags.CERTIFIED}/acc_L2_{r}" for r in RADII)]


def at_budgets(run, budgets_s: list[float]) -> list[dict | None]:
    """Per budget: {epochs, acc, certified at each radius} of the last epoch within it at which all three were
    logged (None: not one)."""
    rows = []
    for budget in budgets_s:
        cells = equal_cost.at_budget(run, "wall", budget / 60, METRICS, together=True)
        if any(cell is None for cell in cells.values()):
            rows.append(None)
            continue
        acc, *certified = (cells[m] for m in METRICS)
        rows.append({"epochs": acc[1], "acc": acc[0], **{r: c[0] for r, c in zip(RADII, certified)}})
    return rows


def table(root: Path, budgets_min: list[float]) -> str:
    runs = [r for r in (load_run(p, unfinished=True) for p in find_runs(root)) if r is not None]
    names = short_names([SimpleNamespace(label=r.configuration or r.path.name, stabilizer=r.stabilizer) for r in runs])
    header = "| run | " + " | ".join(f"{b:g} min" for b in budgets_min) + " |"
    lines = [header, "|---|" + "---|" * len(budgets_min)]
    for run in sorted(runs, key=lambda r: str(r.path)):
        cells = []
        for row in at_budgets(run, [60 * b for b in budgets_min]):
            cells.append("—" if row is None else
                         f"{row['acc']:.3f} / {row['0.5']:.3f} / {row['1.58']:.3f} ({row['epochs']} ep)")
        name = names[run.configuration or run.path.name]
        if run.status == "unfinished":
            epochs = len(run.scalars.get(tags.TIME_TRAIN_EPOCH, []))
            name += f" (unfinished: {epochs} epochs so far)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="a sweep's runs, e.g. runs/sweeps/certified_long")
    p.add_argument("--budgets", default="15,30,60,120", help="training-time budgets in minutes, comma-separated")
    p.add_argument("--out", type=Path, help="write the table here (Markdown) as well as printing it")
    args = p.parse_args()
    if not args.root.is_dir():
        p.error(f"{args.root}: no such directory (give a sweep's runs, e.g. runs/sweeps/certified_long)")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: need minutes as numbers, comma-separated (e.g. 15,30,60)")
    if any(b <= 0 for b in budgets):
        p.error(f"--budgets {args.budgets!r}: every budget must be > 0 minutes")
    text = (f"Validation clean / certified ℓ2 0.5 / certified ℓ2 1.58 accuracy (2,000 points) of the last epoch within "
            f"each budget of training time (`time/train_epoch_s`, summed), and its number of epochs.\n\n"
            f"`python experiments/wallclock.py {args.root} --budgets {args.budgets}`\n\n{table(args.root, budgets)}\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
