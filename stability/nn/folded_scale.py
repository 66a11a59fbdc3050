"""Scales folded into the Linear layers next to them: a per-channel scale of a Linear layer's output, and a constant
factor of its input.

LipsFormer's weighted residual x + α ⊙ f(x) (Qi et al. 2023, Sec. 4.1.3) ends most branches in a Linear layer,
f(x) = W h + b, followed only by operations that act on each token's channels one by one (dropout, DropPath, Swin's
window reversal). Then

    α ⊙ (W h + b) = (diag(α) W) h + α ⊙ b,

the same function computed by the product itself: scaling the D × D' weight and the bias costs a few kernels on
tensors of the weight's size, where α ⊙ y reads and writes the branch's whole (B, N, D) output, forward and backward
(and, under mixed precision, promotes it to float32 before the residual addition reads it again). Those few kernels
(and, under mixed precision, the cast of the incoming float32 gradient to the product's bf16 output, which the plain
step makes too and α ⊙ y's written-out backward wrote in its own product) are five launches a branch more than
α ⊙ y takes: on a small output, where the host's launches set a step's time, and in float16, the product is
followed by α ⊙ y instead (:func:`folds_at`). The weight and bias stay the unscaled W and b, and α stays a parameter
of its own module: the state dict, the optimizers' parameters, the constraints and the certified bounds read what
they read before.

The Lipschitz transformer (Newhouse et al. 2025) divides two activations by constants that keep each layer
1-Lipschitz: the attention's output by 3 before W_O, and GELU's by max|GELU'| ≈ 1.1289 before the MLP's second Linear
layer. A constant factor of a Linear layer's input is one of its weight, W (c·h) + b = (c·W) h + b: the product
computes it (:class:`ScaledInputLinear`) for the cost of scaling the weight, forward and backward, where c·h read and
wrote the whole activation each way (the attention's (B, N, D) output, the MLP's (B, N, 4D) hidden layer) with the
same number of launches; so it folds at every size. ``W`` stays the parameter it was, and the layer that divided
keeps its type and its place (the bounds read the 1/3 and the 1-Lipschitz activation from it, as before).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .center_norm import judged_bytes
from .channel_scale import WRITTEN_OUT_FROM_BYTES, channel_scale
from .precision import autocast_dtype


class ScaledOutputLinear(nn.Linear):
    """``nn.Linear`` that returns α ⊙ (W x + b) as F.linear(x, diag(α) W, α ⊙ b), α read at every call from
    ``output_scale.alpha`` (a module elsewhere in the network, not a submodule of this one: see
    :func:`fold_output_scale`)."""

    output_scale: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.output_scale.alpha
        if not folds_at(x, self.out_features):
            return channel_scale(F.linear(x, self.weight, self.bias), alpha)
        bias = None if self.bias is None else self.bias * alpha
        return F.linear(x, self.weight * alpha.unsqueeze(-1), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output scaled per channel by its residual's α"


def folds_at(x: torch.Tensor, out_features: int) -> bool:
    """Whether the product takes α into its weight on the input ``x``: where its output, (…, ``out_features``) in the
    product's dtype (autocast's where it is on), has at least ``channel_scale.WRITTEN_OUT_FROM_BYTES`` — the same trade
    as that written-out backward's, a pass over the output each way against a few calls' host work — judged as
    :func:`~stability.nn.center_norm.written_out` judges sizes (``sized_as``); at every size inside a compiled graph
    (one path at every batch size; Inductor fuses the weight's scaling into one kernel). Never in float16: diag(α)W
    rounded to fp16 would put a small α's products among its subnormals (a precaution: at α's initial 1/L only tiny
    weights get there), where α ⊙ y multiplies in float32."""
    dtype = autocast_dtype(x.device.type) or x.dtype
    if dtype == torch.float16:
        return False
    if torch.compiler.is_compiling():
        return True
    rows = x.numel() // max(1, x.shape[-1])
    return judged_bytes(rows * out_features * dtype.itemsize) >= WRITTEN_OUT_FROM_BYTES


def fold_output_scale(linear: nn.Linear, scale: nn.Module) -> None:
    """Make ``linear`` (a plain ``nn.Linear``) compute ``scale.alpha`` ⊙ its output (:class:`ScaledOutputLinear`).
    ``scale`` is referred to, not registered: it stays where it is in the module tree, so that the parameters and the
    state dict keep their names, and a ``torch.func.functional_call`` that swaps α is read here too. The caller makes
    ``scale`` itself an identity (its α is now applied by the product)."""
    if type(linear) is not nn.Linear:
        raise ValueError(f"fold_output_scale: needs a plain nn.Linear (not parametrised, not a subclass), got "
                         f"{type(linear).__name__}")
    alpha = scale.alpha
    if alpha.shape != (linear.out_features,):
        raise ValueError(f"fold_output_scale: α of shape {tuple(alpha.shape)} does not scale the "
                         f"{linear.out_features} outputs of the Linear layer")
    linear.__class__ = ScaledOutputLinear
    object.__setattr__(linear, "output_scale", scale)  # a reference, not a submodule (no second name for α)


class ScaledInputLinear(nn.Linear):
    """``nn.Linear`` of ``input_scale``·x: F.linear(x, ``input_scale``·W, b) (see :func:`fold_input_scale`)."""

    input_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.input_scale, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, input scaled by {self.input_scale:.6g}"


def fold_input_scale(linear: nn.Linear, scale: float) -> None:
    """Make ``linear`` (a plain ``nn.Linear``) compute W (``scale``·x) + b as (``scale``·W) x + b
    (:class:`ScaledInputLinear`): its parameters and their names unchanged. The caller makes the layer that applied
    ``scale`` stop applying it."""
    if type(linear) is not nn.Linear:
        raise ValueError(f"fold_input_scale: needs a plain nn.Linear (not parametrised, not a subclass), got "
                         f"{type(linear).__name__}")
    if not (isinstance(scale, float) and math.isfinite(scale) and scale != 0.0):
        raise ValueError(f"fold_input_scale: the scale must be a finite, non-zero float, got {scale!r}")
    linear.__class__ = ScaledInputLinear
    linear.input_scale = scale
