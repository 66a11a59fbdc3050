"""LipsFormer components (Qi et al. 2023; docs/methods.md#lipsformer), each switchable for the ablations:

* ``center_norm``: CenterNorm in place of every LayerNorm (Lipschitz D/(D−1)·max|γ|);
* ``attention="cosine"``: scaled cosine similarity attention (ε > 0, τ, ν, V normalised,
  1/K head scaling; ``learn_scales=False, normalize_v=False, head_scale=False`` is the reference
  code's variant); ``"dot"`` keeps the backbone's dot-product attention;
* ``weighted_residual``: x + α ⊙ f(x) with a learnable per-channel α, initialised to ``alpha``
  or, when None, to 1/L for L transformer blocks;
* ``spectral_init``: Xavier-normal then divide by σ₁ (reshaped conv kernels, or the true conv
  operator norm with ``conv_operator_norm``); conv biases zeroed, or left at their default
  initialisation as the reference code does (``conv_bias_init: default``);
* ``branch_scale`` (CSwin, the reference code): each stripe branch's output, attention + LePE, is
  divided by √(heads in the branch);
* ``drop_path``: stochastic depth rising linearly to this rate over the blocks (0 leaves the
  backbone's own).

The backbones keep their pre-norm layout, x + α·f(CN(x)); the paper's extra depthwise-conv
branch (CMT-style) is not added. Warmup on/off is the training module's ``warmup_epochs``.
"""
from __future__ import annotations

from typing import Literal

import torch
from timm.layers import DropPath
from torch import nn

from ..models import attention_sites, norm_sites, replace_attention_kernel, residual_sites
from ..models.adapters import ConvexResidualBlock
from ..models.cswin import CrossShapedAttention
from ..nn.center_norm import CenterNorm
from ..nn.channel_scale import channel_scale
from ..nn.cosine_attention import ScaledCosineKernel
from ..nn.folded_scale import fold_output_scale
from ..nn.spectral import spectral_init_
from .base import Stabilizer, register_stabilizer


