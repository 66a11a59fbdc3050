"""Softmax row statistics without materialising the attention probabilities.

JaSMin's regulariser needs, for every attention row i, only the top-(k+1) probabilities
p₍₁₎ ≥ … ≥ p₍ₖ₊₁₎ (for g₁ and g_k, JaSMin Theorem 4). With logits s_i = scale · q_i Kᵀ,

    p₍ⱼ₎ = exp(s₍ⱼ₎ − LSE(s_i)),   LSE(s_i) = log Σ_m exp(s_im),

so the log-sum-exp and the top-(k+1) logits of each row suffice. :func:`row_statistics` computes
them a block of rows at a time, keeps only the LSE, the top values and their indices (nothing of size N² is saved
for the backward pass). The LSE comes, on CUDA with bf16 / fp16 queries and keys, from the flash attention kernel
(:func:`attention_lse`: no pass over the logits), elsewhere as s₍₁₎ − log p₍₁₎ from one fused log-softmax (torch's
logsumexp, composite on CUDA, reads the logits six times). The backward pass has two parts:

    ∂/∂s_im = ḡ_LSE,i · p_im + Σ_j ḡ_top,ij · [m = idx_ij],   dq = scale · dS K,  dK = scale · dSᵀ Q.

The LSE part needs the dense probabilities, but only through P·K and Pᵀ·(ḡ·Q): an attention with the keys as its
values gives P·K, and the same call's backward with (scale·ḡ·Q) as the output's gradient gives Pᵀ·(scale·ḡ·Q) as the
values' gradient — one fused attention forward and backward (SDPA), with no N × N matrix in memory. The top part is
``count`` entries a row (or only the ``columns`` asked for: JaSMin's g₁ and g_k read four), scattered into a block
and multiplied. So the attention output itself and JaSMin's
statistics both keep fused kernels. Tested against the materialised softmax and ``torch.autograd.gradcheck``.

A block holds as many rows as fit in ``BLOCK_BYTES`` of float32 logits (all rows of a ViT-S layer at batch 256 and
257 tokens: one matrix product per layer and pass, where 64-row blocks took five, each with its copies).

The logits are float32, whatever the training precision: the probabilities come from two separately rounded
numbers, exp(s₍ⱼ₎ − LSE), and in bfloat16 (8-bit mantissa) each is off by about |s|·2⁻⁸, enough for p₍₁₎ to pass
1 and for 1 − p₍₁₎ + p₍₂₎ to cancel. Under mixed precision the queries and keys arrive as bf16 (or fp16) values,
whose products are exact in TF32 (10 mantissa bits) as in IEEE float32, with float32 sums: cast once to float32 for
the logits, their products run with the run's TF32 setting (the matrix units' float32 speed on a GPU); the attention
kernel takes them as they came (its products exact, its P·K rounded as the model's attention rounds it), and the
gradients are written in their dtype by the last sums (no cast after them). Queries and keys that are float32 values
(an fp32 run) are multiplied in IEEE float32, TF32 off. Autocast is off throughout.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from .precision import autocast_off, ieee_float32

BLOCK_BYTES = 512 * 2 ** 20  # float32 logits per block (one held at a time, forward and backward)
EXACT_IN_TF32 = (torch.bfloat16, torch.float16)  # inputs whose products TF32 computes exactly


def products_exact_in_tf32(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q and k hold values whose products TF32 computes exactly: bf16 or fp16, both alike."""
    return q.dtype == k.dtype and q.dtype in EXACT_IN_TF32


def power_of_two(scale: float) -> bool:
    """Whether multiplying by ``scale`` is exact (bf16 values stay bf16 values), so it can be applied to q once."""
    return math.frexp(scale)[0] == 0.5


def _products(device_type: str, exact_in_tf32: bool):
    """Autocast off; TF32 as the run sets it where the inputs' products are exact in it, else IEEE float32."""
    off = autocast_off(device_type)
    if exact_in_tf32:
        return off
    stack = contextlib.ExitStack()
    stack.enter_context(off)
    stack.enter_context(ieee_float32())
    return stack


