"""Accuracy of the cheap estimators against exact references.

    python benchmarks/estimator_accuracy.py
    python benchmarks/estimator_accuracy.py --device cuda

1. Local Lipschitz: power iteration (k iterations) against the exact ‖J_f(x)‖₂ (the full Jacobian
   from one VJP per logit, then its SVD) on validation points of a micro ViT trained on digits.
   Power iteration approaches σ₁ from below, so every relative error is ≤ 0.
2. Specformer: its persistent power iteration (one step per training step, vectors kept in the
   state dict) against the exact σ₁ of every head block (SVD), over a Specformer training run.
"""
from __future__ import annotations

import torch
from common import arguments, build_module, digits, markdown, setup, train_epochs, train_step, write

from stability.lipschitz import jacobian_norm
from stability.models import attention_sites
from stability.stabilizers.specformer import PARTS, head_blocks


def power_vs_exact(device, epochs: int, points: int, iteration_counts: list[int]) -> str:
    loader, images, _ = digits(16, 64, device)
    module, optimizer = build_module("vit", "micro", "none", image_size=16, device=device, in_chans=1, lr=2e-3)
    train_epochs(module, optimizer, loader, epochs, device)
    module.eval()
    images = images[:points]
    exact = jacobian_norm(module.network, images, method="exact")
    rows = []
    for iterations in iteration_counts:
        estimate = jacobian_norm(module.network, images, iterations)
        error = (estimate - exact) / exact
        rows.append([iterations, float(error.mean()), float(error.min()), float(error.max()),
                     f"{float((error.abs() <= 0.01).float().mean()):.0%}"])
    return (f"Micro ViT trained {epochs} epochs on digits at 16×16; {points} validation points; exact norm "
            f"mean {float(exact.mean()):.3g}, max {float(exact.max()):.3g}. "
            "Relative error (estimate − exact)/exact:\n\n"
            + markdown(["power iterations", "mean error", "worst error", "max error", "points within 1%"], rows))


def specformer_tracking(device, epochs: int, every: int) -> str:
    loader, _, _ = digits(16, 64, device)
    module, optimizer = build_module("vit", "micro", "specformer", {"lam_q": 1e-2, "lam_k": 1e-2, "lam_v": 1e-2},
                                     image_size=16, device=device, in_chans=1, lr=2e-3)
    specformer = module.stabilizers[0]
    rows, step = [], 0
    for _ in range(epochs):
        for images, labels in loader:
            train_step(module, optimizer, images.to(device), labels.to(device))
            step += 1
            if step % every == 0 or step == 1:
                with torch.no_grad():
                    estimates = specformer.sigmas(module.network, update=False)
                    errors = []
                    for i, site in enumerate(attention_sites(module.network)):
                        for part in PARTS:
                            blocks = head_blocks(site.qkv.weight, part, site.num_heads, specformer.blocks)
                            exact = torch.linalg.matrix_norm(blocks.float(), ord=2)
                            errors.append((estimates[part][i].float() - exact) / exact)
                    errors = torch.cat(errors)
                rows.append([step, float(errors.mean()), float(errors.min()), float(errors.max())])
    heads = sum(s.num_heads for s in attention_sites(module.network)) * len(PARTS)
    return (f"Micro ViT with Specformer (λ = 1e-2 on Q, K, V; one power-iteration step per training step), "
            f"trained on digits at 16×16; after each listed step, the estimate σ = uᵀWv of each of the {heads} "
            f"head blocks against its exact σ₁ (relative error):\n\n"
            + markdown(["training step", "mean error", "worst (most negative)", "max"], rows))


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--points", type=int, default=64)
    args = p.parse_args()
    device = setup(args)
    counts, every = [1, 2, 5, 10, 20, 50], 20
    if args.quick:
        args.epochs, args.points, counts, every = 1, 4, [1, 5], 10
    body = ("## Local Lipschitz: power iteration vs exact Jacobian norm\n\n"
            + power_vs_exact(device, args.epochs, args.points, counts)
            + "\n\n## Specformer: persistent power iteration vs exact σ₁ over training\n\n"
            + specformer_tracking(device, args.epochs, every))
    write("estimator_accuracy", args, device, "Accuracy of the cheap estimators", body)


if __name__ == "__main__":
    main()
