"""Almost-orthogonal layers, AOL (Prach & Lampert 2022, "Almost-Orthogonal Layers for Efficient General-Purpose
Lipschitz Networks", Theorems 1–2; docs/methods.md#the-convolutional-anchor): 1-Lipschitz by construction.

A parameter P (a matrix, or a convolution kernel) is used as W = P·D with D = diag(d), d_i = (Σ_j |PᵀP|_ij)^(−1/2)
over the input features (input channels of a convolution). Then ‖W‖₂ ≤ 1 for every P, because PᵀP ≼ diag(Σ_j |PᵀP|_ij)
(a symmetric matrix is dominated by its absolute row sums), so DPᵀPD ≼ I.

For a convolution, PᵀP is the convolution operator with the kernel M(a, b, s) = Σ_o Σ_t P(o, a, t)·P(o, b, t + s)
(channels a, b, spatial shift s), the kernel's self-correlation over 2k − 1 shifts, and the row sums are
Σ_b Σ_s |M(a, b, s)|: the bound holds for the operator on the whole plane, hence for any zero-padded image size (a
restriction of it), and for every stride (a subsampling of its output).

:func:`schur_bound` is the certificate of one layer, computed from the layer's *effective* weight W: for any positive
q, ‖W‖₂² ≤ max_a Σ_b |WᵀW|_ab·q_b / q_a (the weighted Schur test); with q = 1/d from P it is 1 in exact arithmetic,
and what rounding left of it in float64 is what a certificate multiplies.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .lipschitz_blocks import max_min
from .precision import at_least_float32, autocast_off, float32_math


def _gram_rows(gram: torch.Tensor) -> torch.Tensor:
    """Σ_b Σ_s |M(a, b, s)| per row a of a Gram matrix (F, F) or self-correlation kernel (C, C, k', k')."""
    return gram.abs().flatten(1).sum(dim=1)


def self_correlation(kernel: torch.Tensor) -> torch.Tensor:
    """M(a, b, s) = Σ_o Σ_t K(o, a, t)·K(o, b, t + s) of a kernel (C_out, C_in, k, k): (C_in, C_in, 2k − 1, 2k − 1)."""
    k = kernel.shape[-1]
    per_input = kernel.transpose(0, 1)  # (C_in, C_out, k, k)
    return F.conv2d(per_input, per_input, padding=k - 1)


def gram(weight: torch.Tensor) -> torch.Tensor:
    """PᵀP of a matrix (F_out, F_in), or the self-correlation of a kernel (C_out, C_in, k, k)."""
    return weight.mT @ weight if weight.ndim == 2 else self_correlation(weight)


def aol_scale(weight: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """d_i = (Σ_j |PᵀP|_ij)^(−1/2), one per input feature (input channel), in at least float32 and at least the
    weight's dtype, with autocast and TF32 off: the Gram's sums in bf16 or TF32 move d by up to ~0.5%, and the
    network trained would not be the one :func:`schur_bound` certifies. Inside ``torch.compile`` only autocast is
    switched off (setting the TF32 flags would break the graph at every layer): the run's TF32 setting applies."""
    weight = at_least_float32(weight)
    device = weight.device.type
    exact = autocast_off(device) if torch.compiler.is_compiling() else float32_math(device)
    with exact:
        rows = _gram_rows(gram(weight))
    return rows.clamp_min(eps).rsqrt()


def aol_weight(weight: torch.Tensor) -> torch.Tensor:
    """W = P·diag(d): the columns (input channels) of P rescaled so that ‖W‖₂ ≤ 1 (in the weight's dtype)."""
    d = aol_scale(weight)
    scaled = at_least_float32(weight) * (d if weight.ndim == 2 else d[None, :, None, None])
    return scaled.to(weight.dtype)


