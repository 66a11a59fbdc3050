"""CUDA's autocast on CPU tensors: inside :func:`cuda_autocast`, a CPU autocast region casts each operator's inputs
as CUDA's autocast does, not as the CPU's.

Autocast casts an operator's inputs by a policy of its device (torch's ``aten/src/ATen/autocast_mode.cpp``), and the
two devices' lists differ. Under bf16 autocast CUDA runs LayerNorm, GroupNorm, ``exp``, ``log``, ``pow``, ``rsqrt``,
``logsumexp`` and the like in float32 and accumulates ``sum``, ``softmax``, ``cumsum`` and the vector norms in float32,
where the CPU keeps bf16; CUDA runs ``mv``, ``addmv``, ``addr`` and ``einsum`` in bf16; CUDA promotes ``addcmul``,
``addcdiv``, ``index_put``, ``scatter_add`` and a few others to their widest input; CUDA refuses
``binary_cross_entropy``. The CPU casts its linear algebra, ``cross_entropy_loss``, ``cat`` and ``stack``, where CUDA
leaves them as they come (cross-entropy then takes the log-softmax in bf16, as CUDA does). A step counted on CPU tensors
under the CPU's lists moves other bytes than the GPU's step: timm's ``qk_norm=True`` normalises q and k in bf16 on the
CPU, in float32 with a cast each way on CUDA. And a step can pass on the CPU that fails on CUDA: a bf16 input to an
eigensolver, which the CPU's autocast casts to float32.

How: for the block's duration, each operator whose CUDA policy differs from the CPU's gets a kernel of its own at
the ``AutocastCPU`` dispatch key (``torch.library``): a Python kernel that applies CUDA's policy (:data:`CUDA_POLICY`)
and calls the operator below autocast, as CUDA's own kernel does, or a fallthrough for the operators only the CPU's
autocast casts, as CUDA has none; on exit the CPU's kernels are back. The policies are CUDA's (``lower_precision_fp``,
``fp32``, ``fp32_set_opt_dtype``, ``fp32_append_dtype``, ``promote``, banned), tested operator by operator against
CUDA's own autocast kernels on fake CUDA tensors (tests/test_cuda_autocast.py). Not emulated: CUDA's cast cache (a
weight cast once per autocast region; these operators' casts are not cached here) and the cuDNN-only operators
(:data:`NOT_ON_THE_CPU`).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .gpu_model import _tensors

LOWER, FP32, FP32_SET_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED, AS_IT_COMES = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "none")

# CUDA's policy for the operators whose CUDA autocast kernel the CPU's autocast lacks or applies otherwise (torch 2.11's
# AutocastCUDA registrations and 2.14's; an overload is named "operator.overload", the default one by its operator's
# name); each applies where this torch's CUDA autocast has a kernel for it
CUDA_POLICY = {
    **dict.fromkeys(["_convolution", "convolution", "addmv", "addr", "chain_matmul", "einsum", "linalg_multi_dot", "mv",
                     "_scaled_dot_product_flash_attention", "gru_cell", "lstm_cell", "rnn_relu_cell", "rnn_tanh_cell",
                     "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell"], LOWER),
    **dict.fromkeys(["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2", "pow.Scalar",
                     "pow.Tensor_Scalar", "pow.Tensor_Tensor", "reciprocal", "rsqrt", "sinh", "tan", "softplus",
                     "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
                     "nuclear_norm.dim", "cosine_similarity", "dist", "pdist", "renorm", "logsumexp",
                     "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
                     "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
                     "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa",
                     "_upsample_bicubic2d_aa",
                     "rms_norm"], FP32),  # rms_norm from torch 2.14 (2.11's CUDA autocast leaves it as it comes)
    **dict.fromkeys(["sum", "sum.dim_IntList", "sum.dim_DimnameList", "prod", "prod.dim_int", "prod.dim_Dimname",
                     "softmax.int", "softmax.Dimname", "log_softmax.int", "log_softmax.Dimname", "cumsum",
                     "cumsum.dimname", "cumprod", "cumprod.dimname", "linalg_vector_norm", "linalg_matrix_norm",
                     "linalg_matrix_norm.str_ord"], FP32_SET_DTYPE),
    **dict.fromkeys(["norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim"], FP32_APPEND_DTYPE),
    **dict.fromkeys(["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "scatter_add",
                     "tensordot", "grid_sampler"], PROMOTE),  # grid_sampler: the CPU's autocast casts it to float32
    "binary_cross_entropy": BANNED,
}
# CUDA autocast kernels of operators that run on cuDNN only: nothing to emulate on CPU tensors
NOT_ON_THE_CPU = {"cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn"}
# the overload that fp32_append_dtype calls instead, with a float32 dtype appended
APPENDED = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype",
            "names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}
BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on CUDA: "
                  "use binary_cross_entropy_with_logits (CUDA's autocast refuses it)")

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_active: list[torch.library.Library] = []


def _overload(name: str) -> torch._ops.OpOverload | None:
    """The ATen overload ``"operator.overload"`` names, or None where this torch has none of that name."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)


