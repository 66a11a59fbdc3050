"""A CPU model of a GPU training step: what a step launches, moves and multiplies, counted without a GPU, and the
time a fitted roofline with a launch term predicts from it.

A GPU is rarely at hand; every change to a hot path still needs a measure that runs here and predicts the GPU. A
step run on CPU tensors under :class:`KernelCounter` (a ``TorchDispatchMode``: it sees every ATen operator after
autograd, forward, backward and optimizer) gives, deterministically:

* ``launches`` — the operators that launch a kernel (views, allocations and metadata queries launch none);
* ``flops`` — the matrix products' FLOPs (``torch.utils.flop_counter``'s formulas: mm, bmm, addmm, convolutions,
  fused attention), by the precision they run in on a GPU: ``bf16`` (bf16 / fp16 inputs), ``tf32`` (float32 with
  TF32 matmuls allowed, as training sets it), ``fp32`` (float32 with TF32 off: the suite's exact blocks);
* ``bytes`` — what the other operators read and write (their tensors' sizes, inputs and outputs), and the copies
  CUDA's matrix products and norms make inside themselves (:func:`hidden_copy`, :func:`norm_copies`; a launch each
  as well);
* ``norm_rows`` — the thread blocks of CUDA's LayerNorm and RMSNorm kernels, which give every normalised row a block
  of its own (:func:`norm_rows`): a ViT's residual stream is 257 rows an image, a head-wide norm (QK norm, the cosine
  attention's) 257 × heads, each of 64 values, most of each block idle.

A gather or an index_select moves its index and what it picks, not its whole input (``READS_WHAT_IT_PICKS``); an
in-place scatter its index, its source and the elements it writes (``WRITES_WHAT_IT_PICKS``); ``zeros_like`` and its
kin their output only (``WRITES_ONLY``).
An operator that CUDA runs as several kernels of its own (it has no CUDA kernel, only a composite one: torch's
``logsumexp``, six passes over its input in nine kernels) reaches a dispatch mode as one; it is counted by its parts
(``COMPOSITE_ON_CUDA``).

:func:`cuda_path` makes the CPU take the decisions a GPU takes where they change the count: the fused AdamW kernel,
JaSMin's streamed row statistics, a fused attention kernel where softcap uses FlexAttention (counted as one SDPA
call: the score modification runs inside the kernel), CUDA's autocast lists (:mod:`.cuda_autocast`) and its fused
RMSNorm (:mod:`.fused_rms_norm`). Counts at two batch sizes give each quantity's constant and per-image parts
exactly, and two depths the per-block parts (every quantity is bilinear in depth and batch): a ViT-S step of 12 blocks
at batch 256 is counted from steps of 1 and 2 blocks at batch 2 and 4.

:class:`GpuModel` turns counts into seconds — ``launches·t_launch`` (the host's time per launched operator) beside
``bytes/bandwidth + Σ_p flops_p/throughput_p`` (the device's), added (``additive``) or overlapped (``overlap``: the
larger of the two) — with constants fitted to measured step times by :func:`fit` (relative error, least squares).
:func:`leave_one_out` says how well it predicts a row it was not fitted on. What it cannot see: kernel efficiency
(a bf16 GEMM of one shape runs nearer peak than of another), SVDs and eigensolvers (no FLOP formula: counted as
launches only), host syncs (a launch here, a stall there), and compilation.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

PRECISIONS = ("bf16", "tf32", "fp32")
# operators that launch no kernel: allocations, metadata, the wrapping of Python scalars, and dtype arithmetic (and
# every operator torch tags ``inplace_view``, which changes a tensor's shape or strides in place: unsqueeze_, t_, …;
# resize_ and resize_as_ growing a tensor with storage copy its old bytes on CUDA's copy engine, not in a kernel)
NO_KERNEL = {"_unsafe_view", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
             "scalar_tensor", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_",
             "_has_compatible_shallow_copy_type", "resize_", "record_stream", "_local_scalar_dense", "promote_types",
             "result_type", "can_cast"}
LAUNCH_TOLERANCE = 0.02  # a data-dependent branch (a projection taken or not, at the cap) moves a launch or two
SYNCS = {"_local_scalar_dense", "item", "nonzero"}  # a value read back to the host (a stall on a GPU)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _bytes(*values: Any) -> int:
    seen: dict[int, int] = {}
    for value in values:
        for t in _tensors(value):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def matmul_precision(dtype: torch.dtype) -> str:
    """The precision a matrix product of ``dtype`` inputs runs in on a GPU, under the current float32 setting."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype == torch.float32:
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return "fp64"