class ResidualScale(nn.Module):
    """α ⊙ x with a learnable per-channel α (LipsFormer's weighted residual shortcut); under mixed precision on a
    large input, with its backward written out (:func:`~stability.nn.channel_scale.channel_scale`). ``folded``: the
    Linear layer that writes x applies α already (:func:`~stability.nn.folded_scale.fold_output_scale`), and this
    module passes x on."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.full((dim,), float(init)))
        self.folded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.folded else channel_scale(x, self.alpha)

    def extra_repr(self) -> str:
        return "folded into the Linear layer that writes its input" if self.folded else ""


@register_stabilizer
class LipsFormer(Stabilizer):
    """``--stabilizer lipsformer``; every component can be switched on or off on its own."""

    name = "lipsformer"
    summary = "CenterNorm, scaled cosine attention, weighted residual, spectral init, DropPath — each switchable"
    source = "Qi et al. 2023"
    prepare_order = 0

    def __init__(self, center_norm: bool = True, attention: Literal["cosine", "dot"] = "cosine",
                 tau: float = 10.0, nu: float = 1.0, eps: float = 1e-6, learn_scales: bool = True,
                 normalize_v: bool = True, head_scale: bool = True, weighted_residual: bool = True,
                 alpha: float | None = None, spectral_init: bool = True, conv_operator_norm: bool = False,
                 conv_bias_init: Literal["zeros", "default"] = "zeros", branch_scale: bool = False,
                 drop_path: float = 0.0) -> None:
        if attention not in ("cosine", "dot"):
            raise ValueError(f"lipsformer: attention must be 'cosine' or 'dot', got {attention!r}")
        if eps <= 0:
            raise ValueError(f"lipsformer: eps must be > 0 (eps = 0 has no Lipschitz bound), got {eps}")
        if conv_bias_init not in ("zeros", "default"):
            raise ValueError(f"lipsformer: conv_bias_init must be 'zeros' or 'default', got {conv_bias_init!r}")
        if not 0 <= drop_path < 1:
            raise ValueError(f"lipsformer: drop_path must be in [0, 1), got {drop_path}")
        self.center_norm, self.attention = center_norm, attention
        self.tau, self.nu, self.eps = tau, nu, eps
        self.learn_scales, self.normalize_v, self.head_scale = learn_scales, normalize_v, head_scale
        self.weighted_residual, self.alpha = weighted_residual, alpha
        self.spectral_init, self.conv_operator_norm = spectral_init, conv_operator_norm
        self.conv_bias_init, self.branch_scale = conv_bias_init, branch_scale
        self.drop_path = drop_path

    def prepare(self, network: nn.Module) -> None:
        backbone = network.backbone if hasattr(network, "backbone") else network
        if self.center_norm:
            for site in norm_sites(backbone):
                site.replace(CenterNorm(site.module.normalized_shape[0]))
        if self.attention == "cosine":
            for site in attention_sites(backbone):
                self._use_cosine_attention(backbone, site.name, site.module)
        if self.branch_scale:
            for site in attention_sites(backbone):
                if isinstance(site.module, CrossShapedAttention):  # (attention + LePE) / √(heads of the branch)
                    site.module.branch_divisor = (site.num_heads // len(site.module.stripes)) ** 0.5
        residuals = residual_sites(backbone)
        blocks = len(residuals) // 2
        if self.drop_path > 0:
            for i, site in enumerate(residuals):
                rate = self.drop_path * (i // 2) / max(1, blocks - 1)
                setattr(site.block, site.attr, DropPath(rate) if rate > 0 else nn.Identity())
        if self.weighted_residual:
            init = 1.0 / blocks if self.alpha is None else self.alpha
            for site in residuals:
                site.scale_branch(ResidualScale(site.dim, init))
        if self.spectral_init:
            spectral_init_(backbone, self._conv_input_shapes(network) if self.conv_operator_norm else None,
                           zero_conv_bias=self.conv_bias_init == "zeros")

    def after_prepare(self, network: nn.Module) -> None:
        """Each weighted residual's α folded into the Linear layer that writes its branch, α ⊙ (W h + b) computed
        as (diag(α) W) h + α ⊙ b (:mod:`stability.nn.folded_scale`: the same function, without a pass over the
        branch's output each way), where the final architecture allows it: a branch that a known Linear ends
        (:meth:`~stability.models.view.ResidualSite.output_linear`: not parametrised by another stabilizer) in a
        block that applies its residual through the slot holding α (not one whose residuals another stabilizer
        computes, bypassing the slot). Elsewhere α stays a module of its own."""
        if not self.weighted_residual:
            return
        backbone = network.backbone if hasattr(network, "backbone") else network
        bypassed = {id(module.block) for module in backbone.modules() if isinstance(module, ConvexResidualBlock)}
        for site in residual_sites(backbone):
            slot = getattr(site.block, site.attr)
            scale = slot[0] if isinstance(slot, nn.Sequential) and isinstance(slot[0], ResidualScale) else None
            linear = site.output_linear()
            if scale is None or linear is None or id(site.block) in bypassed:
                continue
            fold_output_scale(linear, scale)
            scale.folded = True

    def lipschitz_bound(self, network: nn.Module) -> float | None:
        """Certified bound by composition (ViT with every component on; see stability.lipschitz.certified)."""
        from ..lipschitz.certified import certified_bound

        return certified_bound(network)[0]

    def _kernel(self, heads: int) -> ScaledCosineKernel:
        return ScaledCosineKernel(heads, self.tau, self.nu, self.eps, self.normalize_v, self.learn_scales,
                                  self.head_scale)

    def _use_cosine_attention(self, backbone: nn.Module, name: str, module: nn.Module) -> None:
        try:
            replace_attention_kernel(backbone, name, module, self._kernel(module.num_heads))
        except ValueError as err:
            raise ValueError(f"lipsformer: {err}; use attention='dot'") from None

    @staticmethod
    def _conv_input_shapes(network: nn.Module) -> dict[nn.Module, tuple]:
        """Input shape (C, H, W) of every Conv2d, from one forward pass at the network's image size."""
        size = getattr(network, "image_size", None)
        if size is None:
            raise ValueError("lipsformer: conv_operator_norm needs the network's image_size")
        in_chans = network.mean.shape[1]
        shapes, handles = {}, []
        for m in network.modules():
            if isinstance(m, nn.Conv2d):
                handles.append(m.register_forward_pre_hook(
                    lambda mod, args: shapes.__setitem__(mod, tuple(args[0].shape[1:]))))
        try:
            with torch.no_grad():
                network(network.mean.new_zeros(1, in_chans, size, size))
        finally:
            for h in handles:
                h.remove()
        return shapes
