"""Training on digits with each stabilizer: it runs on every backbone, lowers the loss, and the
regularisers lower what they target compared with the baseline at the same seed.

The stabilizers come from the registry: a new one is trained here without editing this file."""
import lightning as L
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.models import attention_sites, capture_attention, linear_layers
from stability.nn import constraints
from stability.nn.softmax_bounds import g_k
from stability.stabilizers import REGISTRY
from stability.stabilizers.muon import constrained_matrices

BACKBONES = {"vit": (8, dict(embed_dim=16, depth=2, num_heads=2)),
             "swin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
             "cswin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2))),
             "lipcnn": (8, {}), "hybrid": (8, {})}
# the convolutional anchor certifies on its own: the losses need no lipschitz_transformer beside them there
ON_THE_ANCHOR = [name for name, cls in REGISTRY.items() if "lipcnn" in cls.backbones]
COMPOSITIONS = ["lipsformer,jasmin", "lipschitz_transformer,muon", "lipschitz_transformer,muon,lipschitz_margin"]
ALL = [",".join([*REGISTRY[name].needs, name]) for name in REGISTRY] + COMPOSITIONS


def applies(stabilizer: str, backbone: str) -> bool:
    return all(backbone in REGISTRY[name].backbones for name in stabilizer.split(","))


class StepCheck(L.Callback):
    """Records the training loss and runs ``check(module)`` after every optimizer step."""

    def __init__(self, check=None):
        self.losses, self.check = [], check

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.check is not None:
            self.check(module)


def train(stabilizer="none", options=None, backbone="vit", epochs=3, batches=12, check=None, lr=3e-3):
    size, backbone_options = BACKBONES[backbone]
    L.seed_everything(0)
    module = ImageClassifier(backbone=backbone, image_size=size, backbone_options=backbone_options,
                             stabilizer=stabilizer, stabilizer_options=options, lr=lr, scheduler="constant")
    recorder = StepCheck(check)
    trainer = L.Trainer(max_epochs=epochs, limit_train_batches=batches, limit_val_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder])
    data = Digits(image_size=size, batch_size=32)
    trainer.fit(module, data)
    return module, recorder.losses, data


@pytest.mark.parametrize("stabilizer", ON_THE_ANCHOR)
def test_every_stabilizer_of_the_anchor_trains_it_and_lowers_its_loss(stabilizer):
    assert {"gloro", "emma", "lipschitz_margin", "tau_ce", "none"} <= set(ON_THE_ANCHOR)
    _, losses, _ = train(stabilizer, backbone="lipcnn", lr=1e-2)
    early, late = early_late(losses)
    assert all(torch.isfinite(torch.tensor(losses))) and late < early, (stabilizer, early, late)


def early_late(losses, window=6):
    return sum(losses[:window]) / window, sum(losses[-window:]) / window


@pytest.mark.parametrize("backbone", ["vit", "swin", "cswin", "hybrid"])
@pytest.mark.parametrize("stabilizer", ALL)
def test_every_stabilizer_trains_on_every_backbone(stabilizer, backbone):
    if not applies(stabilizer, backbone):
        pytest.skip(f"{stabilizer} does not apply to {backbone}")
    _, losses, _ = train(stabilizer, backbone=backbone, epochs=1, batches=3)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("stabilizer", ALL)
def test_training_lowers_the_loss(stabilizer):
    _, losses, _ = train(stabilizer)
    early, late = early_late(losses)
    assert late < early, (stabilizer, early, late)


def validation_batch(data):
    data.setup()
    return data.val_set.tensors[0][:64]


def mean_g1(module, images):
    module.eval()
    with torch.no_grad(), capture_attention(module.network.backbone) as probs:
        module(images)
    return float(torch.stack([g_k(p, 1).mean() for p in probs]).mean())


def test_jasmin_lowers_mean_g1_against_the_baseline():
    base, _, data = train("none")
    jasmin, _, _ = train("jasmin", {"jasmin": {"lam": 0.1, "k": 0, "reduction": "mean"}})
    images = validation_batch(data)
    floor = 1 / 17  # g1 of a uniform row over 16 patches + CLS; short training leaves rows near it
    base_g1, jasmin_g1 = mean_g1(base, images), mean_g1(jasmin, images)
    assert jasmin_g1 < base_g1 and abs(jasmin_g1 - floor) < 0.5 * (base_g1 - floor), (base_g1, jasmin_g1)


def qkv_sigmas(module):
    return sum(float(torch.linalg.matrix_norm(site.qkv.weight.detach().view(3 * site.num_heads, site.head_dim, -1),
                                              ord=2).pow(2).sum()) for site in attention_sites(module.network))


def test_specformer_lowers_the_qkv_spectral_norms_against_the_baseline():
    base, _, _ = train("none")
    spec, _, _ = train("specformer", {"specformer": {"lam_q": 0.05, "lam_k": 0.05, "lam_v": 0.05}})
    assert qkv_sigmas(spec) < 0.9 * qkv_sigmas(base)


def test_spectral_norm_holds_sigma_max_at_every_step():
    def check(module):
        worst = max(float(torch.linalg.matrix_norm(lin.weight.detach(), ord=2))
                    for lin in linear_layers(module.network, "all"))
        assert worst <= 0.8 + 1e-4

    train("spectral_norm", {"spectral_norm": {"sigma_max": 0.8}}, check=check)


@pytest.mark.parametrize("constraint", ["normalise", "hammer", "hard_cap", "soft_cap"])
def test_muon_constraints_hold_sigma_max_at_every_step(constraint):
    def check(module):
        worst = max(constraints.rms_norm(p.detach().double()) for _, p in constrained_matrices(module.network))
        assert worst <= 1.0 + 1e-4, worst

    train("muon", {"muon": {"constraint": constraint, "sigma_max": 1.0, "lr": 0.02}}, check=check, epochs=1)
