"""The stabilizer interface: selection by name, composition, and every hook called by the module."""
import lightning as L
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.models import attention_sites
from stability.stabilizers import REGISTRY, Stabilizer, build_stabilizers, stabilizer_names
from stability.stabilizers.none import NoStabilizer

TINY_VIT = {"embed_dim": 16, "depth": 1, "num_heads": 2}


class SGDSupplier(Stabilizer):
    name = "sgd_supplier"

    def build_optimizer(self, network, default):
        return torch.optim.SGD(network.parameters(), lr=0.01)


@pytest.fixture
def registered(monkeypatch, recorder):
    monkeypatch.setitem(REGISTRY, "sgd_supplier", SGDSupplier)


def test_names_parse_and_unknown_names_list_the_valid_ones(registered):
    assert stabilizer_names("none") == ["none"]
    assert stabilizer_names("recorder,sgd_supplier") == ["recorder", "sgd_supplier"]
    assert stabilizer_names("recorder+none") == ["recorder"]
    assert stabilizer_names(["recorder", "sgd_supplier"]) == ["recorder", "sgd_supplier"]
    with pytest.raises(ValueError, match=r"unknown stabilizer 'jasmine'; valid names: \[.*'none'.*'recorder'"):
        stabilizer_names("jasmine")
    with pytest.raises(ValueError, match="listed twice"):
        stabilizer_names("recorder,recorder")


def test_options_reach_only_the_selected_stabilizer(registered):
    (rec,) = build_stabilizers("recorder", {"recorder": {"weight": 0.5}})
    assert rec.weight == 0.5 and rec.bound == 3.0
    with pytest.raises(ValueError, match=r"options given for stabilizer\(s\) \['recorder'\] that are not selected"):
        build_stabilizers("none", {"recorder": {"weight": 0.5}})
    with pytest.raises(ValueError, match="bad options for stabilizer 'recorder'"):
        build_stabilizers("recorder", {"recorder": {"lam": 0.5}})
    assert isinstance(build_stabilizers("none")[0], NoStabilizer)


def _fit(module, epochs=1, batches=3):
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=epochs, limit_train_batches=batches, limit_val_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, Digits(batch_size=16))
    return trainer


def test_module_calls_every_hook_and_adds_the_loss_term(registered):
    module = ImageClassifier(backbone="vit", backbone_options=TINY_VIT, stabilizer="recorder,none")
    (rec,) = module.stabilizers
    assert rec.calls["prepare"] == 1 and float(module.network.backbone.head.bias.abs().sum()) == 0.0
    trainer = _fit(module)
    assert rec.calls["loss"] == 3 and rec.calls["after_step"] == 3
    assert rec.prob_shapes == [(16, 2, 17, 17)]  # one ViT layer, 2 heads, 16 patches + CLS
    assert "loss/recorder_epoch" in trainer.callback_metrics and "loss/task_epoch" in trainer.callback_metrics
    assert float(module.network.backbone.head.weight.abs().max()) <= 0.05 + 1e-7
    assert all(s.module.fused_attn for s in attention_sites(module.network.backbone))  # fused path restored
    assert rec.lipschitz_bound(module.network) == 3.0


def test_stabilizer_can_supply_the_optimizer_but_only_one(registered):
    module = ImageClassifier(backbone="vit", backbone_options=TINY_VIT, stabilizer="sgd_supplier")
    trainer = _fit(module, batches=1)
    assert isinstance(trainer.optimizers[0], torch.optim.SGD)
    both = ImageClassifier(backbone="vit", backbone_options=TINY_VIT, stabilizer="sgd_supplier,recorder")
    both.stabilizers[1].build_optimizer = SGDSupplier().build_optimizer
    with pytest.raises(ValueError, match="each supply an optimizer"):
        _fit(both, batches=1)


def test_baseline_changes_nothing():
    torch.manual_seed(0)
    plain = ImageClassifier(backbone="vit", backbone_options=TINY_VIT)
    torch.manual_seed(0)
    none = ImageClassifier(backbone="vit", backbone_options=TINY_VIT, stabilizer="none")
    for a, b in zip(plain.state_dict().values(), none.state_dict().values()):
        assert torch.equal(a, b)
    assert NoStabilizer().lipschitz_bound(none.network) is None
    assert NoStabilizer().loss(None) is None


def test_module_swapping_stabilizers_prepare_first_whatever_the_order_given():
    module = ImageClassifier(backbone="vit", backbone_options=TINY_VIT, stabilizer="specformer,lipsformer")
    assert [s.name for s in module.stabilizers] == ["specformer", "lipsformer"]
    for site in attention_sites(module.network.backbone):
        assert hasattr(site.module, "kernel") and hasattr(site.module, "specformer_u_q")


def test_no_stabilizer_imports_another():
    """Model surgery lives in stability/models: a stabilizer module imports no other stabilizer module (shared bases
    that register nothing, such as base and certified_loss, may be imported)."""
    import ast
    from pathlib import Path

    import stability.stabilizers as package

    folder = Path(package.__file__).parent
    methods = {cls.__module__.rpartition(".")[2] for cls in REGISTRY.values()}
    assert methods >= {"gloro", "emma", "lipschitz_margin"} and "certified_loss" not in methods
    for path in folder.glob("*.py"):
        if path.stem not in methods:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = (node.module or "").split(".")
                names = {alias.name for alias in node.names}
                imported = ({module[-1]} if node.level == 1 and node.module else names if node.level == 1 else set())
                imported |= {m for m in module if m in methods and "stabilizers" in module}
                assert not (imported & (methods - {path.stem})), f"{path.name} imports {imported & methods}"
