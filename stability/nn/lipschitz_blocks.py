"""Building blocks of Newhouse et al.'s Lipschitz transformer (METHODS.md §4)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# max |GELU'(x)|, reached at x = √2: Φ(√2) + √2·φ(√2) ≈ 1.1289041. The paper writes 1.1289,
# which leaves GELU/1.1289 Lipschitz 1.0000037; dividing by the exact value makes it 1-Lipschitz.
GELU_LIPSCHITZ = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)


class ScaledGELU(nn.Module):
    """GELU(x) / max|GELU'| (≈ 1.1289): 1-Lipschitz."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) / GELU_LIPSCHITZ


class ConvexResidualBlock(nn.Module):
    """x ← (1 − a)·x + a·attn(norm1(x)); x ← (1 − a)·x + a·mlp(norm2(x)), for a timm ViT / Swin
    block or a CSwin block (whose own residual additions and DropPath are bypassed)."""

    def __init__(self, block: nn.Module, a: float) -> None:
        super().__init__()
        if not 0 < a <= 1:
            raise ValueError(f"convex residual weight must be in (0, 1], got {a}")
        self.block, self.a = block, a

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        attention = self.block._attn if hasattr(self.block, "_attn") else self.block.attn  # Swin partitions windows in _attn
        x = (1 - self.a) * x + self.a * attention(self.block.norm1(x))
        return (1 - self.a) * x + self.a * self.block.mlp(self.block.norm2(x))
