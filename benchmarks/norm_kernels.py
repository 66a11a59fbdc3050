"""The norms a ViT-S layer runs, alone: counted on the GPU's path, priced by the H200 step model with and without a time
per norm row, and timed — on a GPU, the measurement that tells which of the two prices a norm.

    python benchmarks/norm_kernels.py --device cuda    # seconds on a GPU
    python benchmarks/norm_kernels.py --quick          # tiny shapes on the CPU (tests)

CUDA's LayerNorm and RMSNorm kernels give each normalised row a thread block of its own, forward and for the input's
gradient (``gpu_model.norm_rows``). The step model prices a kernel by its bytes; fitted with a time per row as well
(``step_cost.py --count --norm_rows``), it predicts the H200's two QK-norm rows within 6%, which it otherwise
underestimates by 6–14%, at 0.49 ns a row — but two rows with the same norms set that constant. Here each norm of one
layer at batch 256 is taken alone, forward and backward, ``--calls`` times back to back (a step's steady state, where
the host issues ahead of the device): the residual stream's LayerNorm (float32 rows of 384, as autocast runs it), the
suite's QK norm (a bf16 LayerNorm of q and of k, rows of a head's 64, strided views of the projection, normalised
token-major as before a fused attention kernel), LipsFormer's CenterNorm of the residual stream three ways, all in
float32 (on LayerNorm's kernels, the module's path for float32; its backward written out, the path float32 took
before, its parameters' gradients by LayerNorm's backward kernel, which bf16 takes from 16 MiB with a product and sums
instead; eager autograd through the formula, where a compiled graph starts from), and LipsFormer's cosine
normalisation of q and k (CUDA's fused RMSNorm, as the suite takes it eagerly on CUDA, and spelled out, as it takes it
elsewhere). Each row: its norm rows,
launches and bytes counted (on the CPU, through the stand-ins of CUDA's fused RMSNorm), the time each model predicts,
and the time measured.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from common import CUT, arguments, interleaved, markdown, setup, write
from step_cost import H200_TABLE, kept_counts, measured_table, table_model
from torch import nn

from stability.nn import center_norm, cosine_attention
from stability.nn.center_norm import CenterNorm
from stability.nn.dot_attention import norm_for_fused_attention
from stability.testing.fused_rms_norm import counted_as_on_cuda
from stability.testing.gpu_model import FITTED, GpuModel, StepCounts, count

FIT_COUNTS = H200_TABLE.parent / "step_model_h200.json"
# (batch, tokens, heads, head width): ViT-S at 256 tokens and batch 256, as the H200 table; tiny for tests
SHAPE, QUICK_SHAPE = (256, 257, 6, 64), (2, 17, 2, 8)


@contextlib.contextmanager
def cosine_norm(fused: bool) -> Iterator[None]:
    """LipsFormer's normalisation as a CUDA device takes it (``fused``: the fused RMSNorm) or as other devices do."""
    saved = cosine_attention.fused_norm_on
    cosine_attention.fused_norm_on = lambda device: fused
    try:
        yield
    finally:
        cosine_attention.fused_norm_on = saved


