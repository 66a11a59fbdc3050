"""Resident data: the small data sets stay on the training device and each epoch is drawn by indexing — the same
batches, in the same order, as the DataLoader they replace (one process, and each rank of DDP's sharding), and the
same training, bit for bit."""
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.data.base import EpochShuffle, ShardSampler
from stability.data.cifar import _UInt8Images
from stability.data.resident import ResidentBatches, epoch_order


@pytest.mark.parametrize("size", [10, 11, 13])
def test_the_orders_are_the_loaders_orders(size, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dataset = TensorDataset(torch.arange(size))
    for epoch in (0, 3):
        shuffle = EpochShuffle(dataset)
        shuffle.set_epoch(epoch)
        assert epoch_order(size, epoch, True).tolist() == list(shuffle)
        for world in (2, 3):
            for rank in range(world):
                sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
                sampler.set_epoch(epoch)
                assert epoch_order(size, epoch, True, rank, world).tolist() == list(sampler), (world, rank)
                shard = ShardSampler.__new__(ShardSampler)
                shard.rank, shard.num_replicas, shard.dataset = rank, world, dataset
                assert epoch_order(size, epoch, False, rank, world).tolist() == list(shard)
    assert epoch_order(size, 0, False).tolist() == list(range(size))


def test_the_batches_are_the_dataloaders_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    sets = [TensorDataset(torch.rand(37, 1, 4, 4, generator=gen), torch.randint(0, 10, (37,), generator=gen)),
            _UInt8Images(torch.randint(0, 256, (37, 3, 4, 4), generator=gen, dtype=torch.uint8),
                         torch.randint(0, 10, (37,), generator=gen))]
    for dataset in sets:
        for epoch in (0, 1):
            for shuffle in (True, False):
                sampler = EpochShuffle(dataset) if shuffle else None
                if sampler is not None:
                    sampler.set_epoch(epoch)
                loader = DataLoader(dataset, batch_size=8, sampler=sampler)
                resident = ResidentBatches(dataset, 8, shuffle, torch.device("cpu"), lambda e=epoch: e)
                assert len(resident) == len(loader) == 5
                for (x, y), (rx, ry) in zip(loader, resident, strict=True):
                    assert rx.dtype == x.dtype == torch.float32
                    assert torch.equal(x, rx) and torch.equal(y, ry)


def fit(resident: bool, epochs: int = 2) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    module = ImageClassifier(backbone="vit", image_size=8, backbone_options=dict(embed_dim=16, depth=1, num_heads=2))
    data = Digits(batch_size=64, random_crop=1, resident=resident)
    trainer = L.Trainer(max_epochs=epochs, limit_train_batches=6, limit_val_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    loader = trainer.train_dataloader
    assert isinstance(loader, ResidentBatches) == resident
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_a_fit_on_resident_data_trains_the_same_weights():
    """Augmentation included (random crops drawn per epoch): the weights after two epochs are equal, bit for bit."""
    resident, loaded = fit(True), fit(False)
    assert resident.keys() == loaded.keys()
    for key in resident:
        assert torch.equal(resident[key], loaded[key]), key
