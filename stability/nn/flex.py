"""FlexAttention (``torch.nn.attention.flex_attention``) for attention whose logits a stabilizer maps elementwise.

SDPA takes no elementwise map of the logits, so soft-capped attention (Gemma 2's c·tanh(s/c)) was explicit: an
N × N map per head, stored for the backward. FlexAttention fuses a ``score_mod`` into the attention kernel: compiled
on CUDA it computes softmax(c·tanh(scale·qkᵀ/c))·V block by block, as SDPA does for the plain product (the tanh
soft-cap is attention-gym's ``generate_tanh_softcap``). It cannot train on the CPU (no backward there), so the
kernels use it on CUDA and keep the explicit path elsewhere; both compute the same function (tested: forward on the
CPU, forward and gradients on a GPU).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import flex_attention


@functools.cache
def tanh_softcap(cap: float):
    """score ↦ cap·tanh(score/cap), as a FlexAttention ``score_mod`` (one function per cap: compiled once)."""

    def score_mod(score, batch, head, q_index, kv_index):
        return cap * torch.tanh(score / cap)

    return score_mod


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                         compiled: bool = True) -> torch.Tensor:
    """softmax(cap·tanh(scale·q kᵀ/cap))·v on (B, h, N, d) tensors, fused (``compiled``: the CUDA kernel; eager
    FlexAttention is unfused and forward-only on the CPU)."""
    attention = _compiled() if compiled else flex_attention
    return attention(q, k, v, score_mod=tanh_softcap(float(cap)), scale=scale)


def flex_trains_on(device: torch.device) -> bool:
    """FlexAttention's fused kernels train on CUDA; on the CPU it has no backward."""
    return device.type == "cuda"
