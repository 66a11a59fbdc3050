"""A 1-Lipschitz convolutional network shaped like GloRo's "4C3F" (Leino et al. 2021; klasleino/gloro
``tools/training/architectures.py``): the convolutional anchor the certified transformers are compared with, trained
and certified by the same code (docs/methods.md#the-convolutional-anchor).

4C3F: conv 32 3×3, conv 32 4×4 stride 2, conv 64 3×3, conv 64 4×4 stride 2, dense 512, dense 512, dense K, each
hidden layer followed by MaxMin (GloRo's current code: MinMax activations, orthogonal initialisation; here the
hidden layers start as isometries, the head keeps PyTorch's default).

Where GloRo bounds each layer by power iteration (an estimate), every hidden layer here is an AOL layer
(:mod:`stability.nn.aol`): 1-Lipschitz by construction, and bounded at certification time from its effective weight
in float64. A stride-2 convolution is a 2 × 2 space-to-depth permutation followed by a stride-1 AOL convolution.
MaxMin is 1-Lipschitz. The head is GloRo's: a plain Linear layer (``head: linear``), certified per class pair by
‖w_i − w_j‖ times the bound of the features; or last-layer normalisation (``lln``, Singla et al. 2022: unit rows,
ŵ_j = w_j/‖w_j‖); or an AOL layer (``aol``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from ..nn.aol import AOLConv2d, AOLLinear, ChannelMaxMin, StridedAOLConv, isometric_init_
from ..nn.lipschitz_blocks import NormalizedLinear

HEADS = ("linear", "lln", "aol")


def aol_conv_stack(in_chans: int, img_size: int, convs: Sequence[Sequence[int]],
                   who: str) -> tuple[list[nn.Module], int, int]:
    """AOL convolutions ``[(channels, kernel, stride), …]``, each followed by MaxMin over channels: (the layers, the
    output channels, the output side). Stride 1 needs an odd kernel (zero padding keeps the size), stride 2 an even
    one (:class:`~stability.nn.aol.StridedAOLConv`: the size halves, rounding up). ``who`` names the caller in
    errors."""
    layers: list[nn.Module] = []
    channels, size = in_chans, img_size
    for spec in convs:
        out, kernel, stride = (int(v) for v in spec)
        if stride == 1:
            layers.append(AOLConv2d(channels, out, kernel))
        elif stride == 2:
            layers.append(StridedAOLConv(channels, out, kernel))
            size = (size + 1) // 2
        else:
            raise ValueError(f"{who}: conv stride must be 1 or 2, got {stride} in {list(spec)}")
        if out % 2:
            raise ValueError(f"{who}: MaxMin needs an even number of channels, got {out}")
        layers.append(ChannelMaxMin())
        channels = out
    return layers, channels, size


class LipConvNet(nn.Module):
    """Convolutions (channels, kernel, stride) with MaxMin, flatten, dense layers with MaxMin, a head.

    Args:
        img_size, in_chans, num_classes: the data's.
        convs: ``[(channels, kernel, stride), …]``; stride 1 needs an odd kernel (zero padding keeps the size),
            stride 2 an even one (the size halves, rounding up).
        dense: widths of the hidden dense layers.
        head: ``linear`` (GloRo's), ``lln`` (unit rows) or ``aol`` (1-Lipschitz).
    """

    def __init__(self, img_size: int, in_chans: int, num_classes: int,
                 convs: Sequence[Sequence[int]] = ((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)),
                 dense: Sequence[int] = (512, 512), head: Literal["linear", "lln", "aol"] = "linear") -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"lipcnn: head must be one of {list(HEADS)}, got {head!r}")
        layers, channels, size = aol_conv_stack(in_chans, img_size, convs, "lipcnn")
        self.features = nn.Sequential(*layers)
        width = channels * size * size
        hidden: list[nn.Module] = []
        for out in dense:
            if out % 2:
                raise ValueError(f"lipcnn: MaxMin needs an even width, got {out}")
            hidden += [AOLLinear(width, out), ChannelMaxMin()]  # dim 1: the features of (B, F)
            width = out
        self.dense = nn.Sequential(*hidden)
        self.num_features = width
        self.head = {"linear": nn.Linear, "lln": NormalizedLinear, "aol": AOLLinear}[head](width, num_classes)
        self.head_kind = head
        for module in self.modules():
            if isinstance(module, (AOLConv2d, AOLLinear)) and module is not self.head:
                isometric_init_(module)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def hidden_layers(self) -> list[nn.Module]:
        """The 1-Lipschitz layers between the pixels and the head, in order (each has ``lipschitz()``)."""
        return [m for m in (*self.features, *self.dense) if hasattr(m, "lipschitz")]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.features(x).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))