def _cpu_attention_flops(name: str, args: tuple, kwargs: dict) -> int | None:
    """FLOPs of the CPU's fused attention, by the formulas torch gives its CUDA twins."""
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k, v = args[:3]
        return sdpa_flop_count(q.shape, k.shape, v.shape)
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        grad, q, k, v = args[:4]
        return sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
    return None


def matrix_flops(func, args: tuple, kwargs: dict, out: Any) -> int | None:
    """FLOPs of a matrix product (None for any other operator); an in-place one (``baddbmm_``, ``addmm_``, which
    torch's FLOP counter does not list) by its out-of-place twin's formula."""
    packet = func.overloadpacket
    if packet not in flop_registry and packet.__name__.endswith("_"):
        packet = getattr(torch.ops.aten, packet.__name__[:-1], packet)
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    return _cpu_attention_flops(packet.__name__, args, kwargs)


@dataclass
class StepCounts:
    """What a step launches (``launches``), multiplies (``flops`` by precision) and moves (``bytes``, the operators
    that are not matrix products); ``ops`` counts the launches by operator and ``op_bytes`` the bytes (they sum to
    ``bytes``), ``syncs`` the reads back to the host."""

    launches: float = 0.0
    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PRECISIONS, 0.0))
    bytes: float = 0.0
    syncs: float = 0.0
    ops: Counter = field(default_factory=Counter)

    # CUDA's norm kernels' thread blocks, one a normalised row (:func:`norm_rows`); NaN in counts made before they
    # were counted (a model that prices them refuses those)
    norm_rows: float = 0.0

    # bytes by operator (named as in ``ops``; extrapolated counts may name an operator of some corners only); empty in
    # counts made before they were kept
    op_bytes: Counter = field(default_factory=Counter)

    def features(self) -> np.ndarray:
        return np.array([self.launches, self.bytes, *(self.flops.get(p, 0.0) for p in PRECISIONS)], dtype=float)

    def total_flops(self) -> float:
        return sum(self.flops.values())

    def to_dict(self) -> dict:
        # the operators sorted: a recount diffs by its changes only
        return {"launches": self.launches, "flops": self.flops, "bytes": self.bytes, "syncs": self.syncs,
                "norm_rows": self.norm_rows, "ops": dict(sorted(self.ops.items())),
                "op_bytes": {name: round(value) for name, value in sorted(self.op_bytes.items()) if round(value)}}

    @classmethod
    def from_dict(cls, data: dict) -> StepCounts:
        return cls(data["launches"], dict(data["flops"]), data["bytes"], data["syncs"], Counter(data["ops"]),
                   data.get("norm_rows", math.nan), Counter(data.get("op_bytes", {})))


LT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _bias_epilogue(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: complex,
                   result: torch.Tensor) -> bool:
    """Whether CUDA's ``addmm`` adds ``bias`` in cuBLASLt's epilogue (no copy): β = 1, a contiguous 1-D bias as long
    as the product's rows, a contiguous result, a floating dtype, both matrices more than one row and column (ATen's
    ``isInputCompliesAddmmCudaLt``, aten/src/ATen/native/cuda/Blas.cpp, as of torch 2.11; older versions asked more
    than one row and column of mat2 only)."""
    return (beta == 1 and bias.dim() == 1 and bias.shape[0] == mat2.shape[1] and bias.is_contiguous()
            and result.is_contiguous() and mat1.dtype in LT_DTYPES and min(*mat1.shape, *mat2.shape) > 1)


