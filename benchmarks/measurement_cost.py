"""Cost of each measurement per point — as throughput (points / s) and in training steps of the same
model and batch.

    python benchmarks/measurement_cost.py                  # micro ViT on digits at 16×16 (64 tokens), batch 64
    python benchmarks/measurement_cost.py --device cuda --batch 256

Local Lipschitz power iteration (per batch, per point, per iteration: the difference between the 10-
and 1-iteration runs over 9), the exact Jacobian norm, the empirical lower bound, the certified bound
and certified accuracy (the Lipschitz-transformer ViT), attention diagnostics, FGSM / PGD-10 and
AutoAttack — the official one (pyautoattack, standard version) and torchattacks' — per point, on a
model trained for ``--train_epochs`` first (attacks stop early on points already misclassified, so an
untrained model would flatter them; AutoAttack at ε = 2/255, where most points resist, its costly
case). Target: the local estimate costs ≤ 2 × iterations + 1 training steps per batch of points. ``--compile`` adds
the attacks through the network compiled at the batch's shape (``--robustness.compile``), compiled before timing.
"""
from __future__ import annotations

import torch
from common import arguments, build_module, digits, interleaved, markdown, setup, train_epochs, train_step, write

from stability.lipschitz import empirical_lower_bound, jacobian_norm
from stability.lipschitz.attention import attention_diagnostics
from stability.lipschitz.certified import certified_bound
from stability.robustness import AttackSpec, certified_radii, robust_accuracy
from stability.robustness.fixed_batch import attacked_network


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="points per measurement batch = training batch")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--autoattack_points", type=int, default=32, help="AutoAttack is slow: fewer points")
    p.add_argument("--train_epochs", type=int, default=5, help="train on digits first")
    p.add_argument("--compile", action="store_true",
                   help="also FGSM, PGD-10 and the official AutoAttack through the network compiled at the batch's "
                        "shape (--robustness.compile; compiled before timing)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="of the training step the measurements are compared with (they run in float32 either way)")
    args = p.parse_args()
    device = setup(args)
    if args.quick:
        args.batch, args.tokens, args.iterations, args.repeats, args.autoattack_points = 4, 16, 2, 1, 0
        args.train_epochs = 0
    image_size = 2 * int(args.tokens ** 0.5)  # micro ViT: patch 2
    loader, images, labels = digits(image_size, args.batch, device)
    images, labels = images[:args.batch], labels[:args.batch]
    module, optimizer = build_module("vit", "micro", "none", image_size=image_size, device=device, in_chans=1,
                                     lr=2e-3)
    train_epochs(module, optimizer, loader, args.train_epochs, device)
    transformer, _ = build_module("vit", "micro", "lipschitz_transformer", image_size=image_size, device=device,
                                  in_chans=1)
    network = module.network
    iters = args.iterations

    compiled = attacked_network(network, args.batch, compile=True) if args.compile else None

    def attack(name: str, points: int, eps: float = 8 / 255, steps: int = 10, through: torch.nn.Module = network):
        spec = AttackSpec(name, "Linf", eps)
        return lambda: robust_accuracy(through, images[:points], labels[:points], [spec], 10, pgd_steps=steps,
                                       batch_size=args.batch)

    def certified_accuracy():
        bound, _ = certified_bound(transformer.network)
        with torch.no_grad():
            return certified_radii(transformer.network(images), labels, bound)

    cases = {
        "training step": lambda: train_step(module, optimizer, images, labels, args.precision),
        "local Lipschitz, power, 1 iteration": lambda: jacobian_norm(network, images, 1),
        f"local Lipschitz, power, {iters} iterations": lambda: jacobian_norm(network, images, iters),
        "local Lipschitz, exact (one VJP per logit)": lambda: jacobian_norm(network, images, method="exact"),
        "empirical lower bound (10 ascent steps)": lambda: empirical_lower_bound(network, images),
        "certified bound (Lipschitz-transformer ViT)": lambda: certified_bound(transformer.network),
        "certified accuracy (bound + radii)": certified_accuracy,
        "attention diagnostics (16 points)": lambda: attention_diagnostics(network, images[:16]),
        "FGSM": attack("fgsm", args.batch),
        "PGD-10": attack("pgd", args.batch),
    }
    if compiled is not None:
        network.eval()
        compiled.warm_up(images)  # the compilation is paid once per run, not timed here
        cases["FGSM, compiled"] = attack("fgsm", args.batch, through=compiled)
        cases["PGD-10, compiled"] = attack("pgd", args.batch, through=compiled)
    seconds = interleaved(cases, device, args.repeats, warmup=1)
    network.eval()
    aa = {"AutoAttack official (standard, 2/255)": ("autoattack", network),
          "AutoAttack torchattacks (2/255)": ("autoattack_tap", network)}
    if compiled is not None and args.autoattack_points:  # at AutoAttack's own batch: its points
        aa_compiled = attacked_network(network, min(args.batch, args.autoattack_points), compile=True)
        aa_compiled.warm_up(images)
        aa["AutoAttack official (standard, 2/255), compiled"] = ("autoattack", aa_compiled)
    if args.autoattack_points:  # --quick skips them: on an untrained, nearly constant model they run every query
        for label, (name, through) in aa.items():
            seconds[label] = interleaved({"aa": attack(name, args.autoattack_points, 2 / 255, through=through)},
                                         device, 1, warmup=0)["aa"]
    points = {"attention diagnostics (16 points)": min(16, args.batch), "certified bound (Lipschitz-transformer ViT)":
              None, "training step": args.batch, **{label: args.autoattack_points for label in aa}}
    step = seconds["training step"]
    per_iteration = (seconds[f"local Lipschitz, power, {iters} iterations"]
                     - seconds["local Lipschitz, power, 1 iteration"]) / max(iters - 1, 1)
    rows = []
    for name, value in seconds.items():
        n = points.get(name, args.batch)
        target = ""
        if name == f"local Lipschitz, power, {iters} iterations":
            limit = 2 * iters + 1
            target = f"≤ {limit} steps: " + ("met" if value / step <= limit else
                                              f"missed by {100 * (value / step / limit - 1):.1f}%")
        rows.append([name, 1000 * value, n if n else "—", 1000 * value / n if n else float("nan"),
                     n / value if n else float("nan"), f"{value / step:.2f}",
                     f"{value / n / (step / args.batch):.2f}" if n else "—", target])
    rows.append(["local Lipschitz, per power iteration", 1000 * per_iteration, args.batch,
                 1000 * per_iteration / args.batch, args.batch / per_iteration, f"{per_iteration / step:.2f}",
                 f"{per_iteration / step:.2f}", ""])
    body = (f"Micro ViT trained {args.train_epochs} epochs on digits at {image_size}×{image_size} ({args.tokens} "
            f"tokens), batch {args.batch}, training step in {args.precision} (the measurements run in float32 whatever "
            f"the training precision); median of {args.repeats} interleaved runs "
            f"(AutoAttack: one run on {args.autoattack_points} points). `× training step`: time / one training step on "
            f"the same batch; `step-equivalents / point`: time per point / training time per point.\n\n"
            + markdown(["measurement", "ms", "points", "ms / point", "points / s", "× training step",
                        "step-equivalents / point", "target"], rows))
    write("measurement_cost", args, device, "Cost of each measurement", body)


if __name__ == "__main__":
    main()
