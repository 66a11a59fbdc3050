"""TF32 matrix units emulated on the CPU, to test what a product computes on an NVIDIA GPU with TF32 on.

Where torch's float32 matmul precision allows TF32 (``"high"``/``"medium"``, as ``stability fit`` sets on a GPU),
CUDA's matrix products read each float32 operand with TF32's 10 mantissa bits and accumulate in float32. Inside
:func:`emulated_tf32` the CPU does the same: a ``TorchDispatchMode`` rounds the float32 operands of every matrix
product (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``addbmm``, in place and with ``out=`` too) to 10 mantissa
bits, then multiplies them in IEEE float32 (products of two 11-bit significands are exact in float32).
``rounding``: ``"nearest"`` (to the nearest TF32 value, ties away from zero) or ``"truncate"`` (the low 13 bits
dropped): NVIDIA does not document which its tensor cores apply to float32 inputs, so a result that must hold under
TF32 is tested under both.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROUNDINGS = ("nearest", "truncate")
_LOW_BITS = 1 << 13  # float32's mantissa bits that TF32 lacks (23 − 10)

# operator (every overload: out-of-place, ``out=``, in place) → positions of its two matrix operands
_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmm_": (1, 2),
             "baddbmm_": (1, 2), "addbmm_": (1, 2)}
_PRODUCTS = {getattr(getattr(torch.ops.aten, name), overload): positions for name, positions in _OPERANDS.items()
             for overload in getattr(torch.ops.aten, name).overloads()}


def to_tf32(x: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """A float32 tensor's values with TF32's 10 mantissa bits (still float32); other dtypes as they are."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"to_tf32: rounding={rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if x.dtype != torch.float32:
        return x
    bits = x.view(torch.int32)
    if rounding == "nearest":
        bits = bits + _LOW_BITS // 2  # half of the dropped part carries into the kept bits (and the exponent)
    return (bits & -_LOW_BITS).view(torch.float32)


class _TF32Products(TorchDispatchMode):
    def __init__(self, rounding: str):
        super().__init__()
        self.rounding = rounding

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = _PRODUCTS.get(func)
        if operands is not None and torch.get_float32_matmul_precision() != "highest":
            args = tuple(to_tf32(a, self.rounding) if i in operands else a for i, a in enumerate(args))
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated_tf32(rounding: str = "nearest") -> Iterator[None]:
    """Inside the block, float32 matrix products round their operands to TF32 wherever torch's float32 matmul
    precision allows TF32, as CUDA's do (module docstring); with ``"highest"`` they stay IEEE float32."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"emulated_tf32: rounding={rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    with _TF32Products(rounding):
        yield


__all__ = ["ROUNDINGS", "emulated_tf32", "to_tf32"]
