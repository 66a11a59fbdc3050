"""The hybrid: a ViT whose patch embedding is a 1-Lipschitz convolutional stem (docs/methods.md#the-hybrid).

The stem is the convolutional anchor's front (:class:`~stability.models.lipconvnet.LipConvNet`: AOL convolutions,
each followed by MaxMin over channels; a stride-2 convolution halves the side), and every position of its last
feature map becomes a token: (B, C, h, w) → (B, h·w, C), followed, where C differs from the width D of the blocks, by
a 1 × 1 AOL convolution C → D. On those tokens timm's ViT adds its class token and positions and runs its blocks;
``--stabilizer lipschitz_transformer`` makes them the certified transformer's (unit L2 attention, convex residuals,
capped matrices under ``muon``).

Every layer of the stem is 1-Lipschitz by construction (AOL), so pixels → tokens is bounded by (1/min σ_pixel)·Π b_l,
b_l each layer's float64 Schur bound (≈ 1): the certified bound of the whole network composes that with the blocks'
and the head's (:mod:`stability.lipschitz.transformer_bounds`). The tokens the blocks see are h·w (+ the class
token): the stem's strides choose them, and with them the divisor of unit L2 attention, which grows with the tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..nn.aol import AOLConv2d, isometric_init_
from .lipconvnet import aol_conv_stack


class AOLStem(nn.Module):
    """Image → tokens through AOL convolutions with MaxMin; takes timm's ``embed_layer`` arguments.

    Args:
        img_size, in_chans, embed_dim: timm's (square images; ``embed_dim`` the tokens' width D).
        convs: ``[(channels, kernel, stride), …]`` as for ``lipcnn``.
        Other timm arguments (``patch_size``, ``bias``, …) are accepted and ignored: the convolutions set the
        token grid.
    """

    def __init__(self, img_size: int | Sequence[int], in_chans: int, embed_dim: int,
                 convs: Sequence[Sequence[int]] = ((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)),
                 **_timm_arguments) -> None:
        super().__init__()
        side = img_size if isinstance(img_size, int) else int(img_size[0])
        if not isinstance(img_size, int) and len(set(img_size)) != 1:
            raise ValueError(f"hybrid: the stem takes square images, got img_size {tuple(img_size)}")
        if not convs:
            raise ValueError("hybrid: the stem needs at least one convolution (convs is empty)")
        layers, channels, size = aol_conv_stack(in_chans, side, convs, "hybrid")
        if channels != embed_dim:
            layers.append(AOLConv2d(channels, embed_dim, 1))  # C → D, position by position
        self.layers = nn.Sequential(*layers)
        self.img_size, self.grid_size = (side, side), (size, size)
        self.num_patches = size * size
        stride = 2 ** sum(1 for spec in convs if int(spec[2]) == 2)
        self.patch_size = (stride, stride)  # the stem's overall stride, for timm's bookkeeping
        for module in self.layers.modules():
            if isinstance(module, AOLConv2d):
                isometric_init_(module)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def hidden_layers(self) -> list[nn.Module]:
        """The stem's AOL layers, in order (each has ``lipschitz()``)."""
        return [m for m in self.layers if hasattr(m, "lipschitz")]

    def lipschitz(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Π b_l over the stem's layers (normalised image → tokens), each layer's Schur bound in ``dtype``."""
        return torch.stack([layer.lipschitz().to(dtype) for layer in self.hidden_layers()]).prod()

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D, h, w): the last feature map."""
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"hybrid: the stem was built for {self.img_size[0]}×{self.img_size[1]} images, got "
                             f"{x.shape[-2]}×{x.shape[-1]}")
        return self.layers(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_map(x).flatten(2).transpose(1, 2)  # (B, h·w, D)

    def tokens_in(self, x: torch.Tensor, dtype: torch.dtype, differentiable: bool) -> torch.Tensor:
        """The tokens of ``x`` computed with the stem's weights cast to ``dtype`` (float64 for a certificate),
        with their graph where ``differentiable``."""
        params = {name: (p if differentiable else p.detach()).to(dtype) for name, p in self.named_parameters()}
        return torch.func.functional_call(self, params, (x.to(dtype),))


def build_hybrid(img_size: int, in_chans: int, num_classes: int,
                 convs: Sequence[Sequence[int]] = ((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)),
                 **options) -> VisionTransformer:
    """timm's ``VisionTransformer`` with :class:`AOLStem` as its patch embedding (``convs``: the stem); ``options``
    are the ViT's (``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, …)."""
    if "patch_size" in options:
        raise ValueError("hybrid: the stem's strides set the tokens; patch_size is not an option (set convs)")
    convs = [tuple(int(v) for v in spec) for spec in convs]
    return VisionTransformer(img_size=img_size, in_chans=in_chans, num_classes=num_classes,
                             embed_layer=partial(AOLStem, convs=convs), **options)


def is_stem(module: nn.Module) -> bool:
    return isinstance(module, AOLStem)


__all__ = ["AOLStem", "build_hybrid", "is_stem"]
