"""Cross-entropy with a temperature and a margin offset, the loss of 1-Lipschitz classifiers
(Béthune et al. 2022, "Pay Attention to Your Loss: Understanding Misconceptions about 1-Lipschitz Neural
Networks"; Prach & Lampert 2022, "Almost-Orthogonal Layers for Efficient General-Purpose Lipschitz
Networks"; docs/methods.md#logit-scale-and-loss-temperature).

The task loss becomes

    CE(τ·(z − m·e_y), y) / τ,

for soft labels y: CE(τ·(z − m·y), y)/τ. A network whose every layer is 1-Lipschitz keeps its logits about
as small as its input, and the plain cross-entropy of such logits cannot go low (with ‖z‖₂ ≤ r and K classes,
CE ≥ log(1 + (K − 1)·e^(−r√(K/(K−1))))): its gradient then keeps pushing every point, well classified or not.
τ sharpens the softmax instead of the logits, so the model — and its Lipschitz bound and certified radii —
is left alone; dividing by τ keeps the loss's size. The offset m asks for a margin of m between the true
logit and the others (orthogonium's ``LossXent(offset, temperature)``; Prach & Lampert use m = 2√2·ε to
certify radius ε with a 1-Lipschitz network).

Against the logit scale of ``lipschitz_transformer`` (the reference code's ``final_scale``): that one changes
the model — its bound grows with it, its certified radii do not change —, this one changes only the
objective.
"""
from __future__ import annotations

import torch

from ..nn.precision import at_least_float32
from .base import ForwardStep, Stabilizer, register_stabilizer


@register_stabilizer
class TauCrossEntropy(Stabilizer):
    """``--stabilizer tau_ce``.

    Args:
        temperature: τ > 0 (1: the plain cross-entropy when the offset is 0).
        offset: m ≥ 0, the margin asked of the true logit over the others.
    """

    name = "tau_ce"
    summary = ("task loss CE(τ·(z − m·e_y), y)/τ: a temperature (and a margin offset) for the small logits of a "
               "Lipschitz network")
    source = "Béthune et al. 2022; Prach & Lampert 2022"
    backbones = ("vit", "swin", "cswin", "lipcnn", "hybrid")  # it reads only the logits

    def __init__(self, temperature: float = 8.0, offset: float = 0.0) -> None:
        if temperature <= 0 or offset < 0:
            raise ValueError(f"tau_ce: need temperature > 0 and offset >= 0; got {temperature}, {offset}")
        self.temperature, self.offset = temperature, offset

    def task_loss(self, step: ForwardStep, default) -> torch.Tensor:
        logits = at_least_float32(step.logits)
        shifted = logits - self.offset * step.soft_targets().to(logits.dtype)
        return default(self.temperature * shifted) / self.temperature
