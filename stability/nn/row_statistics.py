"""Softmax row statistics without materialising the attention probabilities.

JaSMin's regulariser needs, for every attention row i, only the top-(k+1) probabilities
p₍₁₎ ≥ … ≥ p₍ₖ₊₁₎ (for g₁ and g_k, JaSMin Theorem 4). With logits s_i = scale · q_i Kᵀ,

    p₍ⱼ₎ = exp(s₍ⱼ₎ − LSE(s_i)),   LSE(s_i) = log Σ_m exp(s_im),

so the log-sum-exp and the top-(k+1) logits of each row suffice. :func:`row_statistics` computes
them a block of rows at a time (memory O(rows × N) instead of O(N²) per head), keeps only the
LSE, the top values and their indices, and recomputes each block in the backward pass:

    ∂/∂s_im = ḡ_LSE,i · p_im + Σ_j ḡ_top,ij · [m = idx_ij],   dq = scale · dS K,  dK = scale · dSᵀ Q,

so the attention output itself can keep the fused (flash) kernel. Tested against the
materialised softmax and against ``torch.autograd.gradcheck``.

Everything here runs in float32 with autocast and TF32 off, whatever the training precision: the
probabilities come from two separately rounded numbers, exp(s₍ⱼ₎ − LSE), and in bfloat16 (8-bit mantissa)
each is off by about |s|·2⁻⁸, enough for p₍₁₎ to pass 1 and for 1 − p₍₁₎ + p₍₂₎ to cancel. The queries and
keys are the model's own (bf16 under mixed precision: their products are exact in float32).
"""
from __future__ import annotations

import torch

from .precision import float32_math


class _RowStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, scale: float, count: int, block: int):
        n_rows, n_keys = q.shape[-2], k.shape[-2]
        count = min(count, n_keys)
        lse = q.new_empty(q.shape[:-1])
        top = q.new_empty(*q.shape[:-1], count)
        index = torch.empty(*q.shape[:-1], count, dtype=torch.long, device=q.device)
        keys_t = k.transpose(-1, -2)
        with float32_math(q.device.type):
            for start in range(0, n_rows, block):
                stop = min(start + block, n_rows)
                logits = (q[..., start:stop, :] @ keys_t) * scale
                lse[..., start:stop] = logits.logsumexp(-1)
                values, indices = logits.topk(count, dim=-1)
                top[..., start:stop, :] = values
                index[..., start:stop, :] = indices
        ctx.save_for_backward(q, k, lse, index)
        ctx.scale, ctx.block = scale, block
        ctx.mark_non_differentiable(index)
        return lse, top, index

    @staticmethod
    def backward(ctx, grad_lse: torch.Tensor | None, grad_top: torch.Tensor | None, _grad_index):
        q, k, lse, index = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        grad_q, grad_k = torch.zeros_like(q), torch.zeros_like(k)
        keys_t = k.transpose(-1, -2)
        with float32_math(q.device.type):
            for start in range(0, q.shape[-2], block):
                stop = min(start + block, q.shape[-2])
                rows = q[..., start:stop, :]
                logits = (rows @ keys_t) * scale
                if grad_lse is not None:
                    grad_logits = (logits - lse[..., start:stop, None]).exp() * grad_lse[..., start:stop, None]
                else:
                    grad_logits = torch.zeros_like(logits)
                if grad_top is not None:
                    grad_logits.scatter_add_(-1, index[..., start:stop, :], grad_top[..., start:stop, :])
                grad_q[..., start:stop, :] = (grad_logits @ k) * scale
                grad_k += (grad_logits.transpose(-1, -2) @ rows) * scale
        return grad_q, grad_k, None, None, None


def row_statistics(q: torch.Tensor, k: torch.Tensor, scale: float, count: int,
                   block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE and the ``count`` largest logits (descending) of every row of softmax(scale · q kᵀ).

    q: (..., N, d), k: (..., M, d) → lse (..., N), top (..., N, min(count, M)), in float32 at least
    (bf16 / fp16 inputs are promoted); differentiable in q and k. ``block`` rows are materialised at a time.
    """
    if count < 1 or block < 1:
        raise ValueError(f"need count >= 1 and block >= 1; got {count}, {block}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    lse, top, _ = _RowStatistics.apply(q.to(dtype), k.to(dtype), float(scale), int(count), int(block))
    return lse, top


def top_probabilities_streamed(q: torch.Tensor, k: torch.Tensor, scale: float, count: int,
                               block: int = 64) -> torch.Tensor:
    """The ``count`` largest probabilities of each row of softmax(scale · q kᵀ), descending,
    zero-padded past M (as :func:`stability.nn.softmax_bounds.top_probabilities`)."""
    lse, top = row_statistics(q, k, scale, count, block)
    probs = (top - lse.unsqueeze(-1)).exp()
    if probs.shape[-1] < count:
        probs = torch.nn.functional.pad(probs, (0, count - probs.shape[-1]))
    return probs
