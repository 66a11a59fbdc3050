"""Train the micro ViT with each stabilizer (same seed, same epochs) and tabulate, on the trained
weights and the test split:

1. test accuracy next to the quantity each stabilizer controls (on the first ``attack_points``);
2. local Lipschitz estimates (mean / max of the exact ‖J(x)‖₂, first ``attack_points``), the certified
   global bound where one exists (with its tightness and the Lipschitz transformer's paper bound), FGSM /
   PGD-10 accuracy and their worst case on the first ``attack_points``, the official AutoAttack on the
   first ``--autoattack_points``, and certified accuracy at ℓ2 radii on the whole test split.

    python experiments/stabilizers_table.py --data digits --epochs 30    # → results/stabilizers_digits.md
    python experiments/stabilizers_table.py --data mnist                 # → results/stabilizers_mnist.md

Runs go to runs/stabilizers_<data>/ (not committed); rerunning the script keeps the fits that finished
(same command) and measures everything again.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from stability import exit_codes
from stability.classifier import ImageClassifier
from stability.data import MNIST, Digits
from stability.lipschitz import jacobian_norm
from stability.lipschitz.certified import certified_bound
from stability.lipschitz.transformer_bounds import NotALipschitzTransformer, paper_bound
from stability.machine import describe
from stability.models import attention_sites, capture_attention, linear_layers
from stability.nn.constraints import rms_norm
from stability.nn.softmax_bounds import g_k
from stability.robustness import AttackSpec, certified_at, certified_radii, robust_accuracy

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
    ("muon soft cap ‖W‖≤1 (hidden)", ["--config", "configs/stabilizer/muon.yaml"]),
    ("lipschitz transformer σ_max=1", ["--config", "configs/stabilizer/lipschitz_transformer.yaml"]),
    ("lipschitz transformer σ_max=1, s=1", ["--config", "configs/stabilizer/lipschitz_transformer.yaml",
                                            "--lipschitz_transformer.attention_scale", "1"]),
    ("lipsformer + jasmin", ["--config", "configs/stabilizer/lipsformer_jasmin.yaml"]),
]
DATASETS = {  # config, epochs, points attacked, ℓ∞ / ℓ2 budgets of FGSM / PGD, AutoAttack's, certified ℓ2 radii
    "digits": dict(config="configs/vit_digits.yaml", epochs=30, attack_points=270, eps=(2 / 255, 8 / 255),
                   l2_eps=(), autoattack=("Linf", 2 / 255), autoattack_points=100, radii=(0.05, 0.1, 0.25)),
    "mnist": dict(config="configs/vit_mnist.yaml", epochs=6, attack_points=1000,
                  eps=(2 / 255, 4 / 255, 0.1, 0.3), l2_eps=(0.5, 1.0, 1.58), autoattack=("Linf", 0.1),
                  autoattack_points=200, radii=(0.1, 0.3, 0.5, 1.0, 1.58)),
}


def controlled(net: torch.nn.Module, images: torch.Tensor) -> dict[str, float]:
    with torch.no_grad(), capture_attention(net.backbone) as probs:
        net(images)
    sites = attention_sites(net)
    return {
        "mean g1": float(torch.stack([g_k(p, 1).mean() for p in probs]).mean()),
        "Σσ1² QKV heads": sum(float(torch.linalg.matrix_norm(
            s.qkv.weight.detach().view(3 * s.num_heads, s.head_dim, -1), ord=2).pow(2).sum()) for s in sites),
        "max σ1 Linear": max(float(torch.linalg.matrix_norm(m.weight.detach(), ord=2))
                             for m in linear_layers(net, "all")),
        "max ‖W‖ RMS (every matrix)": max(rms_norm(m.weight.detach().double()) for m in linear_layers(net, "all")),
    }


def test_tensors(data) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole test split as [0, 1] images and labels, in the data module's order."""
    data.setup("test")
    batches = list(data.test_dataloader())
    return torch.cat([b[0] for b in batches]).float(), torch.cat([b[1] for b in batches])


