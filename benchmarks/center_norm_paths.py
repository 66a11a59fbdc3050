"""LipsFormer's training step with CenterNorm on each of its eager paths, timed in one process, interleaved: the
paired comparison a step-cost table (one path, runs apart) cannot make.

    python benchmarks/center_norm_paths.py --tokens 64           # ViT-Ti, batch 64, fp32, as step_cost.py's rows
    python benchmarks/center_norm_paths.py --quick               # tiny shapes (tests)

Rows: the plain step, LipsFormer with CenterNorm on LayerNorm's kernels (its path in float32 and float64), and
LipsFormer with that path switched off (``center_norm.takes_layer_norm`` returning False: the written-out backward
from 16 MiB of input, autograd through the formula below, as every float32 CenterNorm ran before). The three take turns
in each round (``common.interleaved``), so a drift of the machine hits them alike; each LipsFormer step's time over
the plain step's is the ratio step_cost.py reports.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from common import arguments, interleaved, markdown, setup, write
from step_cost import CASES, check_shape, geometry, step_inputs

from stability.nn import center_norm
from stability.testing.profiling import train_step

BATCH = 64


@contextlib.contextmanager
def former_path() -> Iterator[None]:
    """CenterNorm without LayerNorm's kernels: the written-out backward from 16 MiB, the formula below."""
    saved = center_norm.takes_layer_norm
    center_norm.takes_layer_norm = lambda *args: False
    try:
        yield
    finally:
        center_norm.takes_layer_norm = saved


def steps(backbone: str, size: str, tokens: int, batch: int) -> dict[str, object]:
    """One fp32 training step of each row, on seeded inputs (the optimizer's state made by a first step)."""
    image_size, options = geometry(backbone, size, tokens)
    cases = {case.label: case for case in CASES}
    runs = {}
    for label, name, former in (("none", "none", False), ("lipsformer", "lipsformer: CenterNorm on LayerNorm's kernels",
                                                          False),
                                ("lipsformer", "lipsformer: CenterNorm's former path", True)):
        module, images, labels = step_inputs(cases[label], backbone, size, image_size, options, batch)
        optimizer = module.build_optimizer()

        def run(module=module, optimizer=optimizer, images=images, labels=labels, former=former):
            with former_path() if former else contextlib.nullcontext():
                train_step(module, optimizer, images, labels, "fp32", 1)

        run()
        runs[name] = run
    return runs


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="first-stage tokens (a square number; default 64)")
    p.add_argument("--backbone", default="vit:tiny", help="BACKBONE:SIZE (default vit:tiny)")
    args = p.parse_args()
    backbone, _, size = args.backbone.partition(":")
    tokens, batch, repeats = (16, 4, 2) if args.quick else (args.tokens, BATCH, args.repeats)
    size = "micro" if args.quick else (size or "tiny")
    check_shape(backbone, size, tokens)
    device = setup(args)
    if device.type != "cpu":
        raise SystemExit("center_norm_paths.py times the CPU step (step_cost.py's CPU rows); --device cpu")
    seconds = interleaved(steps(backbone, size, tokens, batch), device, repeats)
    plain = seconds["none"]
    rows = [[name, 1e3 * value, f"{value / plain:.2f}×"] for name, value in seconds.items()]
    body = (f"{backbone}:{size}, {tokens} tokens, batch {batch}, fp32: one training step of each row, the median of "
            f"{repeats} interleaved rounds after 2 warm-up rounds, all in one process.\n\n"
            + markdown(["row", "ms / step", "× the plain step"], rows))
    write("center_norm_paths", args, device, "CenterNorm's paths in a LipsFormer step, paired", body)


if __name__ == "__main__":
    main()
