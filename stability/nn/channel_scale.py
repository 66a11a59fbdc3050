"""A per-channel scale α ⊙ x with its backward written out, for half-precision branches under mixed precision on CUDA.

Under autocast a residual branch ends in a bf16 (or fp16) Linear output x, and a float32 α promotes α ⊙ x to float32.
Autograd then takes ∂x = g ⊙ α as a float32 product, which its engine casts to x's dtype in a second kernel. Here

    ∂x = g ⊙ α,   written in x's dtype by the product itself (computed in float32, rounded once: the same values),
    ∂α = Σ_rows g ⊙ x,

a write and a read of the float32 product fewer a call on CUDA, whose kernels cast as they store (the CPU computes
an ``out=`` of another dtype into a temporary and copies it: nothing saved there), with the same numbers as
autograd's: the product and its rounding, the sum and its order, are autograd's own.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

from .center_norm import written_out

# From this many bytes of a half-precision x the written-out backward pays: it saves a write and a read of the float32
# gradient, 128 MiB of traffic at 32 MiB of x, ≈ 80 µs at the H200's fitted 1.6 TB/s, and costs the host ≈ 50-85 µs
# more a call (its Python forward and backward against autograd's C++: 100-160 against 50-75 µs measured on a tiny
# input on a 2-core CPU beside other work). ViT-S at 256 tokens and batch 256 holds 48 MiB a branch output.
WRITTEN_OUT_FROM_BYTES = 2**25


def transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func transform's tensor (``vmap``, ``grad``, ``jvp``), autograd's batched gradient
    (``is_grads_batched``) or a forward-mode dual tensor, on which an ``out=`` product has no batching rule and a
    Function no forward mode."""
    return (torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.is_legacy_batchedtensor(t)
            or forward_ad.unpack_dual(t).tangent is not None)


def casting_out_on(device: torch.device) -> bool:
    """Whether a product written to an ``out=`` of a narrower dtype casts inside its kernel as it stores (CUDA's
    kernels), so that one kernel writes the narrow result; the CPU computes it into a temporary of the wide dtype and
    copies that."""
    return device.type == "cuda"


def channel_scale(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """α ⊙ x, α of shape (D,) over x's last dimension: by :class:`_ChannelScale` where a gradient will be taken, α
    promotes x to a wider dtype (a bf16 or fp16 x and a float32 α; a float32 x and a float64 α), the device casts as it
    stores (:func:`casting_out_on`) and x has at least ``WRITTEN_OUT_FROM_BYTES`` bytes, judged as
    :func:`~stability.nn.center_norm.written_out` judges (its ``sized_as`` scale; never inside a compiled graph, where
    Inductor fuses the formula); not under torch.func's transforms or forward-mode AD, on x or α (the Function has no
    forward mode). Elsewhere autograd through ``alpha * x``."""
    if (written_out(x, WRITTEN_OUT_FROM_BYTES) and torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad)
            and torch.promote_types(alpha.dtype, x.dtype) != x.dtype and casting_out_on(x.device)
            and not transformed(x) and not transformed(alpha)):
        return _ChannelScale.apply(x, alpha)
    return alpha * x


class _ChannelScale(torch.autograd.Function):
    """:func:`channel_scale`'s α ⊙ x, reverse mode only (no ``jvp``, as :class:`~stability.nn.center_norm._CenterNorm`).
    Differentiable twice (a backward that keeps its graph takes the formula's operators), and a gradient batched by
    torch.func (``vmap``, ``is_grads_batched``) takes them too; vmap rule generated."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return alpha * x

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, alpha = inputs
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, alpha = ctx.saved_tensors
        grad_x = grad_alpha = None
        if ctx.needs_input_grad[0]:
            if (torch.is_grad_enabled() or torch.compiler.is_compiling() or grad.dtype == ctx.x_dtype
                    or transformed(grad)):
                grad_x = grad * alpha  # a graph of it kept, a batched gradient, or one dtype: autograd's operators
            else:  # in float32, rounded once to x's dtype as the engine's cast rounds it, in the gradient's layout
                grad_x = torch.mul(grad, alpha, out=torch.empty_like(grad, dtype=ctx.x_dtype))
        if ctx.needs_input_grad[1]:
            grad_alpha = (grad * x).sum_to_size(alpha.shape)
        return grad_x, grad_alpha