def predict(network: torch.nn.Module, images: torch.Tensor, batch: int = 1000) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([network(chunk) for chunk in images.split(batch)])


def robustness(network: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, setting: dict,
               autoattack_points: int) -> dict[str, float | str]:
    attacked, attacked_labels = images[:setting["attack_points"]], labels[:setting["attack_points"]]
    local = jacobian_norm(network, attacked, method="exact")
    bound, _ = certified_bound(network)
    try:
        paper = f"{math.log10(paper_bound(network)):.1f}"
    except NotALipschitzTransformer:
        paper = "—"
    values: dict[str, float | str] = {
        "local mean": float(local.mean()), "local max": float(local.max()),
        "certified log10": f"{math.log10(bound.value):.1f}" if bound else "none",
        "tightness": f"{bound.value / float(local.max()):.2g}" if bound else "—", "paper bound log10": paper}
    budgets = [("Linf", eps) for eps in setting["eps"]] + [("L2", eps) for eps in setting["l2_eps"]]
    attacks = [AttackSpec(kind, norm, eps) for norm, eps in budgets for kind in ("fgsm", "pgd")]
    results = robust_accuracy(network, attacked, attacked_labels, attacks, num_classes=10, pgd_steps=10, seed=0)
    values.update({k: v for k, v in results.items() if not k.startswith("worst")})
    for norm, key in (("Linf", "eps"), ("L2", "l2_eps")):  # the worst case at each norm's largest budget
        if setting[key]:
            worst = f"worst_{AttackSpec('pgd', norm, max(setting[key])).budget}"
            values[worst] = results[worst]
    norm, eps = setting["autoattack"]
    official = robust_accuracy(network, images[:autoattack_points], labels[:autoattack_points],
                               [AttackSpec("autoattack", norm, eps)], num_classes=10, seed=0)
    values[f"clean (first {autoattack_points})"] = official["clean"]
    values.update({k: v for k, v in official.items() if k.startswith("autoattack")})
    radii = certified_radii(predict(network, images), labels, bound) if bound else None
    for radius in setting["radii"]:
        values[f"cert L2_{radius:g}"] = float(certified_at(radii, radius).float().mean()) if bound else "—"
    return values