def schur_bound(parameter: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An upper bound of ‖W‖₂ for W = :func:`aol_weight` (P) computed in ``dtype``: √(max_a Σ_b |WᵀW|_ab·q_b/q_a)
    with q_a = √(Σ_b |PᵀP|_ab), the weighted Schur test (module docstring); ≈ 1, never below the operator norm."""
    p = parameter.detach().to(dtype)
    w = aol_weight(p)
    q = _gram_rows(gram(p)).clamp_min(1e-300).sqrt()
    m = gram(w).abs()
    weighted = m * (q[None, :] if m.ndim == 2 else q[None, :, None, None])
    return (weighted.flatten(1).sum(dim=1) / q).max().sqrt()


# layer id → (layer, its parameter, the parameter's version and storage then, its effective weight): the weights
# frozen by frozen_aol_weights
_FROZEN: dict[int, tuple[nn.Module, torch.Tensor, int, int, torch.Tensor]] = {}


def _frozen_weight(layer: nn.Module) -> torch.Tensor | None:
    """The layer's frozen effective weight while its parameter is the one frozen, unchanged (same object, version
    and storage, dtype and device), else None. In-place edits through ``.data`` are not seen: not supported."""
    frozen = _FROZEN.get(id(layer))
    if frozen is None:
        return None
    owner, parameter, version, pointer, weight = frozen
    current = layer.weight
    if owner is not layer or current is not parameter or current._version != version \
            or current.data_ptr() != pointer or weight.dtype != current.dtype or weight.device != current.device:
        return None
    return weight


def is_frozen(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is an AOL layer's parameter whose effective weight is frozen now (no gradient reaches
    it through its layer)."""
    return any(entry[1] is parameter for entry in _FROZEN.values())


def _effective(layer: nn.Module) -> torch.Tensor:
    """:func:`aol_weight` of the layer's parameter, or the one frozen for it (not inside ``torch.compile``: a
    compiled graph computes its own)."""
    if not torch.compiler.is_compiling():
        frozen = _frozen_weight(layer)
        if frozen is not None:
            return frozen
    return aol_weight(layer.weight)


@contextlib.contextmanager
def frozen_aol_weights(network: nn.Module) -> Iterator[None]:
    """Inside the block each AOL layer of ``network`` multiplies by its effective weight computed once, on entry and
    without gradient, instead of recomputing PᵀP (or the kernel's self-correlation) at every pass: for measurements,
    whose thousands of passes neither change the weights nor differentiate them (the 4C3F anchor's dense layers:
    a pass on 50 points 3× faster on the CPU). The values are those each pass would compute. A layer whose parameter
    has changed since (its version or storage), or been replaced, or a copy of the network, computes its own again;
    so does a parameter made in inference mode, which keeps no version."""
    local = {}
    with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor, usable where gradients are allowed
        for layer in network.modules():
            if isinstance(layer, (AOLLinear, AOLConv2d)) and id(layer) not in _FROZEN \
                    and not layer.weight.is_inference():
                weight = layer.weight
                local[id(layer)] = (layer, weight, weight._version, weight.data_ptr(), aol_weight(weight))
    try:
        _FROZEN.update(local)  # all at once: a failure above leaves nothing frozen
        yield
    finally:
        for key in local:
            _FROZEN.pop(key, None)


