"""Models compared at equal training-time budgets, as Prach et al. (CVPR 2024) compare 1-Lipschitz layers: for each
run of a sweep and each budget, the validation accuracy and certified accuracy of the last epoch whose cumulative
training time (``time/train_epoch_s``, the training steps only) fits in the budget.

    python experiments/wallclock.py runs/sweeps/certified_long --budgets 15,30,60,120 \\
        --out results/certified_transformers/wallclock.md

Needs runs that log ``time/train_epoch_s`` (``--timing.enabled true``) and certified accuracy at validation
(``--robustness.every_n_epochs 1``). Unfinished runs are included, marked with their epochs so far. The runs
shared the same machine; runs that trained at the same time shared its cores, which the times include.
"""
from __future__ import annotations

import argparse
import bisect
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stability import tags  # noqa: E402
from stability.report.plots import short_names  # noqa: E402
from stability.report.reading import find_runs, load_run  # noqa: E402

RADII = ("0.5", "1.58")


def _by_epoch(series: list[tuple[int, float]], ends: list[int]) -> list[float | None]:
    """The value logged in each training epoch's window [end_k, end_{k+1}) of global steps (validation logs at its
    epoch's last step; None where an epoch has none): joined by step, not by position, so resumed runs and
    measurements every N epochs line up."""
    values: list[float | None] = [None] * len(ends)
    for step, value in series:
        epoch = bisect.bisect_right(ends, step) - 1
        if epoch >= 0:
            values[epoch] = value
    return values


def at_budgets(run, budgets_s: list[float]) -> list[dict | None]:
    """Per budget: {epochs, seconds, acc, certified at each radius} of the last epoch within it (None: not one)."""
    timed = run.scalars.get(tags.TIME_TRAIN_EPOCH, [])
    ends = [step for step, _ in timed]
    accuracy = _by_epoch(run.scalars.get(tags.stage_metric("val", "acc"), []), ends)
    certified = {r: _by_epoch(run.scalars.get(f"{tags.CERTIFIED}/acc_L2_{r}", []), ends) for r in RADII}
    rows = []
    for budget in budgets_s:
        elapsed, last = 0.0, None
        for epoch, (_, seconds) in enumerate(timed):
            elapsed += seconds
            if elapsed > budget:
                break
            if accuracy[epoch] is not None and all(v[epoch] is not None for v in certified.values()):
                last = {"epochs": epoch + 1, "seconds": elapsed, "acc": accuracy[epoch],
                        **{r: v[epoch] for r, v in certified.items()}}
        rows.append(last)
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