def hidden_copy(func, args: tuple, kwargs: dict, out: Any) -> int:
    """The bytes of the copy a CUDA matrix product makes inside itself before its GEMM (0 where it makes none), a
    kernel of its own that no dispatch mode sees: an out-of-place ``baddbmm`` with β ≠ 0 copies its input into the
    result (``TORCH_META_FUNC(baddbmm)``), an ``addmm`` or ``addmv`` with β ≠ 0 too, unless ``addmm`` adds a bias in
    cuBLASLt's epilogue (:func:`_bias_epilogue`: ``nn.Linear``'s case). In place (``baddbmm_``, ``out`` = input),
    the result already holds the input."""
    name, overload = func.overloadpacket.__name__, func._overloadname
    if name not in ("baddbmm", "addmm", "addmv") or overload not in ("default", "out"):
        return 0
    self, result = args[0], kwargs.get("out", out)
    beta = complex(kwargs.get("beta", 1))
    if beta == 0 or result is self or (name == "addmm" and _bias_epilogue(self, args[1], args[2], beta, result)):
        return 0
    return _bytes(self, result)


# CUDA's LayerNorm and its fused RMSNorm (aten/src/ATen/native/cuda/layer_norm_kernel.cu, torch 2.x; RMSNorm shares
# that code), by operator: the positions of the input, of the normalised shape and of the backward's output mask
# (None in a forward) among its arguments
CUDA_NORMS = {"native_layer_norm": (0, 1, None), "native_layer_norm_backward": (1, 2, 7),
              "_fused_rms_norm": (0, 1, None), "_fused_rms_norm_backward": (1, 2, 5)}


def norm_copies(func, args: tuple) -> list[int]:
    """The bytes (read and written) of the copy a CUDA norm operator (``CUDA_NORMS``) makes inside itself of a strided
    input, in the forward and again, of the saved input, in the backward (``input.expect_contiguous()``), a kernel that
    no dispatch mode sees: an attention's q and k are strided views of one projection, which a QK norm hands to
    LayerNorm as they are. (The backward also copies a strided incoming gradient, ``dY.contiguous()``, which is not
    counted: that gradient's layout is the previous kernel's choice, and the CPU's flash attention writes its query
    gradient transposed where CUDA's writes it in the query's layout.)"""
    norm = CUDA_NORMS.get(func.overloadpacket.__name__)
    if norm is None or len(args) <= norm[0] or not isinstance(args[norm[0]], torch.Tensor):
        return []
    x = args[norm[0]]
    return [] if x.is_contiguous() else [2 * _bytes(x)]


