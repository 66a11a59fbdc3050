"""What a training step costs, measured the same way on any device: deterministic proxies of GPU time and memory.

A GPU is rare here, and its timings are noisy; these counts are exact and repeat on a CPU:

* :func:`saved_for_backward` — the bytes autograd keeps for the backward pass (each storage once; on request not a
  parameter, which its module holds anyway), the part of a step's peak memory a method adds to; an fp32 copy made
  under autocast, or an N × N map, shows here;
* :func:`attention_maps` — the operators whose output holds a (…, N, N) map for N tokens: a step that keeps its
  attention on a fused kernel (SDPA, FlexAttention) produces none; an explicit softmax(QKᵀ) produces several per
  layer;
* :func:`dispatched` — every ATen operator a step dispatches, counted: a fused path shows as one kernel where an
  unfused one shows as its chain of elementwise ops.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def saved_for_backward(step: Callable[[], Any], parameters: bool = True) -> int:
    """Bytes of the tensors autograd saves for backward during ``step()`` (each storage counted once).
    ``parameters=False``: a parameter saved as it is, or a view of one (a product with a weight, ``α.unsqueeze(-1)``),
    is left out, its module holding it whether or not the step saves it — what a method adds to a step's memory; a
    copy of one (autocast's bf16 cast of a weight) is counted either way. (The measurements' batch sizing counts them:
    its memory is the device's, parameters included.)"""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if parameters or not isinstance(t if t._base is None else t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


class _Recorder(TorchDispatchMode):
    def __init__(self, tokens: int | None) -> None:
        super().__init__()
        self.tokens = tokens
        self.ops: collections.Counter = collections.Counter()
        self.maps: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if self.tokens is not None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2] == self.tokens:
                    self.maps[name] += 1
        return out


def attention_maps(step: Callable[[], Any], tokens: int) -> collections.Counter:
    """{operator: how many of its outputs were a (…, N, N) map} during ``step()`` (forward and backward)."""
    recorder = _Recorder(tokens)
    with recorder:
        step()
    return recorder.maps


def dispatched(step: Callable[[], Any]) -> collections.Counter:
    """{ATen operator: calls} during ``step()``."""
    recorder = _Recorder(None)
    with recorder:
        step()
    return recorder.ops


def train_step(module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
               precision: str = "fp32", step: int = 0) -> torch.Tensor:
    """One training step as Lightning runs it: forward with the stabilizers' terms (under bf16 autocast for
    ``precision="bf16"``, as ``--trainer.precision bf16-mixed``), backward, optimizer step, the stabilizers'
    projections (``step``: the step's index). Returns the loss on the device (no host sync)."""
    from ..classifier import CROSS_ENTROPY

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        _, terms = module.losses(images, labels)
        loss = sum(term for name, term in terms.items() if name != CROSS_ENTROPY)
    loss.backward()
    optimizer.step()
    module.after_optimizer_step(step)
    return loss.detach()


__all__ = ["attention_maps", "dispatched", "saved_for_backward", "train_step"]
