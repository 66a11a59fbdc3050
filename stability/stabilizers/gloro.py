"""GloRo: globally-robust training with a ⊥ class (Leino, Wang & Fredrikson 2021, "Globally-Robust Neural
Networks", ICML; code: klasleino/gloro; docs/methods.md#certified-training).

The logits gain a ⊥ logit z_⊥ = max_{j ≠ ŷ}(z_j + ε·K_ŷj), ŷ the predicted class and K_ŷj the per-pair constant of
the model's bound (L_h·‖w_ŷ − w_j‖ with a linear head, √2·L otherwise); a point is certified at ε exactly when the
prediction beats ⊥. The loss is the cross-entropy over the K + 1 logits (the label is never ⊥) or, with
``trades`` λ > 0, the TRADES-like loss of their code: CE(z, y) + λ·KL(softmax(z) ‖ softmax([z, z_⊥])), λ constant
or rising linearly from 0 over training (``trades_ramp``, their ``TradesScheduler('linear')``). Their MNIST recipe
trains at 1.1 × the evaluated radius, reached on their logarithmic curve from 1% of it over the first half of
training (``overshoot: 1.1, ramp: log, ramp_end: 0.5, ramp_from: 0.01``; configs/stabilizer/gloro_mnist.yaml).
The bound comes from :class:`~stability.lipschitz.training_bound.TrainingBound`.
"""
from __future__ import annotations

import torch

from ..certified_training import MarginBound, gloro_loss, linear_weight
from .base import ForwardStep, register_stabilizer
from .certified_loss import CertifiedLoss


@register_stabilizer
class GloRo(CertifiedLoss):
    """``--stabilizer gloro`` (with ``lipschitz_transformer`` on ViT; alone on ``--model.backbone lipcnn``).

    Args:
        eps: the ℓ2 radius (pixel units) the model is to certify.
        trades: λ of the TRADES-like loss (0: cross-entropy over the logits and ⊥).
        trades_ramp: λ rises linearly from 0 to ``trades`` over training.
        overshoot, ramp, ramp_start, ramp_end, ramp_from: the radius's schedule; temperature, iterations,
            bound_gradient: as ``lipschitz_margin`` (:class:`~stability.stabilizers.certified_loss.CertifiedLoss`).
    """

    name = "gloro"
    summary = ("task loss: cross-entropy with a ⊥ logit max_{j≠ŷ}(z_j + ε·K_ŷj) (or CE + λ·KL to it, TRADES-like): "
               "the prediction must beat ⊥ to count")
    source = "Leino et al. 2021"
    takes_label_smoothing = False  # the ⊥ class has no smoothed target

    def __init__(self, eps: float = 0.5, trades: float = 0.0, trades_ramp: bool = False, overshoot: float = 1.0,
                 ramp: str = "none", ramp_start: float = 0.0, ramp_end: float = 0.5, ramp_from: float = 0.01,
                 temperature: float = 1.0, iterations: int = 1, bound_gradient: bool = True) -> None:
        if trades < 0:
            raise ValueError(f"gloro: trades (λ) must be >= 0, got {trades}")
        super().__init__(eps, overshoot, ramp, ramp_start, ramp_end, ramp_from, temperature, iterations,
                         bound_gradient)
        self.trades, self.trades_ramp = trades, trades_ramp
        self.last_trades: float | None = None

    def loss_of(self, step: ForwardStep, bound: MarginBound, eps: float, default) -> torch.Tensor:
        self.last_trades = linear_weight(self.trades, step.progress, self.trades_ramp)
        return gloro_loss(step.logits, step.targets, bound, eps, self.last_trades, self.temperature)

    def signals(self) -> dict[str, float | torch.Tensor]:
        out = super().signals()
        if self.trades and self.last_trades is not None:
            out["trades"] = self.last_trades
        return out

    def hparams(self) -> dict:
        return {k: v for k, v in super().hparams().items() if k != "last_trades"}