def _kernel(name: str, dispatch_key: str) -> bool:
    """Whether ``aten::<name>`` has a kernel of its own (not a fallthrough) at ``dispatch_key``."""
    qualified = f"aten::{name}"
    try:
        return (torch._C._dispatch_has_kernel_for_dispatch_key(qualified, dispatch_key)
                and not torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(qualified, dispatch_key))
    except RuntimeError:
        return False


@functools.cache
def cpu_only() -> frozenset[str]:
    """The operators only the CPU's autocast casts (CUDA's calls them as their inputs come)."""
    names = (name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("aten::"))
    return frozenset(name for name in names
                     if _kernel(name, "AutocastCPU") and not _kernel(name, "AutocastCUDA") and name not in CUDA_POLICY)


@functools.cache
def applied_policies() -> dict[str, str]:
    """The :data:`CUDA_POLICY` entries this torch's CUDA autocast has a kernel for."""
    return {name: policy for name, policy in CUDA_POLICY.items() if _kernel(name, "AutocastCUDA")}


def _eligible(value: Any) -> bool:
    """A tensor autocast casts (CUDA's ``is_eligible``, on the CPU's tensors): floating point, not float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _promoted(args: tuple, kwargs: dict) -> torch.dtype:
    """CUDA's ``promote_type``: the autocast dtype, float32 where an eligible input is float32."""
    lower = torch.get_autocast_dtype("cpu")
    dtypes = {t.dtype for t in _tensors((args, kwargs)) if _eligible(t)}
    if dtypes - {lower, torch.float32}:
        raise RuntimeError(f"Unexpected floating ScalarType in at::autocast::prioritize: {sorted(map(str, dtypes))}")
    return torch.float32 if torch.float32 in dtypes else lower


def _with_float32_dtype(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``op``'s arguments with its optional ``dtype`` set to float32 where it was not given."""
    position = next(i for i, argument in enumerate(op._schema.arguments) if argument.name == "dtype")
    if position < len(args):
        if args[position] is None:
            args = (*args[:position], torch.float32, *args[position + 1:])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


def _with_defaults(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple:
    """``op``'s positional arguments in full: the dispatcher leaves out trailing ones at their defaults, which the
    overload a policy calls instead may not have."""
    arguments = [a for a in op._schema.arguments if not a.kwarg_only]
    return (*args, *(kwargs.get(a.name, a.default_value) for a in arguments[len(args):]))


def _policy_kernel(name: str, policy: str):
    """A Python kernel at ``AutocastCPU`` that applies CUDA's ``policy`` to ``aten::<name>`` and calls it below
    autocast (CUDA's kernels exclude their autocast key the same way)."""
    op = _overload(name)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == BANNED:
                raise RuntimeError(BANNED_MESSAGE)
            if policy == LOWER:
                dtype = torch.get_autocast_dtype("cpu")
                return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
            if policy == FP32:
                return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == PROMOTE:
                dtype = _promoted(args, kwargs)
                return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
            first_eligible = bool(args) and _eligible(args[0])  # CUDA's firstarg_is_eligible
            if policy == FP32_SET_DTYPE and first_eligible:
                args, kwargs = _with_float32_dtype(op, args, kwargs)
                return op(*args, **kwargs)
            if policy == FP32_APPEND_DTYPE:  # CUDA's type_from_firstarg: float32, or the first argument's own dtype
                dtype = torch.float32 if first_eligible else args[0].dtype
                appended = getattr(op.overloadpacket, APPENDED[op._overloadname])
                return appended(*_with_defaults(op, args, kwargs), dtype=dtype)
            return op(*args, **kwargs)  # an input the policy leaves alone

    return kernel


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Inside the block, CPU autocast casts as CUDA's autocast does (module docstring); outside, as the CPU's. Nested
    blocks share the outer one's kernels. The kernels are the process's, every thread's, for the block's duration (a
    count runs on one thread)."""
    if _active:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    policies = {**dict.fromkeys(cpu_only(), AS_IT_COMES), **applied_policies()}
    _active.append(library)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # the CPU's own kernels, replaced for the block
            for name, policy in policies.items():
                if _overload(name) is None:
                    continue
                # as it comes: a fallthrough, as CUDA has for an operator without a kernel (the operators it calls
                # are still cast); a policy: the kernel calls below autocast
                kernel = torch.library.fallthrough_kernel if policy == AS_IT_COMES else _policy_kernel(name, policy)
                library.impl(name, kernel, "AutocastCPU")
        yield
    finally:  # the CPU's kernels back, whatever failed: a registration half done, or the block
        _active.pop()
        library._destroy()


__all__ = ["CUDA_POLICY", "NOT_ON_THE_CPU", "applied_policies", "cpu_only", "cuda_autocast"]
