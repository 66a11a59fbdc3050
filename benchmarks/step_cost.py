"""Training-step time and memory of every stabilizer as a ratio to the baseline step: same model,
batch, seed and precision, one process, the stabilizers taking turns (interleaved) so machine noise cancels.

    python benchmarks/step_cost.py                       # ViT-Ti, Swin-T, CSwin-T × 64, 256 tokens, batch 64, fp32
    python benchmarks/step_cost.py --device cuda         # batch 256, fp32 and bf16 (autocast, as bf16-mixed)
    python benchmarks/step_cost.py --backbones vit --sizes micro --tokens 64 --repeats 3

Every registered stabilizer has a row (tests/test_benchmarks.py), and timm's own ``qk_norm=True`` one for comparison.
Targets: specformer, qk_norm and sigma_reparam ≤ 1.10×, spectral_norm ≤ 1.15× (from the initialisation and at the
cap), lipsformer and softcap ≤ 1.20×, muon soft cap and hard cap ≤ 1.30× over plain Muon, jasmin ≤ 1.25× on CPU
(≤ 1.3× on GPU at 256 tokens).
"spectral_norm project, at the cap" starts from weights with σ₁ = σ_max (every weight is scaled every step:
the steady state of a run whose weights reached the cap); the plain row starts from the initialisation.
Its exact check (every ``check_every`` = 100 steps) is timed on its own and shown amortised per step.
Rows marked "exact" are the SVD / eigensolver versions, for comparison. Memory is measured after a warm-up step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from common import (
    arguments,
    build_module,
    interleaved,
    markdown,
    memory_label,
    peak_memory,
    setup,
    time_once,
    train_step,
    write,
)

from stability.models.registry import PRESETS


@dataclass(frozen=True)
class Case:
    label: str
    stabilizer: str
    options: dict | None = None
    reference: str = "none"           # the case its ratio is taken against
    target: float | None = None    # on CPU; GPU targets in gpu_target
    gpu_target: float | None = None
    vit_only: bool = False
    at_cap: bool = False          # start from weights at the cap (σ₁ = σ_max = 1)
    backbone_options: dict | None = None  # e.g. timm's own qk_norm, for comparison


CASES = [
    Case("none", "none"),
    Case("jasmin k=10", "jasmin", {"lam": 1e-2, "k": 10}, target=1.25, gpu_target=1.3),
    Case("jasmin k=10, streamed", "jasmin", {"lam": 1e-2, "k": 10, "row_statistics": "streamed"}, vit_only=True),
    Case("jasmin k=10, materialized", "jasmin", {"lam": 1e-2, "k": 10, "row_statistics": "materialized"},
         vit_only=True),
    Case("specformer", "specformer", {"lam_q": 1e-2, "lam_k": 1e-2, "lam_v": 1e-2}, target=1.10, gpu_target=1.10),
    Case("spectral_norm project", "spectral_norm", {"mode": "project"}, target=1.15, gpu_target=1.15),
    Case("spectral_norm project, at the cap", "spectral_norm", {"mode": "project"}, target=1.15, gpu_target=1.15,
         at_cap=True),
    Case("spectral_norm project, exact", "spectral_norm", {"mode": "project", "method": "exact"}),
    Case("spectral_norm project, exact, at the cap", "spectral_norm", {"mode": "project", "method": "exact"},
         at_cap=True),
    Case("spectral_norm parametrize", "spectral_norm", {"mode": "parametrize"}, target=1.15, gpu_target=1.15),
    Case("lipsformer", "lipsformer", target=1.20, gpu_target=1.20),
    Case("muon (no constraint)", "muon", {"constraint": "none"}),
    Case("muon soft_cap", "muon", {"constraint": "soft_cap"}, reference="muon (no constraint)", target=1.30,
         gpu_target=1.30),
    Case("muon soft_cap, measured update", "muon", {"constraint": "soft_cap", "update_norm": "measured"},
         reference="muon (no constraint)"),
    Case("muon hard_cap", "muon", {"constraint": "hard_cap"}, reference="muon (no constraint)", target=1.30,
         gpu_target=1.30),
    Case("muon hard_cap, exact", "muon", {"constraint": "hard_cap", "method": "exact"},
         reference="muon (no constraint)"),
    Case("qk_norm", "qk_norm", target=1.10, gpu_target=1.10),
    Case("timm qk_norm=True", "none", vit_only=True, backbone_options={"qk_norm": True}),
    Case("softcap", "softcap", target=1.20, gpu_target=1.20),
    Case("sigma_reparam", "sigma_reparam", target=1.10, gpu_target=1.10),
    Case("z_loss", "z_loss"),
    Case("tau_ce", "tau_ce"),
    Case("lipschitz_transformer + muon hard_cap", "lipschitz_transformer,muon", vit_only=True),
    Case("lipschitz_transformer + muon + lipschitz_margin", "lipschitz_transformer,muon,lipschitz_margin",
         vit_only=True),
    Case("lipschitz_transformer + muon + gloro", "lipschitz_transformer,muon,gloro", vit_only=True),
    Case("lipschitz_transformer + muon + emma", "lipschitz_transformer,muon,emma", vit_only=True),
]
CHECK_EVERY = 100  # spectral_norm's default check_every


def geometry(backbone: str, size: str, tokens: int) -> tuple[int, dict]:
    """Image size giving ``tokens`` first-stage tokens, and window / stripe options that fit it."""
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise SystemExit(f"--tokens {tokens}: need a square number of tokens")
    image_size = side * PRESETS[backbone][size]["patch_size"]
    options = {}
    if backbone == "swin":
        options["window_size"] = min(8, side // 2)
    return image_size, options


@torch.no_grad()
def put_weights_at_the_cap(module) -> None:
    """Scale every Linear weight to σ₁ = 1 (the spectral_norm cap): each step then scales every weight."""
    stab = module.stabilizers[0]
    for m in module.network.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.mul_(1.0 / float(torch.linalg.matrix_norm(m.weight.double(), ord=2)))
    stab._previous = None  # method exact: its certified bounds are stale now


def verdict(ratio: float, target: float | None) -> str:
    if target is None or math.isnan(ratio):
        return ""
    return "met" if ratio <= target else f"missed by {100 * (ratio / target - 1):.1f}%"


def measure(backbone: str, size: str, tokens: int, batch: int, device: torch.device, repeats: int,
            precision: str) -> list[list]:
    image_size, options = geometry(backbone, size, tokens)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, image_size, image_size, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    cases = [c for c in CASES if backbone == "vit" or not c.vit_only]
    steps, memory, modules = {}, {}, {}
    for case in cases:
        module, optimizer = build_module(backbone, size, case.stabilizer, case.options, image_size=image_size,
                                         device=device, backbone_options={**options, **(case.backbone_options or {})})
        if case.at_cap:
            put_weights_at_the_cap(module)
        counter = iter(range(1, 10 ** 9))  # step indices: the timed steps are never check steps (1, 2, …, < 99)
        steps[case.label] = (lambda m=module, o=optimizer, c=counter:
                             train_step(m, o, images, labels, precision, next(c) % CHECK_EVERY))
        memory[case.label] = peak_memory(steps[case.label], device)
        modules[case.label] = module
    seconds = interleaved(steps, device, repeats)
    capped = modules["spectral_norm project, at the cap"].stabilizers[0]
    check = sorted(time_once(lambda: capped.check(capped._weights()), device) for _ in range(3))[1]
    rows = []
    for case in cases:
        rows.append(row(backbone, size, tokens, precision, case.label, seconds[case.label], seconds[case.reference],
                        case.reference, target_of(case, device, tokens), memory[case.label], memory[case.reference]))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
        if case.label == "spectral_norm project, at the cap":  # with its exact check, amortised over check_every steps
            amortised = seconds[case.label] + check / CHECK_EVERY
            rows.append(row(backbone, size, tokens, precision, f"{case.label} + exact check every {CHECK_EVERY} steps "
                            f"({1000 * check:.0f} ms each)", amortised, seconds["none"], "none",
                            target_of(case, device, tokens), memory[case.label], memory["none"]))
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def target_of(case: Case, device: torch.device, tokens: int) -> float | None:
    target = case.gpu_target if device.type == "cuda" else case.target
    if case.label.startswith("jasmin k=10") and device.type == "cuda" and tokens < 256:
        return None  # the GPU target is stated at 256 tokens
    return target


def row(backbone, size, tokens, precision, label, seconds, reference_seconds, reference, target, memory,
        reference_memory) -> list:
    ratio = seconds / reference_seconds
    return [backbone, size, tokens, precision, label, 1000 * seconds,
            f"{ratio:.2f}× " + ("" if reference == "none" else f"({reference})"),
            f"≤ {target:.2f}×" if target else "", verdict(ratio, target),
            memory / 2 ** 20, f"{memory / reference_memory:.2f}×"]


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--backbones", default="vit,swin,cswin",
                   help="comma-separated BACKBONE or BACKBONE:SIZE (e.g. vit:small,swin:tiny); without a size, --sizes")
    p.add_argument("--sizes", default="tiny")
    p.add_argument("--tokens", default="64,256", help="first-stage tokens (square numbers)")
    p.add_argument("--batch", type=int, default=None, help="default 64 on the CPU, 256 on CUDA")
    p.add_argument("--precision", default=None, help="fp32, bf16 or both (fp32,bf16); default: fp32 on the CPU, "
                                                      "both on CUDA")
    args = p.parse_args()
    device = setup(args)
    if args.batch is None:
        args.batch = 256 if device.type == "cuda" else 64
    if args.precision is None:
        args.precision = "fp32,bf16" if device.type == "cuda" else "fp32"
    precisions = args.precision.split(",")
    unknown = [p for p in precisions if p not in ("fp32", "bf16")]
    if unknown:
        raise SystemExit(f"--precision {unknown}: choose fp32, bf16 or both")
    if args.quick:
        args.backbones, args.sizes, args.tokens, args.batch, args.repeats = "vit:micro", "micro", "16", 2, 1
    rows = []
    models = [(entry.partition(":")[0], size) for entry in args.backbones.split(",")
              for size in ([entry.partition(":")[2]] if ":" in entry else args.sizes.split(","))]
    for precision in precisions:
        for backbone, size in models:
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows += measure(backbone, size, tokens, args.batch, device, args.repeats, precision)
    header = ["backbone", "size", "tokens", "precision", "stabilizer", "ms / step", "time ratio", "target", "verdict",
              f"memory MiB ({memory_label(device)})", "memory ratio"]
    body = (f"Batch {args.batch}, median of {args.repeats} interleaved steps after 2 warm-up rounds; ratios to the "
            f"baseline step of the same model, batch and precision (muon's constraints: to plain Muon); bf16: the "
            f"forward under bf16 autocast, as `--trainer.precision bf16-mixed`. Memory: {memory_label(device)} during "
            f"one step after a warm-up step"
            + ("." if device.type == "cuda" else " (CPU keeps no allocator peak), each storage once.")
            + "\n\n" + markdown(header, rows))
    write("step_cost", args, device, "Training-step cost per stabilizer", body)


if __name__ == "__main__":
    main()