class AOLLinear(nn.Linear):
    """A Linear layer whose weight is :func:`aol_weight` of its parameter: ‖W‖₂ ≤ 1."""

    def effective_weight(self) -> torch.Tensor:
        return _effective(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def lipschitz(self) -> torch.Tensor:
        return schur_bound(self.weight)


class AOLConv2d(nn.Conv2d):
    """A stride-1 convolution with zero padding whose kernel is :func:`aol_weight` of its parameter: 1-Lipschitz.
    ``padding``: ``same`` (odd kernels) or four ints (left, right, top, bottom), as ``F.pad`` takes them."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding="same", bias: bool = True):
        super().__init__(in_channels, out_channels, kernel_size, padding=0, bias=bias)
        if padding == "same":
            if kernel_size % 2 == 0:
                raise ValueError(f"padding 'same' needs an odd kernel, got {kernel_size}; give four pads instead")
            padding = (kernel_size // 2,) * 4
        self.pads = tuple(padding)

    def effective_weight(self) -> torch.Tensor:
        return _effective(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_conv2d(x, self.effective_weight(), self.bias, self.pads)

    def lipschitz(self) -> torch.Tensor:
        return schur_bound(self.weight)


def padded_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pads: tuple[int, int, int, int],
                  stride: int = 1) -> torch.Tensor:
    """``F.conv2d(F.pad(x, pads), weight, bias, stride)`` for zero pads (left, right, top, bottom), without padding a
    copy of the input: the convolution's own symmetric padding, at least each side's, then the outputs the wider
    padding adds cut off (an output reads the same window of zeros and input either way). The padded copy and its
    backward were a tenth of the AOL stem's CPU step."""
    left, right, top, bottom = pads
    if left == right and top == bottom:
        return F.conv2d(x, weight, bias, stride=stride, padding=(top, left))

    def symmetric(before: int, after: int) -> int:  # ≥ both, and ≡ before (mod stride): the windows stay aligned
        return before + stride * -(-max(0, after - before) // stride)

    pad_h, pad_w = symmetric(top, bottom), symmetric(left, right)
    out = F.conv2d(x, weight, bias, stride=stride, padding=(pad_h, pad_w))
    rows = (x.shape[-2] + top + bottom - weight.shape[-2]) // stride + 1
    cols = (x.shape[-1] + left + right - weight.shape[-1]) // stride + 1
    first_row, first_col = (pad_h - top) // stride, (pad_w - left) // stride
    return out[..., first_row:first_row + rows, first_col:first_col + cols]


class StridedAOLConv(nn.Module):
    """A k × k convolution of stride 2 (k even) as an isometry and a stride-1 AOL convolution: the input's 2 × 2
    blocks become channels (``pixel_unshuffle``, a permutation of the pixels), then a (k/2) × (k/2) AOL convolution.
    This computes the same family of functions as GloRo's 4 × 4 stride-2 convolutions up to a one-pixel shift of the
    windows (each output reads a 4 × 4 window of the input starting at an even offset; TensorFlow's ``same`` padding
    starts GloRo's at odd ones), and its AOL bound is that of a stride-1 convolution, where AOL applied to
    the strided kernel would bound the unstrided one (four times the outputs)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 4, bias: bool = True) -> None:
        super().__init__()
        if kernel_size % 2:
            raise ValueError(f"a stride-2 AOL convolution needs an even kernel, got {kernel_size}")
        half = kernel_size // 2
        pads = ((half - 1) // 2, half // 2) * 2  # total half − 1 each way: the output keeps ⌈size/2⌉
        self.conv = AOLConv2d(4 * in_channels, out_channels, half, padding=pads, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``conv(pixel_unshuffle(x))``, computed as the k × k convolution of stride 2 it is: the (k/2) × (k/2) AOL
        kernel on 2 × 2 blocks, rearranged (``pixel_shuffle`` of the kernel), on the input itself. An odd size is
        padded with a zero row or column first (an isometric embedding), as the blocks need."""
        left, right, top, bottom = self.conv.pads
        pads = (2 * left, 2 * right + x.shape[-1] % 2, 2 * top, 2 * bottom + x.shape[-2] % 2)
        return padded_conv2d(x, F.pixel_shuffle(self.conv.effective_weight(), 2), self.conv.bias, pads, stride=2)

    def blockwise(self, x: torch.Tensor) -> torch.Tensor:
        """The definition, step by step: zero padding to even sizes, ``pixel_unshuffle``, the AOL convolution."""
        if x.shape[-1] % 2 or x.shape[-2] % 2:
            x = F.pad(x, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2))
        return self.conv(F.pixel_unshuffle(x, 2))

    def lipschitz(self) -> torch.Tensor:
        return self.conv.lipschitz()


class ChannelMaxMin(nn.Module):
    """MaxMin over channels (dim 1 of (B, C, …); GloRo's ``MinMax``): channel i of the first half and channel i of the
    second half become their max and their min — a permutation at every point, so 1-Lipschitz and norm-preserving."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2:
            raise ValueError(f"MaxMin pairs channels: it needs an even number, got {x.shape[1]}")
        return max_min(x, dim=1)


@torch.no_grad()
def isometric_init_(layer: nn.Module) -> None:
    """An AOL layer that starts as an isometry (or its transpose where it narrows): a (semi-)orthogonal matrix in one
    tap of the kernel (the centre of an odd one), zeros elsewhere — then PᵀP is diagonal in that tap, d = 1 (or the
    matrix's own column norms) and W = P. Prach & Lampert initialise their convolutions the same way."""
    weight = layer.weight
    if weight.ndim == 2:
        nn.init.orthogonal_(weight)
        return
    out_channels, in_channels, k, _ = weight.shape
    centre = torch.empty(out_channels, in_channels, dtype=weight.dtype, device=weight.device)
    nn.init.orthogonal_(centre)
    weight.zero_()
    weight[:, :, (k - 1) // 2, (k - 1) // 2] = centre


__all__ = ["AOLConv2d", "AOLLinear", "ChannelMaxMin", "StridedAOLConv", "aol_scale", "aol_weight",
           "frozen_aol_weights", "gram", "is_frozen", "isometric_init_", "padded_conv2d", "schur_bound",
           "self_correlation"]
