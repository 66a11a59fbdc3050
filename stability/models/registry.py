"""Backbone registry: a name and a size preset pick a model; keyword options override it.

``micro`` presets are sized for CPU runs on small images (the default, digits); ``tiny`` and
``small`` follow the papers (ViT-Ti/S, Swin-T/S, CSWin-T/S). ``lipcnn`` is not a transformer: the 1-Lipschitz
convolutional anchor of the certified-training studies (``4c3f``: GloRo's network); ``hybrid`` is a ViT on the
tokens of that anchor's AOL convolutions (``4c49``: its four convolutions, 49 tokens on MNIST; ``5c16``: one more,
stride 2, 16 tokens; ``5c49``: one more, stride 1, 49 tokens). Any preset value can be
overridden, e.g. ``build_backbone("swin", "micro", img_size=32, window_size=4)``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from .cswin import CSWinTransformer
from .hybrid import build_hybrid
from .lipconvnet import LipConvNet

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "vit": {
        "micro": dict(patch_size=2, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0),
        "tiny": dict(patch_size=4, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
        "small": dict(patch_size=4, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    },
    "swin": {
        "micro": dict(patch_size=2, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=4, mlp_ratio=2.0),
        "tiny": dict(patch_size=4, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7),
        "small": dict(patch_size=4, embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7),
    },
    "lipcnn": {  # the convolutional anchor (not a transformer): 1-Lipschitz AOL layers, MaxMin, GloRo's shapes
        "micro": dict(convs=((8, 3, 1), (8, 4, 2)), dense=(32,)),
        "4c3f": dict(convs=((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)), dense=(512, 512)),
    },
    "hybrid": {  # a ViT on the tokens of the anchor's AOL convolutions (the stem sets the tokens: side/2^strides)
        "micro": dict(convs=((8, 3, 1), (8, 4, 2)), embed_dim=16, depth=2, num_heads=1, mlp_ratio=2.0),
        "4c49": dict(convs=((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)), embed_dim=64, depth=4, num_heads=1,
                     mlp_ratio=2.0),  # 4C3F's convolutions: 7 × 7 = 49 tokens on MNIST
        "5c16": dict(convs=((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2), (64, 4, 2)), embed_dim=64, depth=4,
                     num_heads=1, mlp_ratio=2.0),  # one more stride-2 convolution: 4 × 4 = 16 tokens on MNIST
        "5c49": dict(convs=((32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2), (64, 3, 1)), embed_dim=64, depth=4,
                     num_heads=1, mlp_ratio=2.0),  # one more stride-1 convolution: a deeper stem, still 49 tokens
    },
    "cswin": {
        "micro": dict(patch_size=2, embed_dim=32, depths=(1, 2, 1), num_heads=(2, 4, 8),
                      stripe_widths=(2, 2, 2), mlp_ratio=2.0, drop_path_rate=0.0),
        "tiny": dict(patch_size=4, embed_dim=64, depths=(1, 2, 21, 1), num_heads=(2, 4, 8, 16),
                     stripe_widths=(1, 2, 7, 7)),
        "small": dict(patch_size=4, embed_dim=64, depths=(2, 4, 32, 2), num_heads=(2, 4, 8, 16),
                      stripe_widths=(1, 2, 7, 7)),
    },
}


def _vit(img_size: int, in_chans: int, num_classes: int, **options: Any) -> nn.Module:
    patch = options.get("patch_size")
    if img_size % patch:
        raise ValueError(f"vit: patch_size {patch} does not divide the image size {img_size}")
    return VisionTransformer(img_size=img_size, in_chans=in_chans, num_classes=num_classes, **options)


def _swin(img_size: int, in_chans: int, num_classes: int, **options: Any) -> nn.Module:
    patch = options.get("patch_size")
    stages = len(options["depths"])
    if img_size % patch or (img_size // patch) % 2 ** (stages - 1):
        raise ValueError(f"swin: img_size {img_size} / patch_size {patch} must be an integer divisible by "
                         f"{2 ** (stages - 1)} ({stages} stages halve the resolution {stages - 1} times)")
    model = SwinTransformer(img_size=img_size, in_chans=in_chans, num_classes=num_classes, **options)
    for module in model.modules():  # timm leaves Swin's fused SDPA path off ("experimental"); it is exact
        if hasattr(module, "fused_attn") and hasattr(module, "relative_position_bias_table"):
            module.fused_attn = True
    return model


def _cswin(img_size: int, in_chans: int, num_classes: int, **options: Any) -> nn.Module:
    return CSWinTransformer(img_size=img_size, in_chans=in_chans, num_classes=num_classes, **options)


def _hybrid(img_size: int, in_chans: int, num_classes: int, **options: Any) -> nn.Module:
    return build_hybrid(img_size, in_chans, num_classes, **options)


def _lipcnn(img_size: int, in_chans: int, num_classes: int, **options: Any) -> nn.Module:
    return LipConvNet(img_size=img_size, in_chans=in_chans, num_classes=num_classes, **options)


BUILDERS: dict[str, Callable[..., nn.Module]] = {"vit": _vit, "swin": _swin, "cswin": _cswin, "lipcnn": _lipcnn,
                                           "hybrid": _hybrid}
TRANSFORMERS = ("vit", "swin", "cswin")  # the backbones stabilizers that change attention or blocks act on


def build_backbone(name: str, size: str = "micro", *, img_size: int, in_chans: int, num_classes: int,
                   **options: Any) -> nn.Module:
    """Build backbone ``name`` at preset ``size``; ``options`` override the preset."""
    if name not in BUILDERS:
        raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(BUILDERS)}")
    if size not in PRESETS[name]:
        raise ValueError(f"unknown size {size!r} for {name}; choose one of {sorted(PRESETS[name])}")
    kwargs = {**PRESETS[name][size], **options}
    try:
        return BUILDERS[name](img_size, in_chans, num_classes, **kwargs)
    except TypeError as err:  # an option the model does not take
        raise ValueError(f"{name}: bad backbone option in {sorted(options)}: {err}") from err
