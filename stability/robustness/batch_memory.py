"""A measurement's batch sized by the device's memory (``--robustness.autoattack_batch_size memory``,
``--robustness.batch_size memory``, ``--lipschitz.batch_size memory``).

AutoAttack's time is set by its calls of the network per batch (at most 7,888 for the standard version,
:mod:`~stability.robustness.autoattack_cost`), not by the points in the batch, so on a GPU the fastest batch is the
largest that fits. Its size here is

    b = ⌊(share · total memory − fixed bytes) / bytes per point⌋,   clipped to [1, points],

where a point's bytes are those autograd saves for one forward and backward pass of the network to its input
(counted at 2 and 4 points: the count is affine in the batch, tested), doubled for the pass's transient tensors and
gradients, plus ``16 + classes`` copies of the input for the attack's own buffers (APGD's iterates and best points,
FAB's per-class gradients in its untargeted version). ``share`` (one half by default) leaves room for what the count
does not see. The device's *total* memory is used, not what is free now, so the size, and with it the batches' seeds
and the numbers, is the same on every run on the same device and network: a stopped test resumes from its batches.

The Lipschitz measurements size theirs the same way from their own unit of work (:func:`unit_bytes`): the power
iteration keeps the graph of a vector–Jacobian product made differentiable (``create_graph``), about twice a pass.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..testing.profiling import saved_for_backward
from .fixed_batch import repeated_to

MEMORY_SHARE = 0.5
TRANSIENT_FACTOR = 2  # a pass's peak beside what it saves: its transient activations and the gradients


def saved_bytes(network: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> int:
    """Bytes autograd saves for the cross-entropy's gradient to the input on ``images`` (each storage once)."""
    from .attacks import evaluating, gradients_allowed, input_gradient

    with gradients_allowed(), evaluating(network):
        return saved_for_backward(lambda: input_gradient(network, images, labels))


def unit_bytes(count: Callable[[torch.Tensor, torch.Tensor], int], images: torch.Tensor,
               labels: torch.Tensor) -> tuple[int, int]:
    """(bytes per point, bytes independent of the batch) of a unit of work whose saved bytes at a batch are
    ``count(images, labels)``, from the counts at 2 and 4 points (``images`` repeated as needed): the count is affine
    in the batch."""
    counts = [count(*repeated_to(size, images, labels)) for size in (2, 4)]
    per_point = max(0, (counts[1] - counts[0]) // 2)
    return per_point, max(0, counts[0] - 2 * per_point)


def float64_forward_bytes(exact: nn.Module, images: torch.Tensor, _labels: torch.Tensor) -> int:
    """Bytes a float64 forward of ``exact`` saves with a graph: at least the peak of the same forward without one."""
    from .attacks import evaluating, gradients_allowed

    with gradients_allowed(), evaluating(exact):
        return saved_for_backward(lambda: exact(images.double().requires_grad_(True)))


def pass_bytes(network: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """:func:`unit_bytes` of a forward and backward pass to the input (an attack's unit of work)."""
    return unit_bytes(functools.partial(saved_bytes, network), images, labels)


CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # a container's or a job's limit (cgroup v2), where one is set


def device_memory(device: torch.device | str) -> int:
    """Total memory of ``device`` in bytes: the GPU's, or for the CPU the machine's RAM, or the cgroup's limit where
    that is lower (a container, a SLURM job)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        limit = CGROUP_LIMIT.read_text().strip()
    except OSError:
        return memory
    return min(memory, int(limit)) if limit.isdigit() else memory


def process_memory(device: torch.device | str, processes_here: int) -> int:
    """The memory one process may plan with: the device's, or on the CPU the machine's shared by the processes of
    one machine (``processes_here``: a DDP run's devices on this node)."""
    sharing = processes_here if torch.device(device).type == "cpu" else 1
    return device_memory(device) // max(1, sharing)


def memory_sized_batch(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, points: int, num_classes: int,
                       memory: int, share: float = MEMORY_SHARE, exact: nn.Module | None = None) -> int:
    """The largest attack batch whose estimated peak fits ``share`` of ``memory`` bytes, at most ``points``; with
    ``exact`` (a certificate's float64 copy, run on the same batches) the larger of its forward and the pass."""
    per_point, fixed = pass_bytes(network, images, labels)
    if exact is not None:
        forward = unit_bytes(functools.partial(float64_forward_bytes, exact), images, labels)
        per_point, fixed = max(per_point, forward[0]), max(fixed, forward[1])
    copies = (16 + num_classes) * images[0].numel() * images.element_size()
    return largest_batch(per_point, fixed, copies, points, memory, share)


def largest_batch(per_point: int, fixed: int, copies: int, points: int, memory: int,
                  share: float = MEMORY_SHARE) -> int:
    """⌊(share · memory − 2·fixed) / (2·per_point + copies)⌋ in [1, points]: the saved bytes doubled for the
    transient tensors (``TRANSIENT_FACTOR``), plus ``copies`` bytes a point of the measurement's own buffers."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    room = share * memory - TRANSIENT_FACTOR * fixed
    return int(max(1, min(points, room // max(1, TRANSIENT_FACTOR * per_point + copies))))


__all__ = ["CGROUP_LIMIT", "MEMORY_SHARE", "device_memory", "largest_batch", "memory_sized_batch", "pass_bytes",
           "process_memory", "saved_bytes", "unit_bytes"]
