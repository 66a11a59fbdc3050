"""Train the micro ViT on digits with each stabilizer (same seed, same epochs) and tabulate, on
the trained weights and the validation images:

1. val accuracy next to the quantity each stabilizer controls;
2. local Lipschitz estimates (mean / max of ‖J(x)‖₂, exact), the certified global bound where
   one exists, and clean / FGSM / PGD / AutoAttack (torchattacks) accuracy.

    python experiments/stabilizers_digits.py --epochs 30

writes results/stabilizers_digits.md (runs go to runs/stabilizers_digits/, not committed).
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from stability import exit_codes
from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.lipschitz import jacobian_norm
from stability.lipschitz.certified import certified_bound
from stability.models import attention_sites, capture_attention
from stability.nn.constraints import rms_norm
from stability.nn.softmax_bounds import g_k
from stability.robustness import AttackSpec, robust_accuracy
from stability.stabilizers.muon import hidden_matrices

ROOT = Path(__file__).resolve().parents[1]
RUNS = [  # (label, extra CLI arguments)
    ("none", []),
    ("lipsformer", ["--config", "configs/stabilizer/lipsformer.yaml"]),
    ("jasmin k=10 λ=1e-2 mean", ["--config", "configs/stabilizer/jasmin.yaml"]),
    ("jasmin k=0 λ=1e-1 mean", ["--stabilizer", "jasmin", "--jasmin.lam", "0.1", "--jasmin.k", "0"]),
    ("specformer λ=1e-2", ["--stabilizer", "specformer", "--specformer.lam_q", "1e-2", "--specformer.lam_k", "1e-2",
                           "--specformer.lam_v", "1e-2"]),
    ("spectral_norm σ≤1 project", ["--config", "configs/stabilizer/spectral_norm.yaml"]),
    ("spectral_norm σ=1 parametrize", ["--config", "configs/stabilizer/spectral_norm.yaml",
                                       "--spectral_norm.mode", "parametrize"]),
    ("muon soft cap ‖W‖≤1", ["--config", "configs/stabilizer/muon.yaml"]),
    ("lipschitz transformer", ["--config", "configs/stabilizer/lipschitz_transformer.yaml"]),
    ("lipsformer + jasmin", ["--config", "configs/stabilizer/lipsformer_jasmin.yaml"]),
]


def measure(net: torch.nn.Module, images: torch.Tensor) -> dict[str, float]:
    with torch.no_grad(), capture_attention(net.backbone) as probs:
        net(images)
    sites = attention_sites(net)
    return {
        "mean g1": float(torch.stack([g_k(p, 1).mean() for p in probs]).mean()),
        "Σσ1² QKV heads": sum(float(torch.linalg.matrix_norm(
            s.qkv.weight.detach().view(3 * s.num_heads, s.head_dim, -1), ord=2).pow(2).sum()) for s in sites),
        "max σ1 Linear": max(float(torch.linalg.matrix_norm(m.weight.detach(), ord=2))
                             for m in net.modules() if isinstance(m, torch.nn.Linear)),
        "max ‖W‖ RMS (hidden)": max(rms_norm(p.detach().double()) for p in hidden_matrices(net)),
    }


ATTACKS = [AttackSpec("fgsm", "Linf", 2 / 255), AttackSpec("fgsm", "Linf", 8 / 255),
           AttackSpec("pgd", "Linf", 2 / 255), AttackSpec("pgd", "Linf", 8 / 255),
           AttackSpec("autoattack", "Linf", 2 / 255)]


def measure_robustness(network: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    local = jacobian_norm(network, images, method="exact")
    bound, _ = certified_bound(network)
    values = {"local mean": float(local.mean()), "local max": float(local.max()),
              "certified log10": f"{math.log10(bound.value):.1f}" if bound else "none"}
    values.update(robust_accuracy(network, images, labels, ATTACKS, num_classes=10, pgd_steps=10, seed=0))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs_dir", default="runs/stabilizers_digits")
    parser.add_argument("--out", default="results/stabilizers_digits.md")
    parser.add_argument("--attack_points", type=int, default=128)
    args = parser.parse_args()
    data = Digits()
    data.setup()
    images = data.val_set.tensors[0]
    rows = []
    for index, (label, extra) in enumerate(RUNS):
        runs_dir = f"{args.runs_dir}/{index}"
        command = [sys.executable, "-m", "stability", "fit", "--config", "configs/vit_digits.yaml", *extra,
                   "--trainer.max_epochs", str(args.epochs), "--seed_everything", str(args.seed),
                   "--runs_dir", runs_dir, "--trainer.enable_progress_bar", "false"]
        start = time.time()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode not in (0, exit_codes.DIVERGED):
            raise RuntimeError(f"{label}: stability fit failed:\n{done.stderr[-2000:]}")
        if done.returncode == exit_codes.DIVERGED:  # a result, recorded as such
            label += " (diverged)"
        seconds = time.time() - start
        ckpt = max((ROOT / runs_dir).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
        module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu").eval()
        with torch.no_grad():
            accuracy = float((module(images).argmax(-1) == data.val_set.tensors[1]).float().mean())
        rows.append((label, accuracy, measure(module.network, images), seconds,
                     measure_robustness(module.network, images[:args.attack_points],
                                        data.val_set.tensors[1][:args.attack_points])))
        print(f"{label}: val acc {accuracy:.3f} ({seconds:.0f} s)", flush=True)
    keys = list(rows[0][2])
    lines = [f"# Stabilizers on digits (micro ViT, {args.epochs} epochs, seed {args.seed})", "",
             f"Made by `python experiments/stabilizers_digits.py --epochs {args.epochs} --seed {args.seed} "
             f"--attack_points {args.attack_points}` on a 2-core CPU. Quantities are measured on the final "
             "weights and the 270 validation images; val accuracy on the same images.", "",
             "| stabilizer | val acc | " + " | ".join(keys) + " | fit time (s) |",
             "|---" * (len(keys) + 3) + "|"]
    for label, accuracy, values, seconds, _ in rows:
        lines.append(f"| {label} | {accuracy:.3f} | " + " | ".join(f"{values[k]:.4g}" for k in keys)
                     + f" | {seconds:.0f} |")
    robust_keys = list(rows[0][4])
    lines += ["", f"Lipschitz and robustness on the first {args.attack_points} validation images: local = exact "
              "‖J(x)‖₂ of input→logits in pixel units; certified = the composed global bound where one exists "
              "(LipsFormer on ViT; the Lipschitz-transformer ViT, on [0, 1]ⁿ), else none; accuracies are fractions; "
              "AutoAttack is torchattacks' version.", "",
              "| stabilizer | " + " | ".join(robust_keys) + " |", "|---" * (len(robust_keys) + 1) + "|"]
    for label, _, _, _, robust in rows:
        lines.append(f"| {label} | " + " | ".join(v if isinstance(v, str) else f"{v:.4g}" for v in robust.values())
                     + " |")
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
