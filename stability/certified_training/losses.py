"""The losses of certified (Lipschitz-margin) training, as functions of the logits and the model's bound
(docs/methods.md#certified-training).

Every loss here reads the bound through one object, :class:`MarginBound`: the bound L of pixels → logits, and,
where the logits are a final linear layer z = W·h of features h with bound L_h, that layer's weight, so that a
class pair (i, j) moves by at most

    K_ij = L_h·‖w_i − w_j‖₂            (per pair; the certificate of stability/robustness/certified.py)
    K_ij = √2·L                        (where the head is not linear)

under a perturbation of ℓ2 size 1. A point whose logit z_i exceeds every other z_j by more than ε·K_ij is
certified at radius ε.

* **GloRo** (Leino, Wang & Fredrikson 2021, "Globally-Robust Neural Networks", Eq. 3): a ⊥ logit
  z_⊥ = max_{j ≠ ŷ} (z_j + ε·K_ŷj), ŷ the *predicted* class, appended to the logits; the loss is the cross-entropy
  over the K + 1 logits (the label is never ⊥). The TRADES variant of their code (``gloro.training.losses.Trades``)
  is CE(z, y) + λ·KL(softmax(z) padded with 0 ‖ softmax([z, z_⊥])), which is exactly
  λ·log(1 + e^(z_⊥ − logsumexp z)) = −λ·log(1 − P(⊥)) (:func:`bottom_kl`).
* **EMMA** (Hu, Wang, Leino & Fredrikson 2023, "Unlocking Deterministic Robustness Certification on ImageNet",
  Eq. 5; their code ``hukkai/liresnet``): each non-target logit becomes z_j + ε_j·ε·K_yj with
  ε_j = clip((z_y − z_j)/(ε·K_yj), 0.01, 1), held constant (no gradient): a pair that already reaches ε is pushed
  at ε, one that cannot is pushed at its own radius, so points far from ε do not dominate the loss.
* **Lipschitz margin** (Tsuzuku, Sato & Sugiyama 2018): every non-target logit + ε·K_yj (the paper: √2·L·ε).

Each loss takes a temperature τ: CE(τ·logits)/τ (Béthune et al. 2022), 1 in the papers, for networks whose logits
are small. All arithmetic is float32 (or the logits' dtype where it is wider), on the logits' device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EMMA_FLOOR = 0.01  # the smallest ε_j / ε of EMMA (their code's clip)


@dataclass
class MarginBound:
    """The model's bound as the losses read it, on the device (tensors may carry a gradient).

    Args:
        total: L, pixels → logits (a 0-d tensor).
        features: L_h, pixels → the input of a final linear head (a 0-d tensor), or None.
        head: that head's effective weight (K, F) times the network's logit scale, or None.
    """

    total: torch.Tensor
    features: torch.Tensor | None = None
    head: torch.Tensor | None = None

    def pair_constants(self, anchor: torch.Tensor, num_classes: int) -> torch.Tensor:
        """(B, K): K_{a,j} for each point's anchor class a (its label or its prediction), 0 at j = a."""
        if self.head is not None and self.features is not None:
            rows = self.head.to(_float(self.features))
            pairs = torch.cdist(rows, rows, compute_mode="donot_use_mm_for_euclid_dist")  # ‖w_i − w_j‖, exact
            return self.features * pairs[anchor]  # (B, K), 0 (and no NaN gradient) at j = a
        size = math.sqrt(2) * self.total
        others = 1 - F.one_hot(anchor, num_classes).to(_float(self.total))
        return size * others


def _float(t: torch.Tensor) -> torch.dtype:
    """At least float32, and at least the tensor's own dtype (float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _hard_labels(targets: torch.Tensor, loss: str) -> torch.Tensor:
    if targets.ndim != 1:
        raise ValueError(f"{loss} needs class labels; soft labels (mixup_alpha, cutmix_alpha) are not supported by it")
    return targets


def gloro_logits(logits: torch.Tensor, bound: MarginBound, eps: float | torch.Tensor) -> torch.Tensor:
    """(B, K + 1): the logits and GloRo's ⊥ logit max_{j ≠ ŷ}(z_j + ε·K_ŷj), ŷ = argmax z (Leino et al. 2021)."""
    z = logits.to(_float(logits))
    predicted = z.argmax(dim=-1)
    bottom = z + eps * bound.pair_constants(predicted, z.shape[-1])
    bottom = bottom.scatter(-1, predicted[:, None], -math.inf).amax(dim=-1, keepdim=True)
    return torch.cat([z, bottom], dim=-1)


