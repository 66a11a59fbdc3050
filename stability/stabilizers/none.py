"""The plain baseline: the backbone as built, the default optimizer, no extra loss."""
from __future__ import annotations

from .base import Stabilizer, register_stabilizer


@register_stabilizer
class NoStabilizer(Stabilizer):
    """``--stabilizer none``: changes nothing, so every comparison has a reference run."""

    name = "none"
    summary = "the plain backbone and optimizer"
    source = ""
    backbones = ("vit", "swin", "cswin", "lipcnn", "hybrid")
