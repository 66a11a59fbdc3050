"""QK normalisation (Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", §2.1;
Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities", §3.1;
docs/methods.md#qk-norm):

    logits = (LN(q) · LN(k)ᵀ) / √d,

a LayerNorm (or RMSNorm) over each head's d query and key features, with learned gain (and bias), shared by the
heads of a layer — timm's ``qk_norm``. It bounds |logit| by the norms' gains times √d, so the attention logits
cannot grow without the gains growing: the attention-logit growth Dehghani et al. saw diverge ViT-22B.
"""
from __future__ import annotations

from typing import Literal

from torch import nn

from ..models import attention_sites, dot_product_kernels
from .base import Stabilizer, register_stabilizer

NORMS = ("layernorm", "rmsnorm")


@register_stabilizer
class QKNorm(Stabilizer):
    """``--stabilizer qk_norm``.

    Args:
        norm: ``layernorm`` (ViT-22B, timm) or ``rmsnorm``.
        eps: the norm's ε (timm's ViT uses 1e-6).
    """

    name = "qk_norm"
    summary = "LayerNorm (or RMSNorm) over each head's queries and keys before the dot product"
    source = "Dehghani et al. 2023; Wortsman et al. 2023"
    prepare_order = 0  # changes the attention modules: before the stabilizers that read them (jasmin's choice of path)

    def __init__(self, norm: Literal["layernorm", "rmsnorm"] = "layernorm", eps: float = 1e-6) -> None:
        if norm not in NORMS:
            raise ValueError(f"qk_norm: norm must be one of {NORMS}, got {norm!r}")
        if eps <= 0:
            raise ValueError(f"qk_norm: eps must be > 0, got {eps}")
        self.norm, self.eps = norm, eps

    def _make(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=self.eps) if self.norm == "layernorm" else nn.RMSNorm(dim, eps=self.eps)

    def prepare(self, network: nn.Module) -> None:
        backbone = network.backbone if hasattr(network, "backbone") else network
        kernels = dot_product_kernels(backbone, self.name)
        for site, kernel in zip(attention_sites(backbone), kernels):
            if not (isinstance(kernel.q_norm, nn.Identity) and isinstance(kernel.k_norm, nn.Identity)):
                raise ValueError(f"qk_norm: attention {site.name!r} already normalises its queries and keys")
            kernel.q_norm, kernel.k_norm = self._make(site.head_dim), self._make(site.head_dim)
