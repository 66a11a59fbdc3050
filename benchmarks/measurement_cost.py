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
case). Target: the local estimate costs ≤ 2 × iterations + 1 training steps per batch of points. The exact norm is
also timed in one pass over 10 copies of each point (:func:`stability.lipschitz.jacobian_norm_one_pass`). ``--compile``
adds the attacks (``--robustness.compile``), the one-pass exact norm and the lower bound (``--lipschitz.compile``)
through the network compiled at their batch's shape, compiled before timing.

``--count`` counts instead of timing (stability/testing/gpu_model.py): the kernel-launching operators and the reads
back to the host of each measurement per point, on points measured one at a time and in one batch of ``--batch``.
On a GPU a small network's measurement is launch-bound, so the ratio of the two is what batching saves there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from common import arguments, build_module, digits, interleaved, markdown, setup, train_epochs, train_step, write

from stability.lipschitz import empirical_lower_bound, jacobian_norm, jacobian_norm_one_pass
from stability.lipschitz.attention import attention_diagnostics
from stability.lipschitz.certified import certified_bound
from stability.robustness import AttackSpec, certified_radii, robust_accuracy
from stability.robustness.attacks import evaluating, frozen_weights, gradients_allowed
from stability.robustness.fixed_batch import FixedBatch, attacked_network
from stability.testing.gpu_model import count


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
    p.add_argument("--count", action="store_true",
                   help="count launches and host reads per point, one point at a time and batched (no timing)")
    p.add_argument("--count_points", type=int, default=4, help="--count: points measured one at a time")
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

    if args.count:
        write("measurement_cost", args, device, "Launches per measured point, one at a time and batched",
              count_table(network, transformer.network, images, labels, args))
        return

    cases = {"training step": lambda: train_step(module, optimizer, images, labels, args.precision)}
    cases.update({name: (lambda f=f: f(images, labels)) for name, f in
                  measurements(network, transformer.network, iters, args.batch).items()})
    cases.pop("attention diagnostics")
    cases["attention diagnostics (16 points)"] = lambda: attention_diagnostics(network, images[:16])
    if compiled is not None:
        network.eval()
        compiled.warm_up(images)  # the compilation is paid once per run, not timed here
        cases["FGSM, compiled"] = attack("fgsm", args.batch, through=compiled)
        cases["PGD-10, compiled"] = attack("pgd", args.batch, through=compiled)
        # --lipschitz.compile's passes: its wrappers, compiled in eval mode with the weights frozen, as it runs them
        one_pass = FixedBatch(network, 10 * args.batch, compile=True, graphs=("input",))  # 10 classes
        ascent = FixedBatch(network, args.batch, compile=True, graphs=("no_grad", "input"))
        with evaluating(network), frozen_weights(network):
            one_pass.warm_up(images.repeat_interleave(10, dim=0))
            ascent.warm_up(images)

        def frozen(measure):
            def run():
                with gradients_allowed(), evaluating(network), frozen_weights(network):
                    return measure()
            return run

        cases["local Lipschitz, exact in one pass, compiled"] = frozen(lambda: jacobian_norm_one_pass(one_pass, images,
                                                                                                      10))
        cases["empirical lower bound, compiled"] = frozen(lambda: empirical_lower_bound(ascent, images))
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


def measurements(network: torch.nn.Module, transformer: torch.nn.Module, iterations: int,
                 batch: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    """Each measurement of the points (x, y), as the monitors call it (the certified ones on the Lipschitz-transformer
    ViT ``transformer``; attacks ℓ∞ 8/255 in batches of ``batch``)."""
    def attack(name: str, steps: int = 10):
        spec = AttackSpec(name, "Linf", 8 / 255)
        return lambda x, y: robust_accuracy(network, x, y, [spec], 10, pgd_steps=steps, batch_size=batch)

    def certified_accuracy(x, y):
        bound, _ = certified_bound(transformer)
        with torch.no_grad():
            return certified_radii(transformer(x), y, bound)

    return {
        "local Lipschitz, power, 1 iteration": lambda x, y: jacobian_norm(network, x, 1),
        f"local Lipschitz, power, {iterations} iterations": lambda x, y: jacobian_norm(network, x, iterations),
        "local Lipschitz, exact (one VJP per logit)": lambda x, y: jacobian_norm(network, x, method="exact"),
        "local Lipschitz, exact in one pass (10 copies a point)": lambda x, y: jacobian_norm_one_pass(network, x, 10),
        "empirical lower bound (10 ascent steps)": lambda x, y: empirical_lower_bound(network, x),
        "certified bound (Lipschitz-transformer ViT)": lambda x, y: certified_bound(transformer),
        "certified accuracy (bound + radii)": certified_accuracy,
        "attention diagnostics": lambda x, y: attention_diagnostics(network, x),
        "FGSM": attack("fgsm"),
        "PGD-10": attack("pgd"),
    }


def count_table(network: torch.nn.Module, transformer: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                args) -> str:
    """Launches and host reads per point of each measurement: the first ``--count_points`` points one at a time,
    and the first ``--batch`` points in one call. The certified bound reads no points: its row is per call."""
    network.eval()
    alone = args.count_points
    rows = []
    for name, measure in measurements(network, transformer, args.iterations, args.batch).items():
        single = [count(lambda i=i, f=measure: f(images[i:i + 1], labels[i:i + 1])) for i in range(alone)]
        batched = count(lambda f=measure: f(images, labels))
        per_point = sum(c.launches for c in single) / alone
        reads = sum(c.syncs for c in single) / alone
        if name.startswith("certified bound"):  # per call: the bound does not read the points
            rows.append([name, f"{per_point:.0f}", f"{reads:.0f}", f"{batched.launches:.0f}",
                         f"{batched.syncs:.0f}", "1.0 (per call)"])
            continue
        rows.append([name, f"{per_point:.0f}", f"{reads:.1f}", f"{batched.launches / len(images):.1f}",
                     f"{batched.syncs / len(images):.2f}", f"{per_point / (batched.launches / len(images)):.1f}"])
    return (f"Micro ViT at {images.shape[-1]}×{images.shape[-1]} ({args.tokens} tokens), trained {args.train_epochs} "
            f"epochs on digits, float32, eval mode; each measurement counted on the CPU by the operators that launch a "
            f"kernel on a GPU (views and allocations not counted) and the reads back to the host (`.item()`, "
            f"`.tolist()`, nonzero, …): per point on {alone} points one at a time, and per point on {len(images)} "
            f"points in one call (attacks in batches of {args.batch}). `fewer launches` is the ratio of the two, what "
            f"batching saves where launches set the time. Attacks stop early on misclassified points, so a point's "
            f"count depends on the model.\n\n"
            + markdown(["measurement", "launches / point, one at a time", "host reads / point, one at a time",
                        f"launches / point, batch of {len(images)}", f"host reads / point, batch of {len(images)}",
                        "fewer launches"], rows))


if __name__ == "__main__":
    main()
