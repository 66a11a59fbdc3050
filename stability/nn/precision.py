"""Float32 where numbers must be right, TF32 and bf16 where speed is the point.

Training may run under bf16 autocast and with TF32 matmuls (10-bit mantissa) on NVIDIA GPUs. Some
per-step computations cannot afford either: a softmax statistic such as 1 − p₁ + p₂ cancels in
bf16, a Newton–Schulz iteration that should match an SVD to 1e-5 drifts under TF32, and a
measurement reported as a number must not depend on the precision a run trained in.
:func:`float32_math` gives such a block no autocast and IEEE float32 matmuls and convolutions, and
restores the caller's settings afterwards (plain Python flags: no device sync).

The flags are PyTorch's ``set_float32_matmul_precision`` and ``cudnn.allow_tf32``, the ones Lightning
reads (mixing them with the newer ``fp32_precision`` attributes makes Lightning's check raise).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matmuls and convolutions in full IEEE precision (no TF32) inside the block."""
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = conv


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate a tensor of ``dtype`` in: at least float32 *and* at least the tensor's own — bf16 and
    fp16 sums go to float32, and a float64 network stays float64 (a certificate is only as sound as its forward)."""
    return torch.promote_types(dtype, torch.float32)


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`accumulation_dtype` of its dtype (a no-op for float32 and float64)."""
    return t.to(accumulation_dtype(t.dtype))


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """No autocast on ``device_type`` inside the block; nothing to switch off on ``meta`` (the tensors that count a
    step's work without computing it), which has no autocast. A plain comparison, not
    ``torch.amp.is_autocast_available``: torch.compile traces it without a graph break."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast gives its operators on ``device_type`` now, or None where it is off (and on ``meta``, which
    has no autocast to ask about)."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextlib.contextmanager
def float32_math(device_type: str) -> Iterator[None]:
    """No autocast on ``device_type`` and IEEE float32 matmuls inside the block (the caller casts its
    inputs to float32)."""
    with autocast_off(device_type), ieee_float32():
        yield


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """TF32 float32 matmuls inside the block where ``enabled`` (nothing changes where not), the caller's setting
    restored after: for products split into TF32 parts (:func:`stability.nn.constraints.tf32_parts`), whose three TF32
    products give the float32 product. Convolutions keep their setting."""
    if not enabled:
        yield
        return
    matmul = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)


def allow_tf32_training() -> None:
    """TF32 matmuls and convolutions for training on a CUDA GPU (Ampere and later: several times the
    float32 throughput at a 10-bit mantissa); measurements and per-step constraints switch it off
    locally with :func:`ieee_float32`."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


__all__ = ["accumulation_dtype", "allow_tf32_training", "at_least_float32", "float32_math", "ieee_float32",
           "tf32_matmuls"]