def bottom_kl(extended: torch.Tensor) -> torch.Tensor:
    """(B,): KL(softmax(z) padded with 0 ‖ softmax([z, z_⊥])) = log(1 + e^(z_⊥ − logsumexp z)), the robust term of
    GloRo's TRADES loss (their ``Trades``, robust loss ``kl_divergence``)."""
    z, bottom = extended[:, :-1], extended[:, -1]
    return F.softplus(bottom - torch.logsumexp(z, dim=-1))


def gloro_loss(logits: torch.Tensor, targets: torch.Tensor, bound: MarginBound, eps: float | torch.Tensor,
               trades: float = 0.0, temperature: float = 1.0) -> torch.Tensor:
    """GloRo's training loss: CE over [z, z_⊥] (``trades`` 0), or CE(z, y) + λ·KL (``trades`` λ > 0); with
    temperature τ every softmax reads τ·logits and the loss is divided by τ. ``targets``: labels (B,) or soft labels
    (B, K), which ⊥ never receives."""
    extended = temperature * gloro_logits(logits, bound, eps)
    if trades > 0:
        return (F.cross_entropy(extended[:, :-1], targets) + trades * bottom_kl(extended).mean()) / temperature
    padded = targets if targets.ndim == 1 else F.pad(targets.to(extended.dtype), (0, 1))
    return F.cross_entropy(extended, padded) / temperature


def emma_logits(logits: torch.Tensor, labels: torch.Tensor, bound: MarginBound,
                eps: float | torch.Tensor) -> torch.Tensor:
    """(B, K): z_j + ε_j·ε·K_yj with ε_j = clip((z_y − z_j)/(ε·K_yj), 0.01, 1) held constant, and z_y as it is
    (Hu et al. 2023, EMMA)."""
    labels = _hard_labels(labels, "emma")
    z = logits.to(_float(logits))
    pairs = bound.pair_constants(labels, z.shape[-1])  # (B, K), 0 at the label
    offset = eps * pairs
    gaps = z.gather(-1, labels[:, None]) - z  # (B, K): z_y − z_j
    scale = (gaps / offset.clamp_min(1e-8)).clamp(EMMA_FLOOR, 1.0).detach()
    return z + scale * offset


def emma_loss(logits: torch.Tensor, targets: torch.Tensor, bound: MarginBound, eps: float | torch.Tensor,
              temperature: float = 1.0) -> torch.Tensor:
    return F.cross_entropy(temperature * emma_logits(logits, targets, bound, eps), targets) / temperature


def margin_logits(logits: torch.Tensor, targets: torch.Tensor, bound: MarginBound, eps: float | torch.Tensor,
                  pairwise: bool = False) -> torch.Tensor:
    """(B, K): every non-target logit plus ε·√2·L (Tsuzuku et al. 2018), or plus ε·K_yj (``pairwise``: the
    per-pair constant of a linear head). Soft labels y add the margin in proportion to 1 − y (√2·L only)."""
    z = logits.to(_float(logits))
    if pairwise:
        return z + eps * bound.pair_constants(_hard_labels(targets, "the pairwise margin"), z.shape[-1])
    soft = targets.to(z.dtype) if targets.ndim == 2 else F.one_hot(targets, z.shape[-1]).to(z.dtype)
    return z + math.sqrt(2) * eps * bound.total.to(z.dtype) * (1 - soft)


__all__ = ["EMMA_FLOOR", "MarginBound", "bottom_kl", "emma_logits", "emma_loss", "gloro_logits", "gloro_loss",
           "margin_logits"]
