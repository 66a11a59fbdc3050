"""Matrix-product rates at the shapes the GPU step model prices: bf16, TF32, IEEE float32, and float32 as three TF32
products (the hard cap's ``cap_products: tf32x3``), measured in TFLOP/s beside the rates the model assumes.

    python benchmarks/matmul_rates.py --device cuda    # a few seconds on a GPU
    python benchmarks/matmul_rates.py --quick          # tiny shapes on the CPU (tests)

The step model (stability/testing/gpu_model.py) prices matrix products by FLOPs at one rate per precision. Its fit to
the H200's step table sets the IEEE float32 rate only loosely (15 TFLOP/s from the first table, 45 from both), and no
measured row sets TF32's (assumed at 0.6 × the data sheet's peak). These rates decide whether the hard cap should take
its products as three TF32 products: where ``tf32x3``'s effective rate (the float32 product's FLOPs over its time,
its operands' splits included) beats IEEE float32's. Shapes: the hard cap's on ViT-S (the second sign's stack of
72 × 384 × 384, the first sign's Gram of 24 matrices 384 × 1,536), and one large square product (8,192³), the
rate a well-shaped GEMM reaches. Each case multiplies float32 inputs (bf16: inputs cast beforehand), one call timed
(median of ``--repeats`` interleaved rounds).
"""
from __future__ import annotations

import torch
from common import arguments, interleaved, markdown, setup, write

from stability.nn import constraints
from stability.nn.precision import ieee_float32, tf32_matmuls
from stability.testing.gpu_model import FITTED

# (label, batch, m, k, n)
SHAPES = [("hard cap: second sign (72 × 384²)", 72, 384, 384, 384),
          ("hard cap: first sign's Gram (24 × 384 × 1,536)", 24, 384, 1536, 384),
          ("square 8,192³", 1, 8192, 8192, 8192)]
QUICK_SHAPES = [("tiny stack (2 × 16²)", 2, 16, 16, 16), ("tiny Gram (2 × 16 × 48)", 2, 16, 48, 16),
                ("square 64³", 1, 64, 64, 64)]
PRECISIONS = ("bf16", "tf32", "float32", "tf32x3")
MODEL_PRECISION = {"bf16": "bf16", "tf32": "tf32", "float32": "fp32"}


def cases(batch: int, m: int, k: int, n: int, device: torch.device) -> dict:
    """One product of each precision on seeded operands: (G, m, k) @ (G, k, n)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(batch, m, k, generator=generator, device=device)
    b = torch.randn(batch, k, n, generator=generator, device=device)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)

    def tf32():
        with tf32_matmuls():
            torch.bmm(a, b)

    def ieee():
        with ieee_float32():
            torch.bmm(a, b)

    def split():  # the hard cap's product: both operands split, three TF32 products accumulated in place
        with tf32_matmuls():
            constraints._bmm(a, b, split=True)

    return {"bf16": lambda: torch.bmm(a16, b16), "tf32": tf32, "float32": ieee, "tf32x3": split}


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    args = p.parse_args()
    device = setup(args)
    shapes, repeats = (QUICK_SHAPES, 2) if args.quick else (SHAPES, args.repeats)
    model = FITTED["h200"]
    rows, verdicts = [], []
    for label, batch, m, k, n in shapes:
        flops = 2.0 * batch * m * k * n
        seconds = interleaved(cases(batch, m, k, n, device), device, repeats)
        for precision in PRECISIONS:
            assumed = model.flops_per_s.get(MODEL_PRECISION.get(precision, ""), float("nan"))
            rows.append([label, precision, 1000 * seconds[precision], flops / seconds[precision] / 1e12,
                         assumed / 1e12])
        ratio = seconds["tf32x3"] / seconds["float32"]
        verdicts.append(f"{label}: tf32x3 takes {ratio:.2f}× IEEE float32's time "
                        f"({'tf32x3' if ratio < 1 else 'float32'} is faster)")
    body = ("Each product's time and its rate (its FLOPs, 2·G·m·k·n, over its time; for tf32x3 the float32 product's "
            "FLOPs, so its rate compares with float32's directly), beside the rate the H200 step model prices it at "
            "(`gpu_model.FITTED`; tf32x3 is priced there as three TF32 products and its splits' bytes).\n\n"
            + markdown(["product", "precision", "ms", "TFLOP/s", "model's TFLOP/s"], rows)
            + "\n\n" + "\n".join(f"- {v}" for v in verdicts)
            + ("" if constraints.split_products_on(device) else
               f"\n\n{device.type} has no TF32 units: its tf32 products are IEEE float32 (or whatever its library "
               "makes of torch's `high` setting), and tf32x3 is three such products; the hard cap takes `float32` "
               "here."))
    write("matmul_rates", args, device, "Matrix-product rates", body)


if __name__ == "__main__":
    main()
