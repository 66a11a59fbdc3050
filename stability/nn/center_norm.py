"""CenterNorm (LipsFormer, Qi et al. 2023, Sec. 4.1.1):

    CN(x) = γ ⊙ (D/(D−1)) · (x − mean(x)) + β

LayerNorm without the division by the standard deviation. Its Jacobian is the constant
diag(γ)·D/(D−1)·(I − 11ᵀ/D), so its Lipschitz constant is at most D/(D−1)·max|γ| (the
projection I − 11ᵀ/D has norm 1), with equality when all |γ_i| are equal, as at init. With
unequal γ the exact constant is ‖diag(γ)(I − 11ᵀ/D)‖₂·D/(D−1), which can be smaller.
"""
from __future__ import annotations

import torch
from torch import nn


class CenterNorm(nn.Module):
    """CenterNorm over the last dimension (size ``dim``); γ = 1, β = 0 at init."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim < 2:
            raise ValueError(f"CenterNorm needs dim >= 2, got {dim}")
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """β + (x − mean(x)) ⊙ (γ·D/(D−1)): the scale rides on γ (a (D,) vector), and one ``addcmul`` scales and
        shifts (three passes over x and its centred copy forward, where a product by γ, one by D/(D−1) and a sum
        made five, and fewer backward)."""
        return torch.addcmul(self.bias, x - x.mean(dim=-1, keepdim=True), self.weight * (self.dim / (self.dim - 1)))

    def lipschitz(self) -> float:
        """D/(D−1)·max|γ|: an upper bound, exact when |γ| is uniform."""
        return self.dim / (self.dim - 1) * float(self.weight.detach().abs().max())
