"""Small data sets kept on the training device: each epoch drawn by indexing, with no worker and no per-item collate.

The built-in data sets (digits, MNIST, CIFAR) fit in a GPU's memory many times over (CIFAR-10's training images are
150 MB as uint8), and a model of this suite's size trains faster than a DataLoader assembles its batches one item at
a time. :class:`ResidentBatches` holds the tensors on the device once and cuts each epoch into batches by indexing —
the same batches, in the same order, as the loader it replaces:

* training, one process: the permutation of :class:`~stability.data.base.EpochShuffle` (seeded by the run's seed
  and the epoch);
* training under DDP: the permutation Lightning's ``DistributedSampler`` draws (seed = the run's seed + the epoch),
  padded by its first indices to a multiple of the processes, rank r taking every world-th index from r;
* evaluation: the points in order (under DDP, rank r takes r, r + world, …: every point once, as
  :class:`~stability.data.base.ShardSampler`).

uint8 images become float in [0, 1] per batch (``x / 255``, as each item was before); labels stay integer. The
augmentation runs afterwards, on the batch, as before (``on_after_batch_transfer``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import TensorDataset

from ..seeding import epoch_seed, run_seed


def _rank_and_world() -> tuple[int, int]:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)


def epoch_order(size: int, epoch: int, shuffle: bool, rank: int = 0, world: int = 1) -> torch.Tensor:
    """The indices one process reads in an epoch, as the loaders they replace read them (module docstring)."""
    if not shuffle:
        return torch.arange(rank, size, world)
    if world == 1:
        return torch.randperm(size, generator=torch.Generator().manual_seed(epoch_seed(epoch, salt=1)))
    order = torch.randperm(size, generator=torch.Generator().manual_seed(run_seed() + epoch))
    total = math.ceil(size / world) * world
    if total > size:  # DistributedSampler's padding: the permutation's first indices again, repeated if need be
        order = torch.cat([order, order.repeat(math.ceil((total - size) / size))[:total - size]])
    return order[rank:total:world]


class ResidentBatches:
    """Batches of a :class:`~torch.utils.data.TensorDataset` (images, labels) held on ``device``.

    Args:
        dataset: the data set (kept as ``dataset``: the measurement callbacks read their points from it).
        batch_size: images per batch (the last batch of an epoch may be smaller).
        shuffle: training order (a permutation per epoch) or evaluation order.
        device: where the tensors live.
        epoch: returns the current epoch (read as each epoch's iteration starts).
    """

    def __init__(self, dataset: TensorDataset, batch_size: int, shuffle: bool, device: torch.device,
                 epoch: Callable[[], int] = lambda: 0) -> None:
        images, labels = dataset.tensors
        self.dataset, self.batch_size, self.shuffle, self.epoch = dataset, batch_size, shuffle, epoch
        self.images, self.labels = images.to(device), labels.to(device)

    def _order(self) -> torch.Tensor:
        rank, world = _rank_and_world()
        return epoch_order(len(self.dataset), self.epoch(), self.shuffle, rank, world)

    def __len__(self) -> int:
        size, (rank, world) = len(self.dataset), _rank_and_world()
        points = math.ceil(size / world) if self.shuffle else len(range(rank, size, world))
        return math.ceil(points / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order().to(self.images.device)
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            images = self.images[index]
            if images.dtype == torch.uint8:
                images = images.float().div_(255.0)
            yield images, self.labels[index]


__all__ = ["ResidentBatches", "epoch_order"]