def block_rows(q: torch.Tensor, k: torch.Tensor, budget: int = BLOCK_BYTES) -> int:
    """Rows per block: as many as keep a block of float32 logits (…, rows, M) within ``budget`` bytes (at least 1)."""
    per_row = 4 * k.shape[-2] * max(1, q[..., 0, 0].numel())
    return max(1, min(q.shape[-2], budget // per_row))


def take_columns(x: torch.Tensor, columns: tuple[int, ...] | None) -> torch.Tensor:
    """x[..., columns] without an index tensor (made on the host and copied to the device): each run of consecutive
    columns a slice, the runs joined by one ``cat`` (one run: the slice itself, a view). ``None``: x."""
    if columns is None:
        return x
    runs = [[columns[0], columns[0] + 1]]
    for column in columns[1:]:
        if column == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([column, column + 1])
    slices = [x[..., start:stop] for start, stop in runs]
    return slices[0] if len(slices) == 1 else torch.cat(slices, -1)


def check_columns(columns, count: int) -> tuple[int, ...] | None:
    """``columns`` as a tuple of descending positions among the ``count`` top logits, in non-decreasing order (a
    position may repeat); ``None`` stays ``None`` (all ``count``)."""
    if columns is None:
        return None
    columns = tuple(int(c) for c in columns)
    if not columns or any(c < 0 or c >= count for c in columns) or list(columns) != sorted(columns):
        raise ValueError(f"row_statistics: columns must be positions 0..{count - 1} among the top {count} logits, "
                         f"in non-decreasing order; got {columns}")
    return columns


def flash_shape(q: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel takes queries of q's shape as they are: (B, H, N, d), d a multiple of 8 (SDPA pads
    other widths before its flash call)."""
    return q.dim() == 4 and q.shape[-1] % 8 == 0


def attention_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Each row's LSE, log Σ_m exp(scale · q_i·k_m), in float32 (B, H, N), from CUDA's flash attention kernel (the keys
    as the values), which computes it anyway: a pass over q and k on the matrix units where a log-softmax reads and
    writes the (B, H, N, M) float32 logits. Its products are exact on bf16 / fp16 values and summed in float32, its
    exponentials float32's: held to a few float32 ulps of the LSE, as logsumexp (a GPU test). None where SDPA's own
    check refuses flash attention (dtype, head width, card), for widths SDPA pads first (not a multiple of 8), for q
    not 4-D, off CUDA (the CPU's flash kernel loses 2⁻¹⁴ of the LSE on bf16 inputs, measured; the log-softmax does
    not), and, with a warning, where a torch changes the private operator's signature."""
    if q.device.type != "cuda" or not flash_shape(q):
        return None
    try:
        if not torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, False,
                                                                                            False)):
            return None
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, scale=scale)[1]
    except (TypeError, RuntimeError) as error:  # a private operator: the log-softmax stays correct without it
        warnings.warn(f"jasmin: the flash kernel's log-sum-exp is unavailable ({str(error)[:200]}); the row "
                      f"statistics take it from a log-softmax", RuntimeWarning, stacklevel=2)
        return None


