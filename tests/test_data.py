"""Data modules on real formats: digits, CIFAR python pickles and MNIST IDX files written here, a folder
of PNGs."""
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stability.data import CIFAR10, CIFAR100, MNIST, Digits, FashionMNIST, ImageFolder
from stability.data.base import augment, mix


def test_digits_split_is_deterministic_disjoint_and_in_unit_range():
    a, b = Digits(), Digits()
    a.setup(), b.setup()
    sizes = [len(a.train_set), len(a.val_set), len(a.test_set)]
    assert sum(sizes) == 1797 and sizes[1] == sizes[2] == round(1797 * 0.15)
    for split in ("train_set", "val_set", "test_set"):
        torch.testing.assert_close(getattr(a, split).tensors[0], getattr(b, split).tensors[0])
    images = torch.cat([a.train_set.tensors[0], a.val_set.tensors[0]])
    assert images.min() >= 0 and images.max() <= 1 and images.shape[1:] == (1, 8, 8)
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (64, 1, 8, 8) and y.dtype == torch.long


def test_digits_upsampling_and_bad_size():
    dm = Digits(image_size=16)
    dm.setup()
    assert dm.train_set.tensors[0].shape[1:] == (1, 16, 16)
    with pytest.raises(ValueError, match="image_size must be >= 8"):
        Digits(image_size=4)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        Digits(batch_size=0)


@pytest.mark.parametrize("cls,name", [(CIFAR10, "cifar10"), (CIFAR100, "cifar100")])
def test_cifar_reads_official_pickle_format(tmp_path, cls, name, write_cifar):
    written = write_cifar(tmp_path, name)
    dm = cls(root=str(tmp_path), val_fraction=0.2, batch_size=4)
    dm.setup()
    n_train = sum(len(lab) for f, (_, lab) in written.items() if "test" not in f)
    assert len(dm.train_set) + len(dm.val_set) == n_train
    assert len(dm.val_set) == round(n_train * 0.2)
    test_data, test_labels = written["test_batch" if name == "cifar10" else "test"]
    image, label = dm.test_set[3]
    expected = torch.from_numpy(test_data[3].reshape(3, 32, 32)).float() / 255
    torch.testing.assert_close(image, expected)
    assert label == test_labels[3]
    assert dm.num_classes == (10 if name == "cifar10" else 100) and dm.in_chans == 3
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and 0 <= x.min() and x.max() <= 1


def test_cifar_missing_directory_says_how_to_get_the_data(tmp_path):
    dm = CIFAR10(root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"cifar10: data not found.*--data.download true"):
        dm.setup()


def test_image_folder_reads_pngs(tmp_path):
    rng = np.random.default_rng(1)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    dm = ImageFolder(root=str(tmp_path), image_size=16, batch_size=4, num_workers=0)
    assert dm.num_classes == 2 and dm.in_chans == 3
    dm.setup()
    assert len(dm.train_set) == 6 and len(dm.val_set) == 4 and dm.test_set is dm.val_set
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 16, 16) and 0 <= x.min() and x.max() <= 1
    grey = ImageFolder(root=str(tmp_path), image_size=8, grayscale=True, mean=(0.5,), std=(0.5,))
    grey.setup()
    assert grey.train_set[0][0].shape == (1, 8, 8)


def test_image_folder_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train does not exist; expected .*train/<class>/<image>"):
        ImageFolder(root=str(tmp_path))


def test_augment_crop_and_flip():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4)
    assert torch.equal(augment(x, 0, False), x)
    cropped = augment(x, 2, False)
    assert cropped.shape == x.shape
    # every crop is a shifted window of the zero-padded image
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        windows = padded[i, 0].unfold(0, 4, 1).unfold(1, 4, 1).reshape(-1, 4, 4)
        assert any(torch.equal(w, cropped[i, 0]) for w in windows)
    torch.manual_seed(3)
    flipped = augment(x, 0, True)
    for i in range(2):
        assert torch.equal(flipped[i], x[i]) or torch.equal(flipped[i], x[i].flip(-1))


