"""An ImageNet-style folder: ``root/train/<class>/*.png``, ``root/val/<class>/…``, optional ``root/test``."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torchvision import transforms
from torchvision.datasets import ImageFolder as TorchvisionImageFolder

from .base import ImageDataModule


class ImageFolder(ImageDataModule):
    """Images from class sub-folders, resized (shorter side) and centre-cropped to ``image_size``.

    Args:
        root: folder holding ``train/`` and ``val/`` (and ``test/``; without it, test uses val).
        image_size: side of the square images given to the model.
        grayscale: read images as one channel instead of RGB.
        mean, std: per-channel statistics for the normalisation inside the model
            (ImageNet's by default).
    """

    name = "folder"

    def __init__(self, root: str, image_size: int = 224, grayscale: bool = False,
                 mean: Sequence[float] = (0.485, 0.456, 0.406), std: Sequence[float] = (0.229, 0.224, 0.225),
                 batch_size: int = 128, num_workers: int = 2, random_crop: int = 0, horizontal_flip: bool = True,
                 mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> None:
        super().__init__(batch_size, num_workers, random_crop, horizontal_flip, mixup_alpha, cutmix_alpha)
        self.root = Path(root)
        self.image_size = image_size
        self.in_chans = 1 if grayscale else 3
        if len(mean) != self.in_chans or len(std) != self.in_chans:
            raise ValueError(f"mean and std need {self.in_chans} entries (grayscale={grayscale}); "
                             f"got {len(mean)} and {len(std)}")
        self.mean, self.std = tuple(mean), tuple(std)
        self.num_classes = len(self._classes(self.root / "train"))
        self.save_hyperparameters(logger=False)  # logged by TensorBoardLayout, without LightningCLI's own entries

    @staticmethod
    def _classes(split_dir: Path) -> list[str]:
        if not split_dir.is_dir():
            raise FileNotFoundError(
                f"image folder: {split_dir} does not exist; expected {split_dir.parent}/train/<class>/<image> "
                f"and {split_dir.parent}/val/<class>/<image> (optionally test/)")
        classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
        if not classes:
            raise FileNotFoundError(f"image folder: {split_dir} has no class sub-folders")
        return classes

    def _dataset(self, split: str) -> TorchvisionImageFolder:
        classes = self._classes(self.root / split)
        if classes != self._classes(self.root / "train"):
            raise ValueError(f"image folder: classes of {split}/ {classes} differ from train/ "
                             f"{self._classes(self.root / 'train')}")
        steps = [transforms.Resize(self.image_size), transforms.CenterCrop(self.image_size)]
        if self.in_chans == 1:
            steps.append(transforms.Grayscale())
        steps.append(transforms.ToTensor())
        return TorchvisionImageFolder(str(self.root / split), transform=transforms.Compose(steps))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.train_set = self._dataset("train")
        self.val_set = self._dataset("val")
        self.test_set = self._dataset("test") if (self.root / "test").is_dir() else self.val_set