class _RowStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, scale: float, count: int, block: int, low: torch.dtype | None,
                columns: tuple[int, ...] | None):
        """q, k as the caller has them (an attention's bf16 views under mixed precision): cast once to float32 (at
        least) for the logits, and kept as they are for the attention kernel, in this pass and the backward.
        ``columns``: only those of the ``count`` top logits are returned, and only their indices saved (the backward
        scatters their gradients alone: no zero gradient for the others is made or scattered)."""
        n_rows, n_keys = q.shape[-2], k.shape[-2]
        count = min(count, n_keys)
        wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
        # a cast writes contiguous values (an attention's q and k are often permuted views: else every product below
        # copies them first); inputs already of the dtype are kept as they are (a contiguous copy would be saved too)
        q_wide, k_wide = (x if x.dtype == wide else x.to(wide, memory_format=torch.contiguous_format) for x in (q, k))
        stacked_q = q_wide.reshape(-1, n_rows, q.shape[-1])
        keys_t = k_wide.reshape(-1, n_keys, k.shape[-1]).transpose(-1, -2)
        ignored = q_wide.new_empty(())  # β = 0: the product's input is never read
        parts = []
        with _products(q.device.type, low is not None):
            fused_lse = attention_lse(q, k, scale) if low is not None else None
            for start in range(0, n_rows, block):
                # scale·(q kᵀ) in the product itself (its α), not as a pass over q or over the logits
                logits = torch.baddbmm(ignored, stacked_q[:, start:start + block], keys_t, beta=0, alpha=scale)
                logits = logits.view(*q.shape[:-2], logits.shape[-2], n_keys)
                if fused_lse is None:
                    parts.append(_lse_top_and_index(logits, count))
                else:
                    top, index = logits.topk(count, dim=-1)
                    # LSE ≥ the largest logit (p₍₁₎ ≤ 1), which the kernel's rounding need not keep
                    parts.append((torch.maximum(fused_lse[..., start:start + block], top[..., 0]), top, index))
        # one block (the usual case): its results are the outputs, with no copy into preallocated ones
        lse, top, index = parts[0] if len(parts) == 1 else (
            torch.cat([lse for lse, _, _ in parts], -1), *(torch.cat(p, -2) for p in list(zip(*parts))[1:]))
        top, index = take_columns(top, columns), take_columns(index, columns)
        ctx.save_for_backward(q, k, q_wide, k_wide, index)
        ctx.scale, ctx.block, ctx.low = scale, block, low
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)  # no zero tensor for the indices' gradient (nor for an unused output's)
        return lse, top, index

    @staticmethod
    @once_differentiable  # a second derivative through this backward would be wrong: refused instead
    def backward(ctx, grad_lse: torch.Tensor | None, grad_top: torch.Tensor | None, _grad_index):
        """Each gradient written once where it starts (no zero tensors, no copies): the top part's products are the
        gradients in float32, and the LSE part's last operation writes them in q's and k's dtypes (an ``out=`` of
        that dtype: the sum in float32, rounded once as a cast after it would round it)."""
        q, k, q_wide, k_wide, index = ctx.saved_tensors
        scale, block, low = ctx.scale, ctx.block, ctx.low
        grad_q = grad_k = None
        if grad_top is not None:  # the top logits: (count) entries a row, scattered a block of rows at a time
            weights = grad_top * scale  # the logits' scale on (…, N, count) entries, not on the (…, N, d) products
            on_queries = []  # each block's rows of grad_q (one block: grad_q itself, no copy)
            with _products(q.device.type, low is not None):
                for start in range(0, q.shape[-2], block):
                    stop = min(start + block, q.shape[-2])
                    rows = index[..., start:stop, :]
                    sparse = q_wide.new_zeros(*rows.shape[:-1], k.shape[-2]).scatter_add_(-1, rows,
                                                                                           weights[..., start:stop, :])
                    on_queries.append(sparse @ k_wide)
                    on_keys = sparse.transpose(-1, -2) @ q_wide[..., start:stop, :]
                    grad_k = on_keys if grad_k is None else grad_k.add_(on_keys)
                    del sparse, rows, on_keys  # a block of logits' size: not held into the next or the attention call
            grad_q = on_queries[0] if len(on_queries) == 1 else torch.cat(on_queries, -2)
        if grad_lse is not None:  # ∂LSE_i/∂s_im = p_im: a fused attention kernel's forward and backward (module doc)
            # bf16 values as they came (the kernel's fast path); other values in the float32 (at least) of the logits
            queries, keys = (x.detach() for x in ((q, k) if low is not None else (q_wide, k_wide)))
            row_weights = scale * grad_lse[..., None]  # (…, N, 1)
            # scale·g·Q, rounded once to its dtype: an out= of that dtype (new_empty: contiguous, uninitialised)
            weighted = torch.mul(queries, row_weights, out=queries.new_empty(queries.shape))
            with torch.enable_grad(), _products(q.device.type, low is not None):
                values = keys.detach().requires_grad_(True)  # the keys as the values
                attended = F.scaled_dot_product_attention(queries, keys, values, scale=scale)  # P·K
                (transposed,) = torch.autograd.grad(attended, values, weighted)  # Pᵀ·(scale·g·Q)
            attended = attended.detach()
            grad_q = (torch.mul(attended, row_weights, out=q.new_empty(q.shape)) if grad_q is None
                      else torch.addcmul(grad_q, attended, row_weights, out=q.new_empty(q.shape)))
            grad_k = (transposed.to(k.dtype) if grad_k is None
                      else torch.add(grad_k, transposed, out=k.new_empty(k.shape)))
        elif grad_q is not None:
            grad_q, grad_k = grad_q.to(q.dtype), grad_k.to(k.dtype)
        if grad_q is None:
            grad_q, grad_k = torch.zeros_like(q), torch.zeros_like(k)
        return grad_q, grad_k, None, None, None, None, None


