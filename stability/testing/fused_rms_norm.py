"""CUDA's fused RMSNorm, stood in on the CPU for counting: one kernel forward and one backward, as a GPU runs it.

On CUDA ``F.rms_norm`` calls torch's ``_fused_rms_norm``, one kernel that reads x (and the weight) and writes y and
the rows' reciprocal RMS (float32 at least), and its backward ``_fused_rms_norm_backward``, one kernel that reads the
incoming gradient, x and the saved statistics and writes the input's (and the weight's) gradient; where the backward
must itself be differentiable (``create_graph``), autograd runs torch's composite backward instead. The CPU has no
such kernel: ``F.rms_norm`` runs as its composite, about ten operators each way, which a counted step would charge
as a GPU's. The weight's gradient is a kernel of its own (two over many rows), and a strided input or weight is copied
in each direction. Inside :func:`counted_as_on_cuda` (which ``gpu_model.cuda_path`` enters), ``F.rms_norm`` calls the
operators here instead: the same arithmetic, each kernel one operator to the counter, with the inputs and outputs of
CUDA's kernels.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..nn.precision import accumulation_dtype


def _reduced(x: torch.Tensor, width: int) -> list[int]:
    return list(range(x.dim() - width, x.dim()))


def _forward(x: torch.Tensor, width: int, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    wide = x.to(accumulation_dtype(x.dtype))
    rstd = torch.rsqrt(wide.pow(2).mean(_reduced(x, width), keepdim=True) + eps)
    y = wide * rstd
    return (y if weight is None else y * weight).to(x.dtype), rstd


def _backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
              width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d/dx of y = w ⊙ x·r, r = (mean x² + ε)^(-1/2): r·(g ⊙ w) − x·r³·mean((g ⊙ w) ⊙ x); d/dw = Σ_rows g ⊙ x·r."""
    dims = _reduced(x, width)
    wide, g = x.to(rstd.dtype), grad.to(rstd.dtype)
    gw = g if weight is None else g * weight.to(rstd.dtype)
    grad_x = rstd * gw - wide * rstd.pow(3) * (gw * wide).mean(dims, keepdim=True)
    grad_weight = None if weight is None else (g * wide * rstd).sum(list(range(x.dim() - width))).to(weight.dtype)
    return grad_x.to(x.dtype), grad_weight


@torch.library.custom_op("stability::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, width: int, weight: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, reciprocal RMS of each row) over the last ``width`` dimensions: ``_fused_rms_norm``'s outputs."""
    return _forward(x, width, weight, eps)


@fused_rms_norm.register_fake
def _(x, width, weight, eps):
    shape = [*x.shape[: x.dim() - width], *[1] * width]
    return x.new_empty(x.shape), x.new_empty(shape, dtype=accumulation_dtype(x.dtype))


@torch.library.custom_op("stability::fused_rms_norm_backward", mutates_args=())
def fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                            width: int) -> torch.Tensor:
    """The input's gradient: the first kernel of ``_fused_rms_norm_backward``."""
    return _backward(grad, x, rstd, weight, width)[0]


@fused_rms_norm_backward.register_fake
def _(grad, x, rstd, weight, width):
    return x.new_empty(x.shape)


# the weight's gradient is a kernel of its own, which reads the gradient and x again; over more than this many rows it
# writes partial sums (one per ROWS_PER_PARTIAL rows, in the weight's dtype) that a second kernel adds up (torch's
# CUDA layer-norm code, which its RMSNorm shares, as read; not profiled)
MANY_ROWS, ROWS_PER_PARTIAL = 65_536, 32


