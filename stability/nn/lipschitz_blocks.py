"""Building blocks of Newhouse et al.'s Lipschitz transformer (docs/methods.md#lipschitz-transformer)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# max |GELU'(x)|, reached at x = √2: Φ(√2) + √2·φ(√2) ≈ 1.1289041. The paper writes 1.1289,
# which leaves GELU/1.1289 Lipschitz 1.0000037; dividing by the exact value makes it 1-Lipschitz.
GELU_LIPSCHITZ = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)


class ScaledGELU(nn.Module):
    """GELU(x) / max|GELU'| (≈ 1.1289): 1-Lipschitz. ``folded``: the Linear layer that reads the output divides
    already (:func:`~stability.nn.folded_scale.fold_input_scale`), and this module returns GELU(x)."""

    divisor = GELU_LIPSCHITZ
    folded = False  # a class default: modules pickled before it existed read it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) if self.folded else F.gelu(x) / self.divisor

    def extra_repr(self) -> str:
        return "1/1.1289 folded into the Linear layer that reads its output" if self.folded else ""


class MaxMin(nn.Module):
    """MaxMin, GroupSort with groups of two (Anil, Lucas & Grosse 2019, "Sorting out Lipschitz function
    approximation"; Chernodub & Nowicki 2016's OPLU): feature i of the first half and feature i of the second
    half become their max and their min. At every point the output is a permutation of the input, so the map
    is 1-Lipschitz and keeps the norm, ‖MaxMin(x)‖ = ‖x‖: its Jacobian is orthogonal wherever it exists, where
    a ReLU's or GELU's shrinks what it passes (the 1-Lipschitz networks' activation: GloRo, SOC, AOL)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"MaxMin pairs features: it needs an even width, got {x.shape[-1]}")
        return max_min(x, dim=-1)


def max_min(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The two halves of ``x`` along ``dim`` → their elementwise max, then their min: one comparison, two selects
    (a third less time than maximum and minimum, whose backward passes each compare again). The backward routes
    each half's gradient by the same comparison, kept as one byte an entry: two selects, where autograd's own
    backward of the selects takes four and two additions (on the AOL stem's (B, C, 28, 28) maps, most of MaxMin's
    time)."""
    return _MaxMin.apply(x, dim)[0]


class _MaxMin(torch.autograd.Function):
    """MaxMin of :func:`max_min` with the backward that routes the gradient by the forward's comparison (the
    Jacobian is that permutation); composable with torch.func's reverse mode (vmap rule generated from these
    operators). No forward mode (``jvp``): torch.compile does not trace a Function that defines one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=dim)
        first = a > b
        return torch.cat([torch.where(first, a, b), torch.where(first, b, a)], dim=dim), first

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_first) -> tuple[torch.Tensor, None]:
        (first,) = ctx.saved_tensors
        to_max, to_min = grad.chunk(2, dim=ctx.dim)
        return torch.cat([torch.where(first, to_max, to_min), torch.where(first, to_min, to_max)], dim=ctx.dim), None


def activation_lipschitz(act: nn.Module) -> float | None:
    """Lip(act) in ℓ2 for the activations the bounds know, else None. Each maps 0 to 0, so also
    ‖act(x)‖ ≤ Lip·‖x‖ (what the bounds use for sizes)."""
    if isinstance(act, (ScaledGELU, nn.ReLU, MaxMin)):
        return 1.0
    if isinstance(act, nn.GELU):
        return GELU_LIPSCHITZ
    return None


class LipschitzDotKernel(nn.Module):
    """(1/3)·softmax(s·QKᵀ/d + B)·V per head: the attention of Newhouse et al.'s Lipschitz
    transformer (1/d instead of 1/√d; the 1/3 sits before W_O). ``folded``: W_O's Linear layer divides by 3 already
    (:func:`~stability.nn.folded_scale.fold_input_scale`), and this kernel returns softmax(…)·V."""

    divisor = 3.0
    folded = False  # a class default: modules pickled before it existed read it too

    def __init__(self, head_dim: int, s: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.s = head_dim, s

    def logits(self, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The softmax's input s·QKᵀ/d + B, (B', h, N, N)."""
        logits = (self.s / self.head_dim) * (q @ k.transpose(-2, -1))
        return logits if bias is None else logits + bias

    def forward(self, q, k, v, bias, attn_drop: nn.Dropout, fused: bool) -> torch.Tensor:
        if fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.s / self.head_dim,
                                                 dropout_p=attn_drop.p if self.training else 0.0)
        else:
            out = attn_drop(self.logits(q, k, bias).softmax(dim=-1)) @ v
        return out if self.folded else out / self.divisor

    def extra_repr(self) -> str:
        return f"s={self.s}, head_dim={self.head_dim}" + (", 1/3 folded into W_O" if self.folded else "")


class FlattenLinear(nn.Linear):
    """The classifier head on every token: (B, N, D) → flatten → (B, N·D) → W. Flattening is an isometry (ℓ2 of the
    flat vector = Frobenius norm of the tokens), so the head's bound is σ₁(W), with no 1/√N and nothing averaged away:
    the patches' positions reach the logits directly (a Lipschitz network's choice on small images)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(1))


class NormalizedLinear(nn.Linear):
    """Last-layer normalisation (Singla, Singla & Feizi 2022): the logits are ŵ_j·h with unit rows ŵ_j = w_j/‖w_j‖, so
    every class pair's certificate constant ‖ŵ_i − ŵ_j‖ is at most 2 whatever the training did to the rows' sizes."""

    def effective_weight(self) -> torch.Tensor:
        return F.normalize(self.weight, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)


class NormalizedFlattenLinear(NormalizedLinear):
    """:class:`NormalizedLinear` on every token, flattened (:class:`FlattenLinear`'s isometry)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(1))


def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a Linear layer multiplies by: its ``effective_weight()`` where it rescales its parameter (AOL,
    last-layer normalisation), else its ``weight``."""
    return layer.effective_weight() if hasattr(layer, "effective_weight") else layer.weight
