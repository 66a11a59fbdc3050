"""Norms written so that ``torch.compile`` traces them as they run eagerly."""
from __future__ import annotations

import torch


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖·‖₂ over the last dimension, shape (…,). Written with keepdim: torch 2.11's fake tensors give
    ``vector_norm(x, dim=-1)`` over a last dimension of size 1 (one head) the shape (…, 1), and a compiled graph then
    broadcast it against (…,) into a square."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).squeeze(-1)
