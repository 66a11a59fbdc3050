"""The certified bound of the convolutional anchor (:class:`~stability.models.lipconvnet.LipConvNet`), composed from
its measured weights (docs/methods.md#the-convolutional-anchor):

    Lip(pixels → features) ≤ (1/min σ_pixel) · Π_layers ‖W_l‖₂ · Π Lip(MaxMin) = (1/min σ_pixel) · Π_layers b_l,

b_l the weighted Schur bound of each AOL layer's effective weight (:func:`~stability.nn.aol.schur_bound`, ≈ 1, in
float64), MaxMin and the space-to-depth permutation 1-Lipschitz; then the head z = c·W·h: per class pair
‖c·w_i − c·w_j‖ times the features' bound (the refinement :func:`~stability.robustness.certified.certified_radii`
takes), σ₁(c·W) times it for the whole. Nothing here is estimated: AOL bounds every layer by construction, and the
float64 composition is what the certificate multiplies.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.lipconvnet import LipConvNet
from ..nn.lipschitz_blocks import effective_weight


def is_lipconvnet(network: nn.Module) -> bool:
    return isinstance(getattr(network, "backbone", None), LipConvNet)


def features_bound(network: nn.Module, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(1/min σ_pixel)·Π b_l: pixels → the head's input, in ``dtype`` (the layers' float64 Schur bounds)."""
    backbone: LipConvNet = network.backbone
    bound = 1.0 / network.std.detach().to(dtype).min()
    for layer in backbone.hidden_layers():
        bound = bound * layer.lipschitz().to(dtype)
    return bound


def scaled_head(network: nn.Module) -> torch.Tensor:
    """c·W of the head (its effective weight: unit rows with ``head: lln``), detached, as certificates read it."""
    return effective_weight(network.backbone.head).detach().clone() * abs(network.logit_scale)


def head_norm(network: nn.Module, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """‖c·W‖₂ of the head, exact (an AOL head's Schur bound)."""
    head = network.backbone.head
    if hasattr(head, "lipschitz"):
        return head.lipschitz().to(dtype) * abs(network.logit_scale)
    return torch.linalg.matrix_norm(scaled_head(network).to(dtype), ord=2)


__all__ = ["features_bound", "head_norm", "is_lipconvnet", "scaled_head"]