def _logsumexp_as_on_cuda(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """torch's logsumexp as CUDA runs it, operator by operator (``logsumexp_out_impl``,
    aten/src/ATen/native/ReduceOps.cpp, torch 2.x): six passes over its input where it reaches a dispatch mode as one
    operator reading it once. (``out=`` calls are left to ATen: counted as one operator.)"""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not x.is_floating_point():  # ATen's cast of integer inputs
        x = x.to(torch.get_default_dtype())
    if x.numel() == 0:  # no max to take (ATen's own branch)
        return torch.exp(x).sum(dims, keepdim).log_()
    maxes = torch.amax(x, dims, True)
    squeezed = maxes if keepdim else maxes.squeeze(dims)
    squeezed.masked_fill_(squeezed.abs() == math.inf, 0)
    return (x - maxes).exp_().sum(dims, keepdim).log_().add_(squeezed)


# operators that CUDA runs as several kernels (no CUDA kernel of their own, a composite one), counted by their parts
COMPOSITE_ON_CUDA = {"logsumexp": _logsumexp_as_on_cuda}


# operators whose CUDA kernel reads only the elements it picks (one per output, and the index), not the whole input
READS_WHAT_IT_PICKS = {"gather", "index_select"}


def _picked_bytes(args: tuple, kwargs: dict, out: Any) -> int:
    """What a gather or an index_select moves: its index, the elements it reads (as many as it writes), its output."""
    index = kwargs.get("index", args[2] if len(args) > 2 else None)
    return _bytes(index) + 2 * _bytes(out)


# operators that take a tensor for its shape and dtype only: they write their output and read nothing
WRITES_ONLY = {"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"}

# in-place scatters: CUDA's kernel reads the index and the source and writes (adds into: reads and writes) one element
# of the destination per index entry, not the whole destination
WRITES_WHAT_IT_PICKS = {"scatter_": 1, "scatter_add_": 2}


def _scattered_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """What an in-place scatter moves: its index, its source (a tensor, or a number), and the destination's elements it
    writes (``scatter_``) or reads and writes (``scatter_add_``, or ``scatter_`` with a ``reduce``), one per index
    entry."""
    self = args[0]
    index = kwargs["index"] if "index" in kwargs else args[2]
    source = kwargs.get("src", kwargs.get("value", args[3] if len(args) > 3 else None))
    passes = 2 if "reduce" in kwargs or len(args) > 4 else WRITES_WHAT_IT_PICKS[name]
    return _bytes(index, source) + passes * index.numel() * self.element_size()


# the stand-ins of CUDA's fused RMSNorm the counted step takes on the CPU (:mod:`.fused_rms_norm`), by operator: the
# positions of the input and of the normalised width (the number of its last dimensions) among its arguments
STAND_IN_NORMS = {"fused_rms_norm": (0, 1), "fused_rms_norm_backward": (1, 4)}


def norm_rows(func, args: tuple, kwargs: dict) -> int:
    """The thread blocks a CUDA norm kernel launches: the forward and the backward's input gradient take one block of
    128 threads per normalised row (``blocks(M)``), whatever the row's width (the vectorised kernels, which the suite's
    widths and dtypes take; a width not a multiple of 4, or float64, runs two kernels of M blocks forward); the weights'
    gradients are separate kernels over many rows at once. 0 for any other operator, and for a backward that computes
    no input gradient (CenterNorm's weight gradients through LayerNorm's kernel). Its cost is not its bytes: a
    head-wide row (64 values) keeps 16 of the block's 128 threads busy, and a ViT-S step at batch 256 normalises
    394,752 such rows per QK norm, where its residual stream has 65,792."""
    name = func.overloadpacket.__name__
    if name in STAND_IN_NORMS:
        at, width_at = STAND_IN_NORMS[name]
        x = args[at]
        return math.prod(x.shape[: x.dim() - args[width_at]])
    if name not in CUDA_NORMS:
        return 0
    at, shape_at, mask_at = CUDA_NORMS[name]
    if mask_at is not None and len(args) > mask_at and not args[mask_at][0]:
        return 0
    return args[at].numel() // max(1, math.prod(args[shape_at]))


def composite_on_cuda(func) -> bool:
    """Whether CUDA runs ``func`` as its parts: a ``COMPOSITE_ON_CUDA`` operator with no CUDA kernel of its own (where
    a later torch gives it one, it is counted as one operator again)."""
    packet = func.overloadpacket
    return (packet.__name__ in COMPOSITE_ON_CUDA and func._overloadname == "default"
            and not torch._C._dispatch_has_kernel_for_dispatch_key(packet._qualified_op_name, "CUDA"))


class KernelCounter(TorchDispatchMode):
    """Counts a step's launches, matrix FLOPs by precision and the other operators' bytes (module docstring), the
    copies CUDA's matrix products and norms make inside themselves (:func:`hidden_copy`, :func:`norm_copies`: a launch
    and its bytes each, counted as ``<operator>'s copy``), the rows of its norm kernels (:func:`norm_rows`), and the
    parts of an operator CUDA runs as several (``COMPOSITE_ON_CUDA``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = StepCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if composite_on_cuda(func):
            with self:  # its parts reach this counter, each a kernel as on CUDA
                return COMPOSITE_ON_CUDA[name](*args, **kwargs)
        out = func(*args, **kwargs)
        if name in SYNCS:
            self.counts.syncs += 1
        if func.is_view or name in NO_KERNEL or torch.Tag.inplace_view in func.tags:  # the last: unsqueeze_ and kin
            return out
        counts = self.counts
        counts.launches += 1
        counts.ops[name] += 1
        flops = matrix_flops(func, args, kwargs, out)
        if flops is not None:
            dtype = next(_tensors(args)).dtype
            counts.flops[matmul_precision(dtype)] = counts.flops.get(matmul_precision(dtype), 0.0) + flops
        else:
            if name in READS_WHAT_IT_PICKS:
                moved = _picked_bytes(args, kwargs, out)
            elif name in WRITES_WHAT_IT_PICKS:
                moved = _scattered_bytes(name, args, kwargs)
            elif name in WRITES_ONLY:
                moved = _bytes(out)
            else:
                moved = _bytes(args, kwargs, out)
            counts.bytes += moved
            counts.op_bytes[name] += moved
        counts.norm_rows += norm_rows(func, args, kwargs)
        for copied in [hidden_copy(func, args, kwargs, out), *norm_copies(func, args)]:
            if copied:
                counts.launches += 1
                counts.ops[f"{name}'s copy"] += 1
                counts.bytes += copied
                counts.op_bytes[f"{name}'s copy"] += copied
        return out


def count(step: Callable[[], Any]) -> StepCounts:
    """The counts of one call of ``step``."""
    counter = KernelCounter()
    with counter:
        step()
    return counter.counts


def extrapolate(counts: dict[tuple[int, int], StepCounts], depth: int, batch: int) -> StepCounts:
    """The counts of a model ``depth`` blocks deep at ``batch`` images, from counts at two depths × two batch sizes
    ``{(depth, batch): counts}``: every quantity is a + b·depth + c·batch + d·depth·batch (a block adds the same
    operators; activations grow with depth × batch, weights' work with depth, the rest is constant), so four points
    determine it exactly. Launches must not change with the batch (checked, up to a data-dependent branch: one or two
    launches in a hundred, where the larger batch's count is taken)."""
    (d0, d1), (b0, b1) = sorted({d for d, _ in counts}), sorted({b for _, b in counts})
    for d in (d0, d1):
        small, large = counts[d, b0].launches, counts[d, b1].launches
        if abs(large - small) > LAUNCH_TOLERANCE * large:
            raise ValueError(f"the launches changed with the batch at depth {d} ({small} → {large}): a step whose "
                             f"operators depend on the batch size cannot be extrapolated")
    u, v = (depth - d0) / (d1 - d0), (batch - b0) / (b1 - b0)

    def at(value: Callable[[StepCounts], float]) -> float:
        q00, q01, q10, q11 = (value(counts[d, b]) for d, b in ((d0, b0), (d0, b1), (d1, b0), (d1, b1)))
        return q00 + (q10 - q00) * u + (q01 - q00) * v + (q11 - q10 - q01 + q00) * u * v

    names = set(counts[d1, b0].ops) | set(counts[d0, b0].ops)
    ops = Counter({name: round(at(lambda c, n=name: c.ops.get(n, 0))) for name in names})
    moved = set().union(*(c.op_bytes for c in counts.values()))
    op_bytes = Counter({name: at(lambda c, n=name: c.op_bytes.get(n, 0)) for name in moved})
    launches = counts[d0, b1].launches + (counts[d1, b1].launches - counts[d0, b1].launches) * u  # the larger batch's
    return StepCounts(round(launches), {p: at(lambda c, p=p: c.flops.get(p, 0.0)) for p in PRECISIONS},
                      at(lambda c: c.bytes), at(lambda c: c.syncs), +ops, at(lambda c: c.norm_rows),
                      Counter({name: value for name, value in op_bytes.items() if value}))


@contextlib.contextmanager
def cuda_path(module) -> Iterator[None]:
    """The CPU takes the GPU's decisions for ``module`` inside the block: the fused Adam(W) kernel (set before its
    optimizer is built), the stabilizers' CUDA choices (JaSMin streams its row statistics, their LSE from the flash
    kernel: the CPU's flash kernel of the same shapes), a fused attention kernel where softcap would use
    FlexAttention (one SDPA call of the same shapes: the cap runs inside the GPU's kernel), and CUDA's autocast lists
    in place of the CPU's (:func:`.cuda_autocast.cuda_autocast`: LayerNorm on bf16 inputs in float32, sums and
    softmaxes accumulated in float32, ...), and RMSNorm as CUDA's fused kernel, one operator each way
    (:func:`.fused_rms_norm.counted_as_on_cuda`, where the CPU runs a composite), which LipsFormer's cosine
    attention takes eagerly on CUDA (``cosine_attention.fused_norm_on``; a compiled graph spells it out), the hard
    cap's float32 products as three TF32 products each (``constraints.split_products_on``: counted as TF32 FLOPs),
    and products cast to a narrower dtype as CUDA's kernels store them (``channel_scale.casting_out_on``: LipsFormer's
    residual scales)."""
    from .. import optim
    from ..nn import channel_scale, constraints, cosine_attention, dot_attention, row_statistics
    from .cuda_autocast import cuda_autocast
    from .fused_rms_norm import counted_as_on_cuda

    saved = (optim.fused_allowed, dot_attention.flex_trains_on, dot_attention.softcapped_attention,
             row_statistics.attention_lse, cosine_attention.fused_norm_on, constraints.split_products_on,
             channel_scale.casting_out_on)

    def fused_sdpa(q, k, v, scale, cap, compiled=True, backend="inductor"):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    def flash_lse(q, k, scale):  # where CUDA's flash kernel takes q and k as they are
        if not row_statistics.flash_shape(q):
            return None
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, scale=scale)[1]

    optim.fused_allowed = lambda params, precision=None: bool(params)
    dot_attention.flex_trains_on = lambda device: True
    dot_attention.softcapped_attention = fused_sdpa
    row_statistics.attention_lse = flash_lse
    cosine_attention.fused_norm_on = lambda device: True
    constraints.split_products_on = lambda device: True
    channel_scale.casting_out_on = lambda device: True
    for stabilizer in module.stabilizers:
        stabilizer.on_device(torch.device("cuda"))
    module._stabilizers_device = torch.device("cpu")  # the module does not ask again on the CPU tensors
    try:
        on_cpu = next(module.parameters()).device.type == "cpu"  # a module on a GPU runs CUDA's own lists and kernels
        with cuda_autocast() if on_cpu else contextlib.nullcontext(), \
                counted_as_on_cuda() if on_cpu else contextlib.nullcontext():
            yield
    finally:
        (optim.fused_allowed, dot_attention.flex_trains_on, dot_attention.softcapped_attention,
         row_statistics.attention_lse, cosine_attention.fused_norm_on, constraints.split_products_on,
         channel_scale.casting_out_on) = saved
        module._stabilizers_device = None  # the next forward tells the stabilizers its own device (JaSMin's choice)


# ------------------------------------------------------------------------------------------------------- the model
FORMS = ("additive", "overlap")
CONSTANTS = ("launch_s", "kernel_s", "bytes_per_s", *(f"{p}_flops_per_s" for p in PRECISIONS))
TIMES = ("launch_s", "kernel_s", "row_s")  # constants in seconds (row_s: a fit's with rows=True); the others rates


@dataclass
class GpuModel:
    """Seconds of a step from its counts: host = launches·launch_s (the host's time to issue a kernel); device =
    launches·kernel_s (a kernel's least time on the device) + bytes/bytes_per_s + Σ_p flops_p/<p>_flops_per_s
    (+ norm_rows·row_s, where a model prices CUDA's norm kernels by their thread blocks: :func:`norm_rows`);
    ``additive``: host + device (kernel_s folds into launch_s there); ``overlap``: max(host, device)."""

    launch_s: float
    bytes_per_s: float
    flops_per_s: dict[str, float]
    form: str = "overlap"
    kernel_s: float = 0.0
    row_s: float = 0.0

    def seconds(self, counts: StepCounts) -> float:
        host = counts.launches * self.launch_s
        device = counts.launches * self.kernel_s + counts.bytes / self.bytes_per_s + sum(
            counts.flops.get(p, 0.0) / self.flops_per_s[p] for p in PRECISIONS)
        if self.row_s:
            if math.isnan(counts.norm_rows):
                raise ValueError("these counts predate norm_rows (recount them: step_cost.py --recount); a model "
                                 "with a time per norm row cannot price them")
            device += counts.norm_rows * self.row_s
        return host + device if self.form == "additive" else max(host, device)

    def constants(self) -> dict[str, float]:
        return {"launch_s": self.launch_s, "kernel_s": self.kernel_s, "bytes_per_s": self.bytes_per_s,
                **{f"{p}_flops_per_s": self.flops_per_s[p] for p in PRECISIONS}}

    @classmethod
    def of(cls, log_constants: np.ndarray, form: str) -> GpuModel:
        """From the logs of CONSTANTS' values (a rate as its reciprocal), and of ``row_s`` after them where given."""
        values = np.exp(log_constants)
        rates = values[3:3 + len(PRECISIONS)]
        row_s = float(values[len(CONSTANTS)]) if len(values) > len(CONSTANTS) else 0.0
        return cls(float(values[0]), float(1 / values[2]), {p: float(1 / v) for p, v in zip(PRECISIONS, rates)},
                   form, float(values[1]), row_s)


# the H200's dense matrix throughput and memory bandwidth (NVIDIA's data sheet: bf16 989, TF32 495, FP32 67
# TFLOP/s; HBM3e 4.8 TB/s): the most a fit may make of them
PEAK_H200 = {"bf16_flops_per_s": 989e12, "tf32_flops_per_s": 495e12, "fp32_flops_per_s": 67e12, "bytes_per_s": 4.8e12}
# × 0.6, what a well-shaped GEMM reaches: the value a fit keeps where its table cannot determine a precision's
# throughput
NOMINAL_H200 = {p: 0.6 * PEAK_H200[f"{p}_flops_per_s"] for p in PRECISIONS}
# where the fit starts: an eager PyTorch launch ≈ 10 µs of host time, an H100/H200's HBM ≈ 3 TB/s in practice, its
# dense bf16 ≈ 400 TFLOP/s, TF32 ≈ 200, IEEE float32 ≈ 50 (achieved, well under the data sheets' peaks)
START = np.log([1e-5, 3e-6, 1 / 3e12, 1 / 4e14, 1 / 2e14, 1 / 5e13])
ROW_START = math.log(1e-9)  # a norm row's time, where a fit prices them: ≈ 260 SM-cycles a block over 132 SMs


# the model fitted to the H200 table (results/benchmarks/step_cost_cuda_h200.md: ViT-S, 256 tokens, batch 256, bf16,
# eager, torch 2.11, 2026-11-27) by `python benchmarks/step_cost.py --count` (results/benchmarks/step_model_h200.md:
# 22 rows, the products' copies counted, logsumexp by its CUDA kernels, scatters and fills by what they write, under
# CUDA's autocast lists, in-place views as no launch and LayerNorm's copies of strided inputs (recounted 2026-12-06);
# leave-one-out error median 10%); bf16 and TF32 throughputs at NOMINAL_H200 (the table cannot tell them). Norm rows
# are not priced (row_s 0): two rows of the table set their time (step_model_h200_norm_rows.md).
# tests/test_benchmarks.py refits it from those counts.
FITTED = {"h200": GpuModel(launch_s=2.178e-5, bytes_per_s=1.639e12,
                           flops_per_s={"bf16": NOMINAL_H200["bf16"], "tf32": NOMINAL_H200["tf32"], "fp32": 1.445e13},
                           form="overlap", kernel_s=5.492e-6)}


def fit(counts: list[StepCounts], seconds: list[float], form: str = "overlap",
        fixed: dict[str, float] | None = None, ceilings: dict[str, float] | None = None,
        rows: bool = False) -> GpuModel:
    """The constants that minimise the relative error of the predicted step times (least squares in log space over
    the constants; ``fixed`` holds constants the data cannot determine, by name, at their given value; ``ceilings``
    the most a rate can be, by name: a data sheet's peak, which a fit must not exceed to explain a row). ``rows``:
    a time per norm row (``row_s``) fitted too; the counts must have their ``norm_rows``."""
    from scipy.optimize import least_squares

    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    fixed = dict(fixed or {})
    wrong = [name for name in ceilings or {} if name not in CONSTANTS or name in TIMES]
    if wrong:
        raise ValueError(f"ceilings {wrong}: a ceiling bounds a rate, one of "
                         f"{[n for n in CONSTANTS if n not in TIMES]}")
    if form == "additive":
        fixed["kernel_s"] = 1e-12  # one time per launch: launch_s carries it
    if "row_s" in fixed and not rows:
        raise ValueError("fit: a fixed row_s prices norm rows; give rows=True")
    if rows and any(math.isnan(c.norm_rows) for c in counts):
        raise ValueError("fit(rows=True): some counts predate norm_rows (recount them: step_cost.py --recount)")
    names = list(CONSTANTS) + (["row_s"] if rows else [])
    known = {i: math.log(fixed[n] if n in TIMES else 1 / fixed[n]) for i, n in enumerate(names) if n in fixed}
    free = [i for i in range(len(names)) if i not in known]
    measured = np.asarray(seconds, dtype=float)
    starts = np.append(START, ROW_START) if rows else START

    def full(x: np.ndarray) -> np.ndarray:
        values = starts.copy()
        values[free] = x
        for i, v in known.items():
            values[i] = v
        return values

    def residuals(x: np.ndarray) -> np.ndarray:
        model = GpuModel.of(full(x), form)
        return np.array([model.seconds(c) for c in counts]) / measured - 1.0

    # a rate r is held as log(1/r): at most its ceiling means at least log(1/ceiling)
    lower = np.array([math.log(1 / ceilings[names[i]]) if names[i] in (ceilings or {}) else -np.inf for i in free])
    start = np.maximum(starts[free], lower + 1e-9)
    result = least_squares(residuals, start, method="trf", x_scale=1.0, max_nfev=20000, bounds=(lower, np.inf))
    return GpuModel.of(full(result.x), form)


def leave_one_out(counts: list[StepCounts], seconds: list[float], form: str = "overlap",
                  fixed: dict[str, float] | None = None, groups: list | None = None,
                  ceilings: dict[str, float] | None = None, rows: bool = False) -> list[float]:
    """For each row, the relative error of its prediction by the model fitted to the other rows; with ``groups``
    (a key per row), to the rows of the other groups: one stabilizer measured in two GPU runs is left out whole, so
    that its twin does not predict it."""
    groups = list(range(len(counts))) if groups is None else list(groups)
    models: dict = {}
    errors = []
    for i, group in enumerate(groups):
        if group not in models:
            rest = [j for j in range(len(counts)) if groups[j] != group]
            models[group] = fit([counts[j] for j in rest], [seconds[j] for j in rest], form, fixed, ceilings, rows)
        errors.append(models[group].seconds(counts[i]) / seconds[i] - 1.0)
    return errors


__all__ = ["CONSTANTS", "FITTED", "FORMS", "NOMINAL_H200", "PEAK_H200", "GpuModel", "KernelCounter", "StepCounts",
           "count", "cuda_path", "extrapolate", "fit", "leave_one_out", "matmul_precision", "matrix_flops", "norm_rows"]
