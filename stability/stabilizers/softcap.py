"""Logit soft-capping (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size", §2;
docs/methods.md#softcap): l ↦ c·tanh(l/c), on the attention logits (c = 50) and on the final logits (c = 30).

The map is the identity near 0 and bounded by ±c, so no attention logit and no class logit can grow past c however
large the weights get. The attention cap acts on scale·q kᵀ before the backbone's additive bias and mask (Gemma 2
adds its mask after capping); the final cap acts on the network's output logits. Capped attention cannot use the
fused SDPA kernels (Gemma 2 turns FlashAttention off for the same reason).
"""
from __future__ import annotations

from torch import nn

from ..models import dot_product_kernels
from .base import Stabilizer, register_stabilizer


@register_stabilizer
class SoftCap(Stabilizer):
    """``--stabilizer softcap``.

    Args:
        attention: c of the attention logits (Gemma 2: 50), or None to leave them alone.
        logits: c of the final logits (Gemma 2: 30), or None to leave them alone.
    """

    name = "softcap"
    summary = "c·tanh(l/c) on the attention logits (c = 50) and / or the final logits (c = 30)"
    source = "Gemma Team 2024 (Gemma 2)"
    prepare_order = 0  # changes the attention modules: before the stabilizers that read them (jasmin's choice of path)

    def __init__(self, attention: float | None = 50.0, logits: float | None = 30.0) -> None:
        for what, cap in (("attention", attention), ("logits", logits)):
            if cap is not None and cap <= 0:
                raise ValueError(f"softcap: {what} must be > 0 or null (no cap); got {cap}")
        if attention is None and logits is None:
            raise ValueError("softcap: attention and logits are both null, so nothing would be capped")
        self.attention, self.logits = attention, logits

    def prepare(self, network: nn.Module) -> None:
        if self.attention is not None:
            for kernel in dot_product_kernels(network.backbone, self.name):
                if kernel.logit_cap is not None:
                    raise ValueError("softcap: the attention logits are capped already")
                kernel.logit_cap = self.attention
        if self.logits is not None:
            network.logit_cap = self.logits