@pytest.mark.parametrize("mixup,cutmix", [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5)])
def test_mix_gives_soft_labels_that_sum_to_one(mixup, cutmix):
    x, y = torch.rand(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    mixed, soft = mix(x, y, 10, mixup, cutmix)
    assert mixed.shape == x.shape and soft.shape == (6, 10)
    torch.testing.assert_close(soft.sum(-1), torch.ones(6))
    rows = torch.arange(6)
    lam = soft[rows, y]
    torch.testing.assert_close(lam + soft[rows, y.flip(0)], torch.ones(6))  # own label and partner's only
    torch.testing.assert_close(lam, lam[:1].expand(6))  # one mixing weight per batch
    if cutmix == 0:
        torch.testing.assert_close(mixed, lam[0] * x + (1 - lam[0]) * x.flip(0))


def test_split_indices_partition_and_do_not_depend_on_global_seed():
    from stability.data.splits import split_indices
    torch.manual_seed(123)
    train, val, test = split_indices(100, 0.2, 0.1, seed=5)
    torch.manual_seed(456)
    again = split_indices(100, 0.2, 0.1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip((train, val, test), again))
    assert sorted(torch.cat([train, val, test]).tolist()) == list(range(100))
    assert (len(train), len(val), len(test)) == (70, 20, 10)
    with pytest.raises(ValueError, match="sum to less than 1"):
        split_indices(10, 0.6, 0.5)


def write_idx(raw: Path, images: np.ndarray, labels: np.ndarray, prefix: str) -> None:
    """IDX files as LeCun's: big-endian magic 0x0803 / 0x0801, then the sizes, then unsigned bytes."""
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as handle:
        handle.write(struct.pack(">iiii", 0x0803, *images.shape) + images.astype(np.uint8).tobytes())
    with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as handle:
        handle.write(struct.pack(">ii", 0x0801, len(labels)) + labels.astype(np.uint8).tobytes())


@pytest.mark.parametrize("cls", [MNIST, FashionMNIST])
def test_mnist_modules_read_the_official_idx_format(tmp_path, cls):
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 256, (24, 28, 28)), rng.integers(0, 256, (10, 28, 28))
    train_labels, test_labels = rng.integers(0, 10, 24), rng.integers(0, 10, 10)
    raw = tmp_path / cls.dataset_class.__name__ / "raw"
    write_idx(raw, train, train_labels, "train")
    write_idx(raw, test, test_labels, "t10k")
    data = cls(root=str(tmp_path), val_fraction=0.25, batch_size=8)
    data.setup()
    assert len(data.train_set) == 18 and len(data.val_set) == 6 and len(data.test_set) == 10
    image, label = data.test_set[3]
    assert image.shape == (1, 28, 28) and 0 <= float(image.min()) and float(image.max()) <= 1
    torch.testing.assert_close(image[0], torch.tensor(test[3] / 255.0, dtype=torch.float32))
    assert label == test_labels[3]
    everything = sorted(int(y) for _, y in [*data.train_set, *data.val_set])
    assert everything == sorted(train_labels.tolist())  # train and val partition the official training set
    resized = cls(root=str(tmp_path), image_size=32)
    resized.setup()
    assert resized.test_set[0][0].shape == (1, 32, 32)


def test_missing_mnist_files_say_how_to_get_them(tmp_path):
    data = MNIST(root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data.download true.*train-images-idx3-ubyte.gz"):
        data.setup()


OFFICIAL_MNIST = Path(__file__).resolve().parents[1] / "data" / "MNIST" / "raw"


@pytest.mark.skipif(not (OFFICIAL_MNIST / "t10k-labels-idx1-ubyte.gz").is_file(),
                    reason="the four official MNIST .gz files are not in data/MNIST/raw (see README, Data)")
def test_the_official_mnist_files_are_verified_and_extracted_offline(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, _ in MNIST.dataset_class.resources:
        (raw / name).write_bytes((OFFICIAL_MNIST / name).read_bytes())
    data = MNIST(root=str(tmp_path))
    data.prepare_data()
    data.setup()
    assert (len(data.train_set), len(data.val_set), len(data.test_set)) == (55000, 5000, 10000)
