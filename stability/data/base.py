"""Shared machinery of the image data modules.

Every data module yields images in [0, 1] (normalisation lives inside the model, so that
attacks see raw pixels) and integer labels. Augmentation runs on whole batches after they
reach the device (`on_after_batch_transfer`), so it is cheap and seeded by the global RNG
that `seed_everything` sets.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from ..seeding import epoch_seed, seed_epoch
from .resident import ResidentBatches


class ImageDataModule(L.LightningDataModule):
    """Base class: holds the loaders, the data set's facts and the batch augmentation.

    Subclasses set ``train_set``, ``val_set`` and ``test_set`` in ``setup`` and give the
    class attributes ``name`` (used in run directories) and the instance attributes
    ``num_classes``, ``in_chans``, ``image_size``, ``mean`` and ``std``.

    Args:
        batch_size: images per batch.
        num_workers: DataLoader worker processes.
        random_crop: pad by this many pixels and crop back at a random offset (0: off).
        horizontal_flip: flip each training image left-right with probability 1/2.
        mixup_alpha: Beta(α, α) mixing of pairs of images and labels (0: off).
        cutmix_alpha: Beta(α, α) box size for CutMix (0: off). With both on, each batch
            uses one of the two at random.
        resident: keep a tensor data set (digits, MNIST, CIFAR) on the training device and draw each batch by
            indexing (:class:`~stability.data.resident.ResidentBatches`: the same batches, no worker, no per-item
            collate); ``num_workers`` then has no use. Off: a DataLoader.
    """

    name = "images"

    def __init__(
        self,
        batch_size: int = 128,
        num_workers: int = 0,
        random_crop: int = 0,
        horizontal_flip: bool = False,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        resident: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for label, value in (("random_crop", random_crop), ("mixup_alpha", mixup_alpha),
                             ("cutmix_alpha", cutmix_alpha), ("num_workers", num_workers)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, got {value}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.random_crop = random_crop
        self.horizontal_flip = horizontal_flip
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        self.resident = resident
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    # ----------------------------------------------------------------- loaders
    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader | ResidentBatches:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not been run")
        if self.resident and isinstance(dataset, TensorDataset):
            trainer = getattr(self, "trainer", None)
            device = getattr(trainer, "root_device", None) or torch.device("cpu")
            return ResidentBatches(dataset, self.batch_size, shuffle, device,
                                   lambda: trainer.current_epoch if trainer is not None else 0)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        sampler = None
        if not shuffle and distributed:
            sampler = ShardSampler(dataset)  # every point evaluated exactly once across processes
        elif shuffle and not distributed:
            sampler = EpochShuffle(dataset)  # DDP: Lightning's DistributedSampler, seeded per epoch too
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle and sampler is None,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self._on_cuda(),  # page-locked batches: the copy to the GPU runs asynchronously
            drop_last=False,
        )

    def _on_cuda(self) -> bool:
        """True when the trainer this data module serves runs on a CUDA device."""
        trainer = getattr(self, "trainer", None)
        return trainer is not None and getattr(trainer, "root_device", torch.device("cpu")).type == "cuda"

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    # ------------------------------------------------------------ augmentation
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        trainer = getattr(self, "trainer", None)
        if trainer is None or not trainer.training:
            return batch
        if getattr(self, "_seeded_epoch", None) != trainer.current_epoch:
            # The first batch of an epoch, after its loader drew its seeds: from here on the epoch's
            # random draws (augmentation, dropout) depend on (seed, epoch) only — a resumed run repeats them.
            seed_epoch(trainer.current_epoch)
            self._seeded_epoch = trainer.current_epoch
        images, labels = batch
        images = augment(images, self.random_crop, self.horizontal_flip)
        if self.mixup_alpha > 0 or self.cutmix_alpha > 0:
            images, labels = mix(images, labels, self.num_classes, self.mixup_alpha, self.cutmix_alpha)
        return images, labels


class EpochShuffle(Sampler):
    """A random order of the data set seeded by the run's seed and the epoch (Lightning calls
    ``set_epoch``), not by the global generator: a run resumed from a checkpoint sees the data in the
    order an uninterrupted one does."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.epoch = dataset, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(epoch_seed(self.epoch, salt=1))
        return iter(torch.randperm(len(self.dataset), generator=generator).tolist())

    def __len__(self) -> int:
        return len(self.dataset)


class ShardSampler(DistributedSampler):
    """Points rank, rank + world, rank + 2·world, … of the data set, in order, without the padding of
    DistributedSampler (which repeats points so that every process gets as many): evaluation counts
    every point exactly once whatever the number of processes. Lightning keeps a DistributedSampler
    it is given instead of replacing it."""

    def __init__(self, dataset: Dataset) -> None:
        super().__init__(dataset, shuffle=False, drop_last=False)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))


def augment(images: torch.Tensor, pad: int, flip: bool) -> torch.Tensor:
    """Random crop (zero padding by ``pad``) and random horizontal flip of a batch (B, C, H, W)."""
    if pad > 0:
        b, _, h, w = images.shape
        padded = F.pad(images, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (b,), device=images.device)
        dx = torch.randint(0, 2 * pad + 1, (b,), device=images.device)
        rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]  # (B,1,H,1)
        cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]  # (B,1,1,W)
        batch_idx = torch.arange(b, device=images.device)[:, None, None, None]
        chan_idx = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
        images = padded[batch_idx, chan_idx, rows, cols]
    if flip:
        flip_mask = torch.rand(images.shape[0], device=images.device) < 0.5
        images = torch.where(flip_mask[:, None, None, None], images.flip(-1), images)
    return images


def mix(images: torch.Tensor, labels: torch.Tensor, num_classes: int,
        mixup_alpha: float, cutmix_alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MixUp (Zhang et al. 2018) or CutMix (Yun et al. 2019) of a batch with its reverse.

    Returns the mixed images and soft labels (B, num_classes) that sum to one.
    """
    one_hot = F.one_hot(labels, num_classes).to(images.dtype)
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or torch.rand(()) < 0.5)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    partner = images.flip(0)
    if use_cutmix:
        h, w = images.shape[-2:]
        cut_h, cut_w = int(h * (1 - lam) ** 0.5), int(w * (1 - lam) ** 0.5)
        cy, cx = int(torch.randint(0, h, ())), int(torch.randint(0, w, ()))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        images = images.clone()
        images[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    else:
        images = lam * images + (1 - lam) * partner
    return images, lam * one_hot + (1 - lam) * one_hot.flip(0)
