"""Where a row's extra traffic goes: the bytes and launches of one counted step by operator, a row's less a
reference row's, from the counts ``step_cost.py --count`` keeps beside its table (<out>.json).

    python benchmarks/operator_bytes.py results/benchmarks/step_model_h200_now.json lipsformer
    python benchmarks/operator_bytes.py results/benchmarks/step_model_h200_now.json "jasmin k=10" --top 8 --blocks 12

Each operator's launches and bytes (the non-matrix operators', as the model prices them; a matrix product's hidden
copy is its own entry, ``<operator>'s copy``) in the row's step less the reference's (default: ``none``), largest
first, and over ``--blocks`` (the counted model's depth: a per-block figure where the difference is the blocks'; the
optimizer's and the loss's parts are divided too). Counts kept before bytes were kept by operator are refused by name:
count them again (``step_cost.py --count --recount``).
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from step_cost import kept_counts

from stability.testing.gpu_model import StepCounts


def difference(row: StepCounts, reference: StepCounts) -> list[tuple[str, float, float]]:
    """(operator, launches, bytes) of ``row`` less ``reference``, every operator either has, largest change in bytes
    first (then in launches); the bytes sum to the rows' difference in ``bytes``."""
    for counts, which in ((row, "row"), (reference, "reference")):
        if counts.bytes and not counts.op_bytes:
            raise ValueError(f"the {which}'s counts were kept before bytes were kept by operator: count them again "
                             f"(step_cost.py --count --recount)")
    launches, moved = Counter(row.ops), Counter(row.op_bytes)
    launches.subtract(reference.ops)
    moved.subtract(reference.op_bytes)
    names = {name for name in set(launches) | set(moved) if launches[name] or moved[name]}
    return sorted(((name, float(launches[name]), float(moved[name])) for name in names),
                  key=lambda entry: (-abs(entry[2]), -abs(entry[1]), entry[0]))


def table(changes: list[tuple[str, float, float]], blocks: int, top: int | None) -> str:
    """Markdown: each operator's launches and GB, and the GB over ``blocks``, the ``top`` first; the rest (and the
    changes that would print as none: no launch and under half a megabyte) summed, then the total."""
    changed = [e for e in changes if e[1] or round(e[2] / 1e9, 3)]  # the others print as +0 and +0.000: in the rest
    shown = changed[:top] if top else changed
    rest = [e for e in changes if e not in shown]
    lines = ["| operator | launches | GB | GB over blocks |", "|---|---|---|---|"]

    def line(name: str, launches: float, moved: float) -> str:
        return f"| {name} | {launches:+.0f} | {moved / 1e9:+.3f} | {moved / 1e9 / blocks:+.3f} |"

    lines += [line(*entry) for entry in shown]
    if rest:
        lines.append(line(f"{len(rest)} others", sum(e[1] for e in rest), sum(e[2] for e in rest)))
    lines.append(line("**total**", sum(e[1] for e in changes), sum(e[2] for e in changes)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", type=Path, help="step_cost.py --count's <out>.json")
    parser.add_argument("row", help="the row's label, e.g. 'lipsformer'")
    parser.add_argument("--reference", default="none", help="the row it is compared with (default: none)")
    parser.add_argument("--blocks", type=int, default=12, help="divide by this many blocks (default: ViT-S's 12)")
    parser.add_argument("--top", type=int, default=20, help="operators shown (the rest summed; 0: all)")
    args = parser.parse_args()
    counts = kept_counts(args.counts)
    missing = [label for label in (args.row, args.reference) if label not in counts]
    if missing:
        raise SystemExit(f"{args.counts}: no row {', '.join(map(repr, missing))}; its rows: {', '.join(counts)}")
    if args.blocks < 1:
        raise SystemExit(f"--blocks must be at least 1, got {args.blocks}")
    try:
        changes = difference(counts[args.row], counts[args.reference])
    except ValueError as err:
        raise SystemExit(f"{args.counts}: {err}") from None
    print(f"{args.row} less {args.reference}, one step ({args.counts}); GB over {args.blocks} blocks:\n")
    print(table(changes, args.blocks, args.top or None))


if __name__ == "__main__":
    main()
