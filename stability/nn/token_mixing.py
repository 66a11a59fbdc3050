"""A token mixer that is not attention: the certified transformer's control (docs/methods.md#certified-transformer).

    F(X) = M · X · W_Vᵀ · W_Oᵀ,    X: the N × D tokens, M: N × N, W_V, W_O: D × D,

a linear map of the whole sequence. Mixing the tokens with a fixed-size matrix is what MLP-Mixer does (Tolstikhin et
al. 2021), and, with M a shift, LipShiFT (arXiv 2503.14751) in the 1-Lipschitz setting. F is the Kronecker product
(W_O W_V) ⊗ M acting on vec(X), so in ℓ2 over the whole sequence Lip(F) = ‖M‖₂·‖W_O W_V‖₂ ≤ ‖M‖₂‖W_V‖₂‖W_O‖₂: with
every σ₁ ≤ 1 (Muon's hard cap on these square matrices) it is 1-Lipschitz, like unit L2 attention, but its mixing does
not depend on the tokens. Per token, ‖F(X)_i‖ ≤ ‖W_O‖‖W_V‖·Σ_j |M_ij|·max_j ‖x_j‖.
"""
from __future__ import annotations

import torch
from torch import nn


class TokenMixing(nn.Module):
    """Replaces a ViT attention module: ``mix`` (N → N, over the token axis), ``v`` and ``proj`` (D → D), no biases."""

    def __init__(self, dim: int, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.v = nn.Linear(dim, dim, bias=False)
        self.mix = nn.Linear(tokens, tokens, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        if x.shape[1] != self.tokens:
            raise ValueError(f"TokenMixing was built for {self.tokens} tokens, got {x.shape[1]}")
        v = self.v(x)  # (B, N, D)
        return self.proj(self.mix(v.transpose(1, 2)).transpose(1, 2))
