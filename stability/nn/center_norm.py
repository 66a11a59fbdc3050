"""CenterNorm (LipsFormer, Qi et al. 2023, Sec. 4.1.1):

    CN(x) = γ ⊙ (D/(D−1)) · (x − mean(x)) + β

LayerNorm without the division by the standard deviation. Its Jacobian is the constant
diag(γ)·D/(D−1)·(I − 11ᵀ/D), so its Lipschitz constant is at most D/(D−1)·max|γ| (the
projection I − 11ᵀ/D has norm 1), with equality when all |γ_i| are equal, as at init. With
unequal γ the exact constant is ‖diag(γ)(I − 11ᵀ/D)‖₂·D/(D−1), which can be smaller.

In eager mode a float32 or float64 CenterNorm runs as LayerNorm with ε = s² and γ·s for a power of two s (2^40 in
float32), whose 1/σ is then 1/s (exactly on the CPU; within 2 ulps from CUDA's ``rsqrt``): CenterNorm's numbers on
LayerNorm's fused kernels (:func:`centred_by_layer_norm`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .precision import autocast_off

FUSED_DTYPES = (torch.float32, torch.float64)  # where LayerNorm's kernel takes its statistics in the input's dtype


class CenterNorm(nn.Module):
    """CenterNorm over the last dimension (size ``dim``); γ = 1, β = 0 at init."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim < 2:
            raise ValueError(f"CenterNorm needs dim >= 2, got {dim}")
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """β + (x − mean(x)) ⊙ w with w = γ·D/(D−1) (the scale rides on γ, a (D,) vector): by LayerNorm's fused
        kernels (:func:`centred_by_layer_norm`) where x, γ and β share a dtype of float32 or float64 (a float32
        residual stream, also under autocast); else by :func:`center_norm`'s written-out backward where
        :func:`written_out` says it pays, else autograd through the formula (and always inside a compiled graph,
        where Inductor fuses the formula)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"CenterNorm({self.dim}) got inputs of width {x.shape[-1]} (shape {tuple(x.shape)})")
        factor, eager = self.dim / (self.dim - 1), not torch.compiler.is_compiling()
        if eager and takes_layer_norm(x, self.weight, self.bias):
            return centred_by_layer_norm(x, self.weight, self.bias, factor)
        weight = self.weight * factor
        if eager and written_out(x):
            return center_norm(x, weight, self.bias)
        return _centred_and_scaled(x, weight, self.bias)[0]

    def lipschitz(self) -> float:
        """D/(D−1)·max|γ|: an upper bound, exact when |γ| is uniform."""
        return self.dim / (self.dim - 1) * float(self.weight.detach().abs().max())


# From this many bytes of input a CenterNorm takes the written-out backward. It saves some 12 passes over x on the
# device and costs the host about 100 µs more a norm (210 against 106 µs measured on a small input: its operators
# called from Python, where autograd's run in C++):
# 12 passes over 16 MiB at the H200's fitted 1.6 TB/s take about 125 µs. A large model on a GPU waits on its device and
# gains; a small one waits on its host (results/benchmarks/README.md, "CenterNorm's backward written out").
WRITTEN_OUT_FROM_BYTES = 2**24
_size_scale = 1.0  # sizes are judged as this many times larger (:func:`sized_as`)


def written_out(x: torch.Tensor, from_bytes: int | None = None) -> bool:
    """Whether a CenterNorm on ``x`` takes the written-out backward: where x has at least ``WRITTEN_OUT_FROM_BYTES``
    bytes (``from_bytes`` where given: another written-out backward's own size, as
    :func:`~stability.nn.channel_scale.channel_scale`'s), and not inside a compiled graph (Inductor fuses the formula's
    operators; one path at every batch size keeps one compile)."""
    if torch.compiler.is_compiling():
        return False
    threshold = WRITTEN_OUT_FROM_BYTES if from_bytes is None else from_bytes
    return judged_bytes(x.numel() * x.element_size()) >= threshold


def judged_bytes(nbytes: float) -> float:
    """A tensor's ``nbytes`` as the size decisions judge it: times the :func:`sized_as` scale (1 outside one)."""
    return nbytes * _size_scale