def cases(batch: int, tokens: int, heads: int, width: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """One forward and backward of each norm on seeded tensors of a layer's shapes; the gradient is a fixed tensor."""
    generator = torch.Generator(device=device).manual_seed(0)
    dim = heads * width
    stream = torch.randn(batch, tokens, dim, generator=generator, device=device, requires_grad=True)
    qkv = torch.randn(batch, tokens, 3, heads, width, generator=generator, device=device, dtype=torch.bfloat16)
    qkv.requires_grad_(True)
    residual_norm, q_norm, k_norm = nn.LayerNorm(dim).to(device), nn.LayerNorm(width).to(device), \
        nn.LayerNorm(width).to(device)
    centre = CenterNorm(dim).to(device)
    kernel = cosine_attention.ScaledCosineKernel(heads).to(device)
    stream_grad = torch.randn(stream.shape, generator=generator, device=device)
    # token-major, as the fused attention kernel writes the gradient of the token-major queries the norms give it
    head_grad = torch.randn(batch, tokens, heads, width, generator=generator, device=device,
                            dtype=torch.bfloat16).transpose(1, 2)

    leaves = [stream, qkv, *residual_norm.parameters(), *q_norm.parameters(), *k_norm.parameters(),
              *kernel.parameters(), *centre.parameters()]

    def fresh():  # every call as a step's first: no gradient accumulated into an earlier call's (no `add_`)
        for leaf in leaves:
            leaf.grad = None

    def queries_and_keys():
        q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # timm's attention: strided views of the projection
        return q, k

    def residual():
        fresh()
        torch.autograd.backward(residual_norm(stream), stream_grad)

    def centred(path: str):
        def run():
            fresh()
            if path == "layer-norm":  # the module's own path for a float32 stream
                out = centre(stream)
            else:
                weight = centre.weight * (dim / (dim - 1))
                out = (center_norm.center_norm(stream, weight, centre.bias) if path == "written-out"
                       else torch.addcmul(centre.bias, stream - stream.mean(-1, keepdim=True), weight))
            torch.autograd.backward(out, stream_grad)
        return run

    def qk_norm():
        fresh()
        q, k = queries_and_keys()
        torch.autograd.backward([norm_for_fused_attention(q_norm, q, True), norm_for_fused_attention(k_norm, k, True)],
                                [head_grad, head_grad])

    def cosine(fused: bool):
        def run():
            fresh()
            with cosine_norm(fused):
                torch.autograd.backward(list(kernel.scaled_queries_and_keys(*queries_and_keys(), for_fused=True)),
                                        [head_grad, head_grad])
        return run

    return {"residual stream: LayerNorm (float32)": residual,
            "residual stream: CenterNorm on LayerNorm's kernels (float32)": centred("layer-norm"),
            "residual stream: CenterNorm written out (float32)": centred("written-out"),
            "residual stream: CenterNorm's formula (float32)": centred("formula"),
            "QK norm: LayerNorm of q and k (bf16)": qk_norm,
            "cosine norm of q and k: fused RMSNorm (bf16)": cosine(True),
            "cosine norm of q and k: spelled out (bf16)": cosine(False)}


def counted(run: Callable[[], None], device: torch.device) -> StepCounts:
    """One call counted on the GPU's path: on the CPU, RMSNorm through the stand-ins of CUDA's fused kernels."""
    with counted_as_on_cuda() if device.type == "cpu" else contextlib.nullcontext():
        return count(run)


def table_rows(counts: dict[str, StepCounts], seconds: dict[str, float], bytes_only: GpuModel,
               with_rows: GpuModel) -> list[list]:
    """Each norm's row: its rows (thousands), launches, MB, the two models' predictions and the measured time (µs a
    call), and the measured time over each prediction."""
    rows = []
    for name, c in counts.items():
        priced = [1e6 * model.seconds(c) for model in (bytes_only, with_rows)]
        measured = 1e6 * seconds[name]
        rows.append([name, c.norm_rows / 1e3, int(c.launches), c.bytes / 1e6, *priced, measured,
                     measured / priced[0], measured / priced[1]])
    return rows


def repeated(run: Callable[[], None], calls: int) -> Callable[[], None]:
    def many():
        for _ in range(calls):
            run()
    return many


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20, help="forward and backward calls timed back to back per sample")
    p.add_argument("--shape", default=",".join(map(str, SHAPE)), help="BATCH,TOKENS,HEADS,HEAD_WIDTH (default "
                                                                       "ViT-S at 256 tokens, batch 256)")
    args = p.parse_args()
    if args.calls < 1:
        raise SystemExit(f"--calls {args.calls}: give at least 1")
    try:
        shape = tuple(int(v) for v in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise SystemExit(f"--shape {args.shape!r}: give BATCH,TOKENS,HEADS,HEAD_WIDTH, four positive integers")
    device = setup(args)
    shape, repeats, calls = (QUICK_SHAPE, 2, 2) if args.quick else (shape, args.repeats, args.calls)
    runs = cases(*shape, device)
    bytes_only = FITTED["h200"]
    with_rows = table_model(kept_counts(FIT_COUNTS), measured_table(H200_TABLE), norm_rows=True)
    counts: dict[str, StepCounts] = {}
    seconds = dict.fromkeys(runs, float("nan"))
    try:  # a cut (the GPU session's time limit) keeps what finished: the counts, and the whole rounds timed
        for name, run in runs.items():
            counts[name] = counted(run, device)
        timed = interleaved({name: repeated(run, calls) for name, run in runs.items()}, device, repeats,
                            keep_cut_rounds=True)
        seconds = {name: value / calls for name, value in timed.items()}
    except KeyboardInterrupt:
        CUT.append(f"interrupted {'while counting' if len(counts) < len(runs) else 'before a whole round was timed'}"
                   f": {'counts and predictions only' if counts else 'nothing measured'}")
    if not counts:
        raise SystemExit("norm_kernels: interrupted before any norm was counted; nothing written")
    rows = table_rows(counts, seconds, bytes_only, with_rows)
    batch, tokens, heads, width = shape
    body = (f"One layer's norms at batch {batch}, {tokens} tokens, {heads} heads of {width} (residual rows "
            f"{batch * tokens:,} × {heads * width}, head rows {batch * heads * tokens:,} × {width}): each forward "
            f"and backward, {calls} calls back to back a sample, the median of {repeats} interleaved samples, per "
            f"call. Counted on the GPU's path (on the CPU, CUDA's fused RMSNorm by its stand-ins), priced by the H200 "
            f"model (`gpu_model.FITTED`: bytes, launches, FLOPs; no time per norm row) and by the same model fitted "
            f"with a time per norm row ({with_rows.row_s * 1e9:.2f} ns; `step_cost.py --count --norm_rows`). "
            f"Where the measured time follows the second column and not the first, the rows set a norm's time.\n\n"
            + markdown(["norm, forward and backward", "norm rows (k)", "launches", "MB (counted)",
                        "predicted µs (bytes)", "predicted µs (+ rows)", "measured µs", "× bytes' prediction",
                        "× rows' prediction"], rows)
            + ("" if device.type == "cuda" else
               f"\n\nOn {device.type} the times are this machine's (its LayerNorm and RMSNorm are not CUDA's "
               f"kernels): only a GPU's set the row term."))
    write("norm_kernels", args, device, "Norm kernels: rows or bytes", body)
    if CUT:
        raise SystemExit(130)  # the table holds what finished; the exit status says it was cut


if __name__ == "__main__":
    main()
