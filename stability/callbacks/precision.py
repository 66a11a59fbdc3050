"""Measurements run in float32 whatever ``--trainer.precision`` says; certificates in float64."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def float32_network(network: nn.Module) -> Iterator[nn.Module]:
    """The network itself when its parameters and buffers are float32 (mixed precision keeps them so;
    autocast is switched off by the measurements), else a float32 copy (``bf16-true``, ``16-true``)."""
    tensors = [*network.parameters(), *network.buffers()]
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        yield network
    else:
        yield copy.deepcopy(network).float()


def float64_copy(network: nn.Module) -> nn.Module:
    """A float64 copy of the network, for certificates: it holds float32 (and bf16) weights exactly, and its bound
    and logits round 2⁻²⁹ times less than float32's (stability/robustness/certified.py)."""
    return copy.deepcopy(network).double()
