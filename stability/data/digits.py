"""scikit-learn's bundled digits (1,797 8×8 grey images of 0–9): real data, no download."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from .base import ImageDataModule
from .splits import split_indices


class Digits(ImageDataModule):
    """The default data set: deterministic train/val/test split, optional upsampling.

    Args:
        image_size: side of the images fed to the model; 8 is native, larger sizes
            (e.g. 16, 32) are bilinear upsamplings, done once.
        val_fraction, test_fraction: parts of the 1,797 images held out, split with
            ``split_seed`` (fixed by default, so every run sees the same split).
        Other arguments: see :class:`~stability.data.base.ImageDataModule`.
    """

    name = "digits"
    num_classes = 10
    in_chans = 1

    def __init__(self, image_size: int = 8, val_fraction: float = 0.15, test_fraction: float = 0.15,
                 split_seed: int = 0, batch_size: int = 64, num_workers: int = 0, random_crop: int = 0,
                 horizontal_flip: bool = False, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 resident: bool = True) -> None:
        super().__init__(batch_size, num_workers, random_crop, horizontal_flip, mixup_alpha, cutmix_alpha, resident)
        if image_size < 8:
            raise ValueError(f"digits are 8×8; image_size must be >= 8, got {image_size}")
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        # Statistics of the 8×8 images in [0, 1] (all 1,797; upsampling changes them little).
        self.mean = (0.3053,)
        self.std = (0.3760,)
        self.save_hyperparameters(logger=False)  # logged by TensorBoardLayout, without LightningCLI's own entries

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
        if self.image_size != 8:
            images = F.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
            images = images.clamp(0.0, 1.0)
        labels = torch.tensor(digits.target, dtype=torch.long)
        train, val, test = split_indices(len(labels), self.val_fraction, self.test_fraction, self.split_seed)
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])