@contextlib.contextmanager
def sized_as(scale: float) -> Iterator[None]:
    """Inside the block each CenterNorm (each :func:`written_out` decision) decides as on an input ``scale`` times
    larger: a step counted or timed at a small batch or width takes the path of the step it stands for. A nested block
    replaces the scale (it does not multiply it); process-wide, read by the forward only."""
    if not scale > 0:
        raise ValueError(f"sized_as needs a positive scale, got {scale}")
    global _size_scale
    saved, _size_scale = _size_scale, scale
    try:
        yield
    finally:
        _size_scale = saved


def _centred_and_scaled(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(β + (x − mean(x)) ⊙ w, x − mean(x)): the formula both paths compute forward."""
    centred = x - x.mean(dim=-1, keepdim=True)
    return torch.addcmul(bias, centred, weight), centred


def takes_layer_norm(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether a CenterNorm runs on LayerNorm's kernels (:func:`centred_by_layer_norm`): x, γ and β of one dtype,
    float32 or float64 (in eager mode: :meth:`CenterNorm.forward` asks only there)."""
    return x.dtype == gamma.dtype == bias.dtype in FUSED_DTYPES


# LayerNorm computes (x − mean(x))·r·γ + β with r = 1/√(var(x) + ε): with ε = s² and γ scaled by s, a power of two,
# r is 1/s exactly wherever var(x) + s² rounds to s², and (x − mean(x))·(1/s)·(γ·s) is CenterNorm's product
# (:func:`centred_by_layer_norm`). float32: s = 2^40 balances the range where r is exact (var < 2^56) against the
# gradients the scaled γ moves out of float32's range (CUDA's backward multiplies γ·s by the upstream gradient before
# 1/s; γ's gradient takes (x − mean)·g·(1/s)); float64's range leaves room for s = 2^100.
LAYER_NORM_SCALE = {torch.float32: 2.0 ** 40, torch.float64: 2.0 ** 100}


def centred_by_layer_norm(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor, factor: float) -> torch.Tensor:
    """β + (x − mean(x)) ⊙ (γ·factor) over the last dimension by LayerNorm's fused kernels, forward and backward (2
    passes over x forward where mean, x − mean and an ``addcmul`` take 5; one C++ operator on the host where the
    written-out backward calls five from Python): LayerNorm with ε = s² and weight γ·factor·s (s =
    ``LAYER_NORM_SCALE[x.dtype]``: 2^40 in float32, 2^100 in float64),

        LN(x) = (x − mean x)·γ·factor·s/√(var x + s²) + β = CN(x)·(1 + var x/s²)^(-1/2),

    so its 1/σ is 1/s (exactly on the CPU; CUDA's ``rsqrt`` is within 2 ulps, a rounding of float32's or float64's
    order), and the result CenterNorm's, wherever the variance the kernel computes stays below half
    an ulp of s² — 2^56 in float32 (a row's standard deviation below 2.7·10⁸), 2^147 in float64 — and the scaled
    weight rounds as γ·factor does. That variance is the kernel's: its rounding grows with the row's mean (CUDA's
    Welford, the CPU's sums), and the CPU's float32 sums of squares overflow for |x| above about 10¹⁹ (a NaN where the
    formula stays finite). Where the variance is finite but past that range the result is CenterNorm times
    (1 + var/s²)^(-1/2) ≤ 1, whose Jacobian diag(γ·factor)·(1 + var/s²)^(-1/2)·(I − 11ᵀ/D − x̃x̃ᵀ/D), with
    x̃ = (x − mean x)/√(var x + s²) ⊥ 1 and ‖x̃‖²/D < 1, has norm at most factor·max|γ|: CenterNorm's bound. Its backward
    and double backward are LayerNorm's, whose variance terms carry var/s²: zero to rounding. In float32 the scale
    bounds the gradients too (float64: none that matter): γ's gradient, Σ g·(x − mean)/s, loses precision to
    float32's subnormals where |g·(x − mean)| < 2^-86 ≈ 10⁻²⁶, and CUDA's input gradient, formed from D·γ·s·g before
    it is divided by s, overflows where |γ·g|·D > 2^88 ≈ 3·10²⁶ — all of them a far diverged or vanished run. x, γ and
    β in one dtype of float32 or float64 (LayerNorm's bf16 and fp16 kernels keep their statistics in other dtypes on
    the CPU and on CUDA), autocast off (the result in x's dtype, as the formula's)."""
    scale = LAYER_NORM_SCALE[x.dtype]
    with autocast_off(x.device.type):
        return F.layer_norm(x, (x.shape[-1],), gamma * (factor * scale), bias, eps=scale * scale)


def center_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """β + (x − mean(x)) ⊙ w over the last dimension, with the backward written out (:class:`_CenterNorm`): for the
    upstream gradient g,

        ∂x = w ⊙ g − (g·w)/D,   ∂w = Σ_rows g ⊙ (x − mean(x)),   ∂β = Σ_rows g,

    one matrix-vector product and one ``addcmul`` for ∂x, where autograd through the formula takes a product, a
    negation, a sum, a division and an addition over the whole tensor: counted as a GPU runs it, forward and
    backward, 10 passes over x where autograd through the formula takes 22 and LayerNorm's fused kernels 5 (LipsFormer's
    norms were most of its step's extra memory traffic)."""
    return _CenterNorm.apply(x, weight, bias)[0]


class _CenterNorm(torch.autograd.Function):
    """:func:`center_norm`. The centred input is a second output, so that a double backward (the local Lipschitz
    estimate's power iteration) differentiates through it; composable with torch.func's reverse mode (vmap rule
    generated from these operators) and traced by torch.compile. No forward mode (``jvp``): torch.compile does not
    trace a Function that defines one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _centred_and_scaled(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)  # the unused centred output's gradient stays None, not a tensor of zeros
        ctx.save_for_backward(inputs[1], output[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_centred: torch.Tensor | None):
        weight, centred = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if grad is not None:
            device = grad.device.type  # row sums in the gradient's dtype: CUDA's autocast would run mv in bf16
            with autocast_off(device) if device != "meta" and torch.is_autocast_enabled(device) else _NO_CONTEXT:
                if ctx.needs_input_grad[0]:
                    row_means = (grad @ weight.to(grad.dtype)).unsqueeze(-1).div_(-grad.shape[-1])
                    grad_x = torch.addcmul(row_means, grad, weight)
                if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                    grad_weight, grad_bias = _parameter_gradients(grad, centred, weight, ctx.needs_input_grad[1:])
        if grad_centred is not None and ctx.needs_input_grad[0]:
            centred_part = grad_centred - grad_centred.mean(dim=-1, keepdim=True)
            grad_x = centred_part if grad_x is None else grad_x + centred_part
        return grad_x, grad_weight, grad_bias


_NO_CONTEXT = contextlib.nullcontext()


def _parameter_gradients(grad: torch.Tensor, centred: torch.Tensor, weight: torch.Tensor,
                         needed: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(Σ_rows g ⊙ (x − mean(x)), Σ_rows g). Where no graph of the backward is kept and g, x and w share a dtype of
    float32 or float64, by the kernel that gives LayerNorm's γ and β their gradients (``native_layer_norm_backward``:
    Σ g ⊙ x̂ and Σ g, reading g and x once), with x̂ = (x − mean)·rstd made the centred input by a mean of 0 and an
    rstd of 1; else by a product and two sums, whose own gradients autograd knows (LayerNorm's double backward would
    differentiate the rstd). Not for bf16 or fp16: CUDA's kernel reads their mean and rstd as float32, the CPU's in the
    input's dtype."""
    width = grad.shape[-1]
    if torch.is_grad_enabled() or not grad.dtype == centred.dtype == weight.dtype in FUSED_DTYPES:
        rows = grad.reshape(-1, width)
        return ((rows * centred.reshape(-1, width)).sum(0) if needed[0] else None,
                rows.sum(0) if needed[1] else None)
    shape = centred.shape[:-1] + (1,)
    _, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward.default(
        grad, centred, [width], centred.new_zeros(shape), centred.new_ones(shape), weight, weight,
        [False, needed[0], needed[1]])
    return grad_weight, grad_bias

