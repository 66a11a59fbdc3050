"""MNIST and Fashion-MNIST through torchvision's dataset classes (LeCun et al. 1998; Xiao et al. 2017).

The four official IDX files live in ``<root>/MNIST/raw`` (``<root>/FashionMNIST/raw``), as torchvision
expects them. ``download: true`` fetches them; the official ``.gz`` files placed there by hand are
checked against torchvision's MD5 sums and extracted without any network access. Train and val come
from the official training set (val a fixed, seeded 5,000 images), test is the official 10,000.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision import datasets

from .base import ImageDataModule
from .cifar import _UInt8Images
from .splits import split_indices


class _IDXDataModule(ImageDataModule):
    """Shared logic of the 28×28 grey IDX data sets."""

    dataset_class: type[datasets.MNIST]
    num_classes = 10
    in_chans = 1

    def __init__(self, root: str = "data", download: bool = False, image_size: int = 28,
                 val_fraction: float = 5000 / 60000, split_seed: int = 0, batch_size: int = 128, num_workers: int = 0,
                 random_crop: int = 0, horizontal_flip: bool = False, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, resident: bool = True) -> None:
        super().__init__(batch_size, num_workers, random_crop, horizontal_flip, mixup_alpha, cutmix_alpha, resident)
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        self.root, self.download, self.image_size = Path(root), download, image_size
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.save_hyperparameters(logger=False)  # logged by TensorBoardLayout, without LightningCLI's own entries

    @property
    def raw_folder(self) -> Path:
        return self.root / self.dataset_class.__name__ / "raw"

    def _archives_present(self) -> bool:
        return all((self.raw_folder / name).is_file() for name, _ in self.dataset_class.resources)

    def prepare_data(self) -> None:
        if self.download or self._archives_present():  # local archives: verified and extracted, no network
            for train in (True, False):
                self.dataset_class(str(self.root), train=train, download=True)

    def _load(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            dataset = self.dataset_class(str(self.root), train=train, download=False)
        except RuntimeError:
            files = ", ".join(name for name, _ in self.dataset_class.resources)
            raise FileNotFoundError(
                f"{self.name}: data not found in {self.raw_folder}. Pass --data.download true to download it, "
                f"or copy the four official files ({files}) into {self.raw_folder} (they are checked and "
                f"extracted without network access).") from None
        images = dataset.data.unsqueeze(1)  # (N, 1, 28, 28) uint8
        if self.image_size != images.shape[-1]:
            images = F.interpolate(images.float(), size=self.image_size, mode="bilinear", align_corners=False)
            images = images.round().clamp(0, 255).to(torch.uint8)
        return images, dataset.targets.long()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self._archives_present() and not (self.raw_folder / "t10k-labels-idx1-ubyte").is_file():
            self.prepare_data()  # a single process without prepare_data (e.g. in a notebook)
        images, labels = self._load(train=True)
        train, val, _ = split_indices(len(labels), self.val_fraction, 0.0, self.split_seed)
        test_images, test_labels = self._load(train=False)
        self.train_set = _UInt8Images(images[train], labels[train])
        self.val_set = _UInt8Images(images[val], labels[val])
        self.test_set = _UInt8Images(test_images, test_labels)


class MNIST(_IDXDataModule):
    """MNIST: 60,000 training and 10,000 test 28×28 handwritten digits, 10 classes."""

    name = "mnist"
    dataset_class = datasets.MNIST
    mean = (0.1307,)
    std = (0.3081,)


class FashionMNIST(_IDXDataModule):
    """Fashion-MNIST: 60,000 training and 10,000 test 28×28 grey images of clothing, 10 classes."""

    name = "fashion_mnist"
    dataset_class = datasets.FashionMNIST
    mean = (0.2860,)
    std = (0.3530,)
