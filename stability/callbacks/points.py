"""The evaluation points of the measurement callbacks, and how they are shared between processes.

The points are the first ``num_points`` of the evaluation data set, in its fixed order (all of it
when ``num_points`` is None), read from the data set itself rather than through the loader, so no
distributed sampler pads or reorders them. They are cut into fixed batches; under DDP, batch b goes
to rank b mod world size, every rank measures only its own batches, and the per-batch results are
gathered to every rank and put back in batch order. The numbers are therefore the same on one
process and on several, and no point is measured twice.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from ..robustness.batch_memory import MEMORY_SHARE, process_memory
from .measuring import MeasurementInterrupted

if TYPE_CHECKING:
    from .measuring import Session


def dataset_of(loaders) -> Any:
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    if loader is None:
        raise ValueError("no evaluation data loader")
    return loader.dataset


def point_count(dataset, num_points: int | None) -> int:
    size = len(dataset)
    if size == 0:
        raise ValueError("the evaluation data set is empty")
    return size if num_points is None else min(num_points, size)


def batch_ranges(count: int, batch_size: int) -> list[tuple[int, int]]:
    """[(start, stop)] of the global batches of ``count`` points."""
    return [(start, min(start + batch_size, count)) for start in range(0, count, batch_size)]


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def my_batches(count: int, batch_size: int) -> Iterator[tuple[int, int, int]]:
    """(batch index, start, stop) of this process's share of the global batches."""
    rank, world = rank_and_world()
    for index, (start, stop) in enumerate(batch_ranges(count, batch_size)):
        if index % world == rank:
            yield index, start, stop


def load(dataset, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (float32) and integer labels of points ``start:stop`` of the data set."""
    items = [dataset[i] for i in range(start, stop)]
    images = torch.stack([torch.as_tensor(x) for x, _ in items]).float().to(device)
    labels = torch.as_tensor([int(y) for _, y in items], dtype=torch.long, device=device)
    return images, labels


def gather_batches(local: dict[int, Any]) -> list[Any]:
    """Every process's ``{batch index: result}`` merged and listed in batch order (results must
    be picklable; tensors are moved to the CPU first)."""
    local = {index: _to_cpu(result) for index, result in local.items()}
    rank, world = rank_and_world()
    if world > 1:
        shards: list[dict[int, Any]] = [{} for _ in range(world)]
        dist.all_gather_object(shards, local)
        local = {index: result for shard in shards for index, result in shard.items()}
    return [local[index] for index in sorted(local)]


def measure_batches(dataset, count: int, batch_size: int, device: torch.device,
                    measure: Callable[[int, torch.Tensor, torch.Tensor], Any], session: Session | None = None,
                    name: str = "", network: torch.nn.Module | Sequence[torch.nn.Module] | None = None) -> list[Any]:
    """``measure(batch index, images, labels)`` on this process's batches, gathered from all.

    With a :class:`~stability.callbacks.measuring.Session`: a progress bar and a log line named ``name``, batches
    kept from an interrupted run loaded instead of measured (and each finished one kept), and a stop signal honoured
    between batches and at every forward pass of ``network``, or of each of several
    (:class:`~.measuring.MeasurementInterrupted`)."""
    if session is None:
        return gather_batches({index: measure(index, *load(dataset, start, stop, device))
                               for index, start, stop in my_batches(count, batch_size)})
    local: dict[int, Any] = {}
    points = resumed = 0
    bar = session.bar(name, count)
    session.starting(name, count)
    started = time.perf_counter()
    rank, world = rank_and_world()
    ranges = batch_ranges(count, batch_size)
    stopped = False
    try:
        for first in range(0, len(ranges), world):  # one round: a batch for each process (or none, at the end)
            if world > 1:  # every process stops at the same round, or the gathers below would not match
                stopped = _any_process(stopped or session.should_stop(), device)
            if stopped or session.should_stop():
                raise MeasurementInterrupted(name, local, points)
            index = first + rank
            if index >= len(ranges):
                continue
            start, stop = ranges[index]
            result = session.load(name, index)
            if result is None:
                try:
                    with session.interruptible(network, name, local, points):
                        result = measure(index, *load(dataset, start, stop, device))
                except MeasurementInterrupted:
                    if world == 1:
                        raise
                    stopped = True  # said to the others at the next round
                    continue
                session.save(name, index, result)
            else:
                resumed += stop - start
            local[index] = result
            points += stop - start
            bar.update(stop - start)
            done = ranges[min(first + world, len(ranges)) - 1][1]  # every process's points of the rounds so far
            if done < count:
                session.progress(name, done, count, time.perf_counter() - started, resumed * world)
        if world > 1 and _any_process(stopped, device):
            raise MeasurementInterrupted(name, local, points)
    finally:
        bar.close()
    gathered = gather_batches(local)
    session.said(name, count, time.perf_counter() - started, resumed)
    return gathered


def _any_process(flag: bool, device: torch.device) -> bool:
    """True on every process when any process's ``flag`` is (one all-reduce)."""
    backend_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=backend_device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def has_finite_weights(module: torch.nn.Module) -> bool:
    """False once a run has diverged into inf/NaN weights: there is nothing left to measure (and
    an SVD of such a weight raises)."""
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def memory_sized(trainer, dataset, points: int, device, size: Callable[[torch.Tensor, torch.Tensor, int, int], int],
                 said: str, option: str) -> int:
    """A measurement's batch sized by memory, decided on rank 0 and broadcast so that every process splits the points
    alike: ``size(images, labels, points per process, memory)`` on the first 4 points, with each process's share of
    the points and of the memory (:func:`~stability.robustness.batch_memory.process_memory`); the decision said as
    ``"<said> N points at once (--<option> memory: …)"``."""
    chosen = 0
    if trainer.is_global_zero:
        images, labels = load(dataset, 0, min(points, 4), device)
        memory = process_memory(device, trainer.num_devices)
        chosen = size(images, labels, -(-points // trainer.world_size), memory)
        rank_zero_info(f"{said} {chosen} points at once (--{option} memory: {MEMORY_SHARE:.0%} of "
                       f"{memory / 2 ** 30:.3g} GiB"
                       + (f", {trainer.world_size} processes" if trainer.world_size > 1 else "") + ")")
    return int(trainer.strategy.broadcast(chosen, src=0))
