"""CIFAR-10 / CIFAR-100 from the official "python version" pickles.

The files are read directly (not through torchvision's dataset class, whose MD5 check
would reject anything but the full official archive); downloading goes through
torchvision's downloader and happens only when ``download=True``.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import ImageDataModule
from .splits import split_indices

ARCHIVES = {
    "cifar10": ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}


def read_batches(files: list[Path], label_key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) from CIFAR python pickle files."""
    images, labels = [], []
    for file in files:
        with open(file, "rb") as handle:
            entry = pickle.load(handle, encoding="bytes")
        images.append(np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(entry[label_key])
    return torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.long)


class _CIFAR(ImageDataModule):
    """Shared CIFAR logic. Train and val come from the official training files (val is a
    seeded held-out fraction), test from the official test file."""

    folder: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_key: bytes
    in_chans = 3
    image_size = 32

    def __init__(self, root: str = "data", download: bool = False, val_fraction: float = 0.1,
                 split_seed: int = 0, batch_size: int = 128, num_workers: int = 0, random_crop: int = 4,
                 horizontal_flip: bool = True, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 resident: bool = True) -> None:
        super().__init__(batch_size, num_workers, random_crop, horizontal_flip, mixup_alpha, cutmix_alpha, resident)
        self.root = Path(root)
        self.download = download
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.save_hyperparameters(logger=False)  # logged by TensorBoardLayout, without LightningCLI's own entries

    @property
    def directory(self) -> Path:
        return self.root / self.folder

    def prepare_data(self) -> None:
        if self.download and not self._complete():
            from torchvision.datasets.utils import download_and_extract_archive
            url, md5 = ARCHIVES[self.name]
            download_and_extract_archive(url, str(self.root), md5=md5)

    def _complete(self) -> bool:
        return all((self.directory / f).is_file() for f in self.train_files + self.test_files)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if not self._complete():
            missing = [f for f in self.train_files + self.test_files if not (self.directory / f).is_file()]
            raise FileNotFoundError(
                f"{self.name}: data not found in {self.directory} (missing {', '.join(missing)}). "
                f"Pass --data.download true to download it, or extract the official python-version "
                f"archive ({ARCHIVES[self.name][0]}) into {self.root}.")
        images, labels = read_batches([self.directory / f for f in self.train_files], self.label_key)
        train, val, _ = split_indices(len(labels), self.val_fraction, 0.0, self.split_seed)
        test_images, test_labels = read_batches([self.directory / f for f in self.test_files], self.label_key)
        self.train_set = _UInt8Images(images[train], labels[train])
        self.val_set = _UInt8Images(images[val], labels[val])
        self.test_set = _UInt8Images(test_images, test_labels)


class _UInt8Images(TensorDataset):
    """Stores uint8 images (4× less memory), returns float images in [0, 1]."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image.float().div_(255.0), label


class CIFAR10(_CIFAR):
    """CIFAR-10 (Krizhevsky 2009): 50,000 training and 10,000 test 32×32 RGB images, 10 classes."""

    name = "cifar10"
    num_classes = 10
    folder = "cifar-10-batches-py"
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_files = ("test_batch",)
    label_key = b"labels"
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)


class CIFAR100(_CIFAR):
    """CIFAR-100 (Krizhevsky 2009): 50,000 training and 10,000 test 32×32 RGB images, 100 fine classes."""

    name = "cifar100"
    num_classes = 100
    folder = "cifar-100-python"
    train_files = ("train",)
    test_files = ("test",)
    label_key = b"fine_labels"
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
