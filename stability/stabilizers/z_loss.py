"""z-loss (Chowdhery et al. 2022, PaLM, §5; Wortsman et al. 2023, §3.2; docs/methods.md#z-loss):

    L_z = λ · mean over the batch of log² Z,   Z = Σ_j exp(z_j),

an auxiliary term that keeps the softmax normaliser near 1 (log Z near 0). Cross-entropy is invariant to adding a
constant to every logit, so without it the logits can drift to large |log Z| and lose precision until the output
diverges (Wortsman et al.'s output-logit divergence). λ = 1e-4 as in PaLM and Wortsman et al. log Z is computed in
float32 whatever the model's precision (a (B, K) tensor).
"""
from __future__ import annotations

import torch

from ..nn.precision import at_least_float32
from .base import ForwardStep, Stabilizer, register_stabilizer


def log_z(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_j exp(z_j) per row, in float32 at least (float64 stays float64): (B,)."""
    return torch.logsumexp(at_least_float32(logits), dim=-1)


@register_stabilizer
class ZLoss(Stabilizer):
    """``--stabilizer z_loss``.

    Args:
        lam: λ, the weight of log² Z (PaLM: 1e-4).
    """

    name = "z_loss"
    summary = "λ·log²Z of the output logits (λ = 1e-4), so the softmax normaliser stays near 1"
    source = "Chowdhery et al. 2022 (PaLM); Wortsman et al. 2023"
    backbones = ("vit", "swin", "cswin", "lipcnn", "hybrid")  # it reads only the logits

    def __init__(self, lam: float = 1e-4) -> None:
        if lam <= 0:
            raise ValueError(f"z_loss: lam must be > 0, got {lam}")
        self.lam = lam

    def loss(self, step: ForwardStep) -> torch.Tensor:
        return self.lam * log_z(step.logits).square().mean()
