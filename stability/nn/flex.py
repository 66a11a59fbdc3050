"""FlexAttention (``torch.nn.attention.flex_attention``) for attention whose logits a stabilizer maps elementwise.

SDPA takes no elementwise map of the logits, so soft-capped attention (Gemma 2's c·tanh(s/c)) was explicit: an
N × N map per head, stored for the backward. FlexAttention fuses a ``score_mod`` into the attention kernel: compiled
on CUDA it computes softmax(c·tanh(scale·qkᵀ/c))·V block by block, as SDPA does for the plain product (the tanh
soft-cap is attention-gym's ``generate_tanh_softcap``). It cannot train on the CPU (no backward there), so the
kernels use it on CUDA and keep the explicit path elsewhere; both compute the same function (tested: forward on the
CPU, forward and gradients on a GPU).

Two things only CUDA shows, each decided here and tested on the CPU:

* Inductor's FlexAttention kernel refuses q, k, v narrower than 16 ("NYI: embedding dimension of the query, key, and
  value must be at least 16"): :func:`flex_accepts` routes narrower heads to the explicit path.
* A kernel compiled for static shapes compiles again for every new batch size (the last batch of an epoch, AutoAttack's
  shrinking batches, CSwin's stripes times the batch) until dynamo's recompile limit, after which it silently runs
  eagerly and materialises the score matrix. The batch dimension is marked dynamic: one compile serves every batch
  size (counted with a compile-counting backend in the tests).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import flex_attention

MIN_WIDTH = 16  # the narrowest q / k / v Inductor's FlexAttention kernel compiles


@functools.cache
def tanh_softcap(cap: float):
    """score ↦ cap·tanh(score/cap), as a FlexAttention ``score_mod`` (one function per cap: compiled once)."""

    def score_mod(score, batch, head, q_index, kv_index):
        return cap * torch.tanh(score / cap)

    return score_mod


@functools.cache
def compiled_flex(backend="inductor"):
    """FlexAttention compiled once per backend (static shapes but the batch dimension, which callers mark dynamic)."""
    return torch.compile(flex_attention, backend=backend, dynamic=False)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                         compiled: bool = True, backend="inductor") -> torch.Tensor:
    """softmax(cap·tanh(scale·q kᵀ/cap))·v on (B, h, N, d) tensors, fused (``compiled``: the CUDA kernel; eager
    FlexAttention is unfused and forward-only on the CPU). The batch dimension is dynamic: no recompile per size."""
    if not compiled or torch.compiler.is_compiling():  # inside a compiled network the outer graph compiles it
        return flex_attention(q, k, v, score_mod=tanh_softcap(float(cap)), scale=scale)
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return compiled_flex(backend)(q, k, v, score_mod=tanh_softcap(float(cap)), scale=scale)


def flex_trains_on(device: torch.device) -> bool:
    """FlexAttention's fused kernels train on CUDA; on the CPU it has no backward."""
    return device.type == "cuda"


def flex_accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The compiled kernel takes these widths: q, k and v at least :data:`MIN_WIDTH` wide."""
    return min(q.shape[-1], k.shape[-1], v.shape[-1]) >= MIN_WIDTH
