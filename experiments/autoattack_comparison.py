"""Official AutoAttack (pyautoattack, standard version) against torchattacks' AutoAttack on the whole
digits test split (270 images), at ℓ∞ 2/255 and 8/255, for the baseline and three stabilizers of
results/stabilizers_digits.md (the checkpoints that script trained): robust accuracy of each, PGD-10,
the worst case over all of them per budget, certified accuracy where a bound exists (ℓ∞ ε certified
through the ℓ2 ball of radius √n·ε), and the seconds per point each attack took.

    python experiments/autoattack_comparison.py        (after experiments/stabilizers_table.py --data digits)

writes results/autoattack_comparison.md.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.lipschitz.certified import certified_bound
from stability.machine import describe
from stability.robustness import (
    AttackSettings,
    AttackSpec,
    certified_at,
    certified_radii,
    l2_radius,
    survivors,
    worst_case,
)
from stability.robustness.attacks import accuracies, correct

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"none": 0, "lipsformer": 1, "spectral_norm σ≤1 project": 5, "lipschitz transformer σ_max=1": 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default="runs/stabilizers_digits")
    parser.add_argument("--out", default="results/autoattack_comparison.md")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS),
                        help="a subset of the models (default: all four)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the checkpoints are attacked (default: the GPU where there is one)")
    args = parser.parse_args()
    data = Digits()
    data.setup()
    images, labels = (t.to(args.device) for t in data.test_set.tensors)
    header = ["model", "ε", "clean", "PGD-10", "AutoAttack (torchattacks)", "AutoAttack (official)", "worst case",
              "certified", "s / point: PGD", "torchattacks AA", "official AA"]
    rows, started = [], time.time()
    for label in args.models:
        index = MODELS[label]
        ckpt = max((ROOT / args.runs_dir / str(index)).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
        network = ImageClassifier.load_from_checkpoint(ckpt, map_location=args.device).network.eval()
        bound, _ = certified_bound(network)
        with torch.no_grad():
            radii = certified_radii(network(images), labels, bound) if bound else None
        for eps in (2 / 255, 8 / 255):
            specs = [AttackSpec(name, "Linf", eps) for name in ("pgd", "autoattack_tap", "autoattack")]
            settings = AttackSettings(num_classes=10, seed=0)
            masks, seconds = {"clean": correct(network, images, labels)}, {}
            for spec in specs:  # one batch of all 270 points: the same seeds as robust_accuracy uses
                start = time.time()
                masks[spec.label] = survivors(network, images, labels, spec, settings, batch_index=0)
                seconds[spec.name] = (time.time() - start) / len(labels)
            values = accuracies({**masks, **worst_case(masks, specs)})
            certified = (float(certified_at(radii, l2_radius("Linf", eps, images[0].numel())).float().mean())
                         if radii is not None else "—")
            budget = f"{round(eps * 255)}/255"
            rows.append([label, budget, values["clean"], values[f"pgd_Linf_{budget}"],
                         values[f"autoattack_tap_Linf_{budget}"], values[f"autoattack_Linf_{budget}"],
                         values[f"worst_Linf_{budget}"], certified, seconds["pgd"], seconds["autoattack_tap"],
                         seconds["autoattack"]])
            print(rows[-1], flush=True)
    minutes = (time.time() - started) / 60
    cell = lambda v: v if isinstance(v, str) else f"{v:.3g}"  # noqa: E731
    lines = ["# Official AutoAttack vs torchattacks' AutoAttack on digits", "",
             f"Made by `python experiments/autoattack_comparison.py` on {describe(args.device)} in {minutes:.0f} min, "
             "from the "
             "checkpoints of `python experiments/stabilizers_table.py --data digits --epochs 30 --seed 0` (micro ViT). "
             "Whole test "
             "split (270 images), ℓ∞; accuracies are fractions; the worst case is the share of points that survive "
             "PGD-10 and both AutoAttacks; certified: from the certified bound (ℓ∞ through √n·ε in ℓ2), where one "
             "exists; seconds per point of each attack on its own.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    out = ROOT / args.out
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