@torch.library.custom_op("stability::fused_rms_norm_weight_partials", mutates_args=())
def fused_rms_norm_weight_partials(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                                   width: int) -> torch.Tensor:
    """Σ g ⊙ x·r over each block of ROWS_PER_PARTIAL rows (all rows in one block up to MANY_ROWS), (blocks, *w)."""
    rows = (grad.to(rstd.dtype) * x.to(rstd.dtype) * rstd).reshape(-1, *weight.shape)
    blocks = _blocks(rows.shape[0])
    padded = torch.cat([rows, rows.new_zeros(blocks * -(-rows.shape[0] // blocks) - rows.shape[0], *weight.shape)])
    return padded.reshape(blocks, -1, *weight.shape).sum(1).to(weight.dtype)


def _blocks(rows: int) -> int:
    return -(-rows // ROWS_PER_PARTIAL) if rows > MANY_ROWS else 1


@fused_rms_norm_weight_partials.register_fake
def _(grad, x, rstd, weight, width):
    return weight.new_empty(_blocks(x.numel() // weight.numel()), *weight.shape)


def _setup(ctx, inputs, output):
    x, width, weight, eps = inputs
    ctx.width, ctx.eps = width, eps
    ctx.set_materialize_grads(False)  # no zeros made for the statistics' gradient, which no one asks for
    ctx.save_for_backward(x, output[1], weight)


def _autograd_backward(ctx, grad, _grad_rstd):
    x, rstd, weight = ctx.saved_tensors
    if grad is None:
        return None, None, None, None
    if torch.is_grad_enabled():  # a differentiable backward: autograd's composite, as on CUDA, its statistics
        # recomputed from x so that the gradient's own gradient flows through them
        rstd = torch.rsqrt(x.to(rstd.dtype).pow(2).mean(_reduced(x, ctx.width), keepdim=True) + ctx.eps)
        grad_x, grad_weight = _backward(grad, x, rstd, weight, ctx.width)
    else:  # each kernel where its gradient is asked for (CUDA's output mask)
        grad_x = fused_rms_norm_backward(grad, x, rstd, weight, ctx.width) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[2]:
            partials = fused_rms_norm_weight_partials(grad, x, rstd, weight, ctx.width)
            grad_weight = partials[0] if partials.shape[0] == 1 else partials.sum(0)
    return grad_x, None, grad_weight, None


fused_rms_norm.register_autograd(_autograd_backward, setup_context=_setup)


class _CopiedEachWay(torch.autograd.Function):
    """The copies CUDA's norm kernels make of a strided input: ``input.expect_contiguous()`` in the forward and again,
    of the saved input, in the backward (as ATen's LayerNorm kernels do; assumed of its RMSNorm, which shares their
    code). The identity, with a copy each way for the counter (the backward's copies the gradient, of the same size)."""

    @staticmethod
    def forward(ctx, x):
        return x.contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


_rms_norm = F.rms_norm  # torch's own


def rms_norm_as_on_cuda(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                        eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` through the two single operators above, under CUDA's autocast policy for it where autocast is on
    (from torch 2.14: float32, :mod:`.cuda_autocast`), a strided input copied each way (``eps`` None: the machine
    epsilon of the statistics' dtype, as torch: float32's for bf16)."""
    from .cuda_autocast import applied_policies

    if torch.compiler.is_compiling():  # a compiled graph decomposes torch's own, as a GPU's compile does
        return _rms_norm(input, normalized_shape, weight, eps)
    if weight is not None and not weight.is_contiguous():
        weight = _CopiedEachWay.apply(weight)  # CUDA's kernels copy a strided weight too, each way
    if torch.is_autocast_enabled("cpu") and applied_policies().get("rms_norm") == "fp32":
        input, weight = (t if t is None or t.dtype == torch.float64 else t.float() for t in (input, weight))
    if not input.is_contiguous():
        input = _CopiedEachWay.apply(input)
    eps = torch.finfo(accumulation_dtype(input.dtype)).eps if eps is None else eps
    return fused_rms_norm(input, len(normalized_shape), weight, eps)[0]


@contextlib.contextmanager
def counted_as_on_cuda() -> Iterator[None]:
    """``F.rms_norm`` is :func:`rms_norm_as_on_cuda` inside the block."""
    original = F.rms_norm
    F.rms_norm = rms_norm_as_on_cuda
    try:
        yield
    finally:
        F.rms_norm = original


__all__ = ["counted_as_on_cuda", "fused_rms_norm", "fused_rms_norm_backward", "fused_rms_norm_weight_partials",
           "rms_norm_as_on_cuda"]