def _lse_top_and_index(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's LSE and its ``count`` largest logits with their indices. The LSE is the largest logit less its log
    probability, log p₍₁₎ = s₍₁₎ − LSE, which one fused log-softmax gives (a pass over the logits and one write, a
    kernel): torch's logsumexp is nine kernels on CUDA and six passes (amax, x − max, exp_, sum: ``gpu_model``)."""
    top, index = logits.topk(count, dim=-1)
    log_top = logits.log_softmax(-1).gather(-1, index[..., :1])
    return (top[..., :1] - log_top).squeeze(-1), top, index


# the top logits' indices (count a row) are saved, not found again: only the logits and their LSE are recomputed
_TOP_SAVED = partial(create_selective_checkpoint_contexts, [torch.ops.aten.topk.default])


def _block_statistics(q: torch.Tensor, k: torch.Tensor, scale: float, count: int) -> tuple[torch.Tensor, ...]:
    """LSE and top ``count`` logits of the rows of one block, in float32 at least, autocast off."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    with autocast_off(q.device.type):
        if power_of_two(scale):  # q·scale exact, and fused into q's cast (one kernel less)
            return _top_and_lse((q.to(dtype) * scale) @ k.to(dtype).transpose(-1, -2), count)
        return _top_and_lse((q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale, count)


def _top_and_lse(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.logsumexp(-1), logits.topk(count, dim=-1).values


def _refuse_empty(q: torch.Tensor, k: torch.Tensor) -> None:
    """A softmax row needs a key (its LSE over no keys is −∞), the statistics a row and the products a dimension: q or k
    with no row, key or dimension is refused (an empty batch is not: empty statistics)."""
    if 0 in q.shape[-2:] or 0 in k.shape[-2:]:
        raise ValueError(f"row_statistics: q (..., N, d) and k (..., M, d) need N, M and d ≥ 1 (a softmax row needs a "
                         f"key); got {tuple(q.shape)} and {tuple(k.shape)}")


def _refuse_other_shapes(q: torch.Tensor, k: torch.Tensor) -> None:
    """q (..., N, d) and k (..., M, d) of other leading dimensions or widths, or empty (:func:`_refuse_empty`), are
    refused."""
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"row_statistics: q (..., N, d) and k (..., M, d) need the same leading dimensions and d; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    _refuse_empty(q, k)


def row_statistics_recomputed(q: torch.Tensor, k: torch.Tensor, scale: float, count: int,
                              block: int | None = None,
                              columns: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_statistics` for a compiled graph: the same LSE and top logits, differentiated by autograd and
    recomputed in the backward a block at a time (activation checkpointing, which torch.compile honours: only q, k
    and the top-k's values and indices are saved, nothing of size N²). Its backward,
    ∂/∂s_im = ḡ_LSE,i·p_im + Σ_j ḡ_top,ij·[m = idx_ij], is then autograd's, fused by Inductor with the recomputed
    logits (one product forward, three backward). ``block``
    defaults to :func:`block_rows`, whose comparison Dynamo keeps as a guard: every batch that fits one block runs
    the same graph. The products run at the matmul precision of the moment (autocast off), the backward's at the
    backward's: bf16 / fp16 values multiply exactly under TF32 (the backward's float32 dS is rounded to TF32 there);
    float32 values need IEEE float32 in both passes (:meth:`~stability.stabilizers.jasmin.JaSMin.regulariser_compiled`
    compiles them only where that holds)."""
    _refuse_empty(q, k)
    block = block_rows(q, k) if block is None else block
    if count < 1 or block < 1:
        raise ValueError(f"need count >= 1 and block >= 1; got {count}, {block}")
    count = min(count, k.shape[-2])
    columns = check_columns(columns, count)
    parts = [checkpoint(_block_statistics, q[..., start:start + block, :], k, float(scale), count,
                        use_reentrant=False, context_fn=_TOP_SAVED) for start in range(0, q.shape[-2], block)]
    return torch.cat([lse for lse, _ in parts], -1), take_columns(torch.cat([top for _, top in parts], -2), columns)


def row_statistics(q: torch.Tensor, k: torch.Tensor, scale: float, count: int, block: int | None = None,
                   columns: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE and the ``count`` largest logits (descending) of every row of softmax(scale · q kᵀ).

    q: (..., N, d), k: (..., M, d) → lse (..., N), top (..., N, min(count, M)), in float32 at least
    (bf16 / fp16 inputs are promoted, and multiplied with the run's TF32 setting: exact); differentiable in q and k.
    ``block`` rows are materialised at a time (default: :func:`block_rows`). ``columns``: only the top logits at
    these descending positions (each below min(count, M), in non-decreasing order), (..., N, len(columns)); the
    backward then scatters only their gradients.
    """
    _refuse_other_shapes(q, k)
    block = block_rows(q, k) if block is None else block
    if count < 1 or block < 1:
        raise ValueError(f"need count >= 1 and block >= 1; got {count}, {block}")
    columns = check_columns(columns, min(count, k.shape[-2]))
    low = q.dtype if products_exact_in_tf32(q, k) else None
    lse, top, _ = _RowStatistics.apply(q, k, float(scale), int(count), int(block), low, columns)
    return lse, top


def top_probabilities_streamed(q: torch.Tensor, k: torch.Tensor, scale: float, count: int,
                               block: int | None = None, recomputed: bool = False,
                               columns: tuple[int, ...] | None = None) -> torch.Tensor:
    """The ``count`` largest probabilities of each row of softmax(scale · q kᵀ), descending,
    zero-padded past M (as :func:`stability.nn.softmax_bounds.top_probabilities`); ``recomputed``: through
    :func:`row_statistics_recomputed` (a compiled graph's). ``columns``: only the probabilities at these descending
    positions (below ``count``, in non-decreasing order), those at M or past it zero, (..., N, len(columns)):
    JaSMin's g₁ and g_k read four of the k + 1 (:attr:`~stability.stabilizers.jasmin.JaSMin.top_columns`)."""
    columns = check_columns(columns, count)
    within = None if columns is None else tuple(c for c in columns if c < k.shape[-2])
    if within == ():  # every position asked for is at M or past it: zeros (constants), q and k checked as below
        _refuse_other_shapes(q, k)
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
        return q.new_zeros(*q.shape[:-1], len(columns), dtype=dtype)
    statistics = row_statistics_recomputed if recomputed else row_statistics
    lse, top = statistics(q, k, scale, count, block, within)
    probs = (top - lse.unsqueeze(-1)).exp()
    width = count if columns is None else len(columns)
    if probs.shape[-1] < width:  # positions at M or past it (last, the columns being in order): probability 0
        probs = torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
    return probs
