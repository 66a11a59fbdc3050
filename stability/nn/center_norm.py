"""CenterNorm (LipsFormer, Qi et al. 2023, Sec. 4.1.1):

    CN(x) = γ ⊙ (D/(D−1)) · (x − mean(x)) + β

LayerNorm without the division by the standard deviation. Its Jacobian is the constant
diag(γ)·D/(D−1)·(I − 11ᵀ/D), so its Lipschitz constant is at most D/(D−1)·max|γ| (the
projection I − 11ᵀ/D has norm 1), with equality when all |γ_i| are equal, as at init. With
unequal γ the exact constant is ‖diag(γ)(I − 11ᵀ/D)‖₂·D/(D−1), which can be smaller.
"""
from __future__ import annotations

import torch
from torch import nn

from .precision import autocast_off


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
        """β + (x − mean(x)) ⊙ w with w = γ·D/(D−1) (the scale rides on γ, a (D,) vector), by :func:`center_norm`."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"CenterNorm({self.dim}) got inputs of width {x.shape[-1]} (shape {tuple(x.shape)})")
        return center_norm(x, self.weight * (self.dim / (self.dim - 1)), self.bias)

    def lipschitz(self) -> float:
        """D/(D−1)·max|γ|: an upper bound, exact when |γ| is uniform."""
        return self.dim / (self.dim - 1) * float(self.weight.detach().abs().max())


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
        centred = x - x.mean(dim=-1, keepdim=True)
        return torch.addcmul(bias, centred, weight), centred

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)  # the unused centred output's gradient stays None, not a tensor of zeros
        ctx.save_for_backward(inputs[1], output[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_centred: torch.Tensor | None):
        weight, centred = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if grad is not None:
            with autocast_off(grad.device.type):  # row sums in the gradient's dtype: CUDA's autocast runs mv in bf16
                if ctx.needs_input_grad[0]:
                    row_means = (grad @ weight.to(grad.dtype)).unsqueeze(-1) / -grad.shape[-1]
                    grad_x = torch.addcmul(row_means, grad, weight)
                if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                    grad_weight, grad_bias = _parameter_gradients(grad, centred, weight, ctx.needs_input_grad[1:])
        if grad_centred is not None and ctx.needs_input_grad[0]:
            centred_part = grad_centred - grad_centred.mean(dim=-1, keepdim=True)
            grad_x = centred_part if grad_x is None else grad_x + centred_part
        return grad_x, grad_weight, grad_bias


FUSED_DTYPES = (torch.float32, torch.float64)  # where LayerNorm's kernel takes its statistics in the input's dtype


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
    _, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad, centred, [width], centred.new_zeros(shape), centred.new_ones(shape), weight, weight,
        [False, needed[0], needed[1]])
    return grad_weight, grad_bias

