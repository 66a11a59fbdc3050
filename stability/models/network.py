"""The network a stabilizer, an attack or a Lipschitz estimate sees: raw pixels in, logits out."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..nn.dot_attention import soft_cap


class Network(nn.Module):
    """``logit_scale · backbone((x − mean) / std)`` for x in [0, 1], soft-capped to ``logit_cap`` where set.

    Normalisation lives inside the network so that attack budgets and Lipschitz constants
    are in pixel units. Note that it scales the input→logits Lipschitz constant by 1/min(std).
    ``logit_scale`` (1 unless a stabilizer sets it, e.g. the Lipschitz transformer's, after its
    reference's ``final_scale``) multiplies the logits; it is part of the model and of every bound of it.
    ``logit_cap`` c (None unless ``softcap`` sets it) maps the logits through c·tanh(z/c) (Gemma 2).
    """

    def __init__(self, backbone: nn.Module, mean: Sequence[float], std: Sequence[float],
                 image_size: int | None = None) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std need one entry per channel; got {len(mean)} and {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {tuple(std)}")
        self.backbone = backbone
        self.image_size = image_size  # side of the square inputs, for layers that need the input shape
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.logit_scale = 1.0  # a plain number: set by a stabilizer's prepare(), rebuilt from the hyperparameters
        self.logit_cap: float | None = None  # likewise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.backbone((x - self.mean) / self.std)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits if self.logit_cap is None else soft_cap(logits, self.logit_cap)