def write_table(rows: list, args: argparse.Namespace, setting: dict, epochs: int, started_all: float,
                labels: torch.Tensor, out: Path) -> None:
    """Write the Markdown table of the rows measured so far (after every row: an interrupted run keeps them)."""
    keys = list(rows[0][2])
    minutes = (time.time() - started_all) / 60
    points, total = setting["attack_points"], len(labels)
    command = (f"python experiments/stabilizers_table.py --data {args.data} --epochs {epochs} --seed {args.seed} "
               f"--autoattack_points {args.autoattack_points}")
    lines = [f"# Stabilizers on {args.data} (micro ViT, {epochs} epochs, seed {args.seed})", "",
             f"Made by `{command}` on {describe(args.device)} in {minutes:.0f} min. One seed: differences of a few "
             "points of accuracy between rows are within seed-to-seed spread (see the studies for several seeds). "
             f"Test accuracy is on all {total} test images; the controlled quantities on the first {points}.", "",
             "| stabilizer | test acc | " + " | ".join(keys) + " | fit time (s) |",
             "|---" * (len(keys) + 3) + "|"]
    for label, accuracy, values, seconds, _, _ in rows:
        lines.append(f"| {label} | {accuracy:.3f} | " + " | ".join(f"{values[k]:.4g}" for k in keys)
                     + f" | {seconds:.0f} |")
    robust_keys = list(rows[0][4])
    lines += ["", f"Lipschitz and robustness: local = exact ‖J(x)‖₂ of input→logits in pixel units on the first "
              f"{points} test images; certified = log10 of the composed global bound where one exists (LipsFormer "
              "on ViT; spectral normalisation; the Lipschitz transformer, on [0, 1]ⁿ), tightness = that bound over "
              "the largest local value, paper bound = the Lipschitz transformer's bound as its paper composes it "
              "(per-token RMS norms, not a pixel-space certificate); FGSM / PGD-10 (torchattacks) and their "
              f"worst case at each norm's largest budget on the first {points}; the official AutoAttack (standard "
              f"version) at {setting['autoattack'][0]} {setting['autoattack'][1]:.4g} on the first "
              f"{args.autoattack_points}, with the clean "
              f"accuracy on those; certified accuracy at ℓ2 radii on all {total} test images from the certified "
              "bound; accuracies are fractions; measurement time in seconds.", "",
              "| stabilizer | " + " | ".join(robust_keys) + " | measurement time (s) |",
              "|---" * (len(robust_keys) + 2) + "|"]
    for label, _, _, _, robust, seconds in rows:
        lines.append(f"| {label} | " + " | ".join(v if isinstance(v, str) else f"{v:.4g}" for v in robust.values())
                     + f" | {seconds:.0f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=sorted(DATASETS), default="digits")
    parser.add_argument("--epochs", type=int, help="default: the data set's (digits 30, mnist 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--autoattack_points", type=int, help="default: the data set's (digits 100, mnist 200)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the checkpoints are measured (default: the GPU where there is one)")
    args = parser.parse_args()
    setting = DATASETS[args.data]
    args.autoattack_points = args.autoattack_points or setting["autoattack_points"]
    epochs = args.epochs or setting["epochs"]
    runs_root, out = f"runs/stabilizers_{args.data}", ROOT / f"results/stabilizers_{args.data}.md"
    data = Digits() if args.data == "digits" else MNIST(root=str(ROOT / "data"))
    images, labels = (t.to(args.device) for t in test_tensors(data))
    rows, started_all = [], time.time()
    for index, (label, extra) in enumerate(RUNS):
        runs_dir = f"{runs_root}/{index}"
        command = [sys.executable, "-m", "stability", "fit", "--config", setting["config"], *extra,
                   "--trainer.max_epochs", str(epochs), "--seed_everything", str(args.seed),
                   "--runs_dir", runs_dir, "--trainer.enable_progress_bar", "false",
                   "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0"]
        marker = ROOT / runs_dir / "fit.json"  # a finished fit: a rerun of the script measures it again, not refits
        finished = json.loads(marker.read_text()) if marker.is_file() else {}
        if finished.get("command") == command[1:]:
            returncode, seconds = finished["returncode"], finished["seconds"]
        else:
            shutil.rmtree(ROOT / runs_dir, ignore_errors=True)
            start = time.time()
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode not in (0, exit_codes.DIVERGED):
                raise RuntimeError(f"{label}: stability fit failed:\n{done.stderr[-2000:]}")
            returncode, seconds = done.returncode, time.time() - start
            marker.write_text(json.dumps({"command": command[1:], "returncode": returncode, "seconds": seconds}))
        if returncode == exit_codes.DIVERGED:  # a result, recorded as such
            label += " (diverged)"
        ckpt = max((ROOT / runs_dir).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
        network = ImageClassifier.load_from_checkpoint(ckpt, map_location=args.device).eval().network
        accuracy = float((predict(network, images).argmax(-1) == labels).float().mean())
        measured = time.time()
        robust = robustness(network, images, labels, setting, args.autoattack_points)
        rows.append((label, accuracy, controlled(network, images[:setting["attack_points"]]), seconds, robust,
                     time.time() - measured))
        print(f"{label}: test acc {accuracy:.3f} (fit {seconds:.0f} s, measurements {rows[-1][5]:.0f} s)",
              flush=True)
        write_table(rows, args, setting, epochs, started_all, labels, out)
    print(out.read_text())


if __name__ == "__main__":
    main()
