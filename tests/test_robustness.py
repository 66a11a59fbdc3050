"""Robustness evaluation sanity: robust ≤ clean, PGD ≤ FGSM, ε = 0 is clean accuracy, seeded,
and it works under Lightning's inference mode."""
import lightning as L
import pytest
import torch
import torchattacks

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.robustness import AttackSpec, robust_accuracy


@pytest.fixture(scope="module")
def trained():
    L.seed_everything(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=32, depth=2, num_heads=2), lr=3e-3, scheduler="constant")
    data = Digits(batch_size=16)
    L.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, data)
    images, labels = data.val_set.tensors[0][:96], data.val_set.tensors[1][:96]
    return module.network.eval(), images, labels


def test_sanity_of_fgsm_pgd_and_budgets(trained):
    network, images, labels = trained
    specs = [AttackSpec(name, "Linf", eps) for name in ("fgsm", "pgd") for eps in (0.0, 2 / 255, 8 / 255)]
    specs.append(AttackSpec("pgd", "L2", 0.5))
    with torch.inference_mode():  # as in Lightning's validate / test
        results = robust_accuracy(network, images, labels, specs, num_classes=10, pgd_steps=10)
    clean = results["clean"]
    assert clean > 0.7
    assert results["fgsm_Linf_0/255"] == results["pgd_Linf_0/255"] == clean
    for label, value in results.items():
        assert value <= clean, label
    for eps in ("2/255", "8/255"):
        assert results[f"pgd_Linf_{eps}"] <= results[f"fgsm_Linf_{eps}"]
    assert results["pgd_Linf_8/255"] <= results["pgd_Linf_2/255"]
    again = robust_accuracy(network, images, labels, specs, num_classes=10, pgd_steps=10)
    assert again == results  # seeded: identical


def test_pgd_matches_torchattacks_called_directly(trained):
    network, images, labels = trained
    torch.manual_seed(5)
    direct = torchattacks.PGD(network, eps=4 / 255, alpha=1 / 255, steps=5, random_start=True)(images, labels)
    expected = float((network(direct).argmax(-1) == labels).float().mean())
    ours = robust_accuracy(network, images, labels, [AttackSpec("pgd", "Linf", 4 / 255)], 10, pgd_steps=5,
                           pgd_alpha=1 / 255, seed=5)
    assert ours["pgd_Linf_4/255"] == pytest.approx(expected)


def test_autoattack_is_labelled_as_torchattacks_and_bounded_by_pgd(trained):
    network, images, labels = trained
    spec = AttackSpec("autoattack", "Linf", 8 / 255)
    assert spec.label == "autoattack_tap_Linf_8/255"
    results = robust_accuracy(network, images[:32], labels[:32], [spec, AttackSpec("pgd", "Linf", 8 / 255)], 10)
    assert results[spec.label] <= results["pgd_Linf_8/255"] + 1e-9


def test_bad_attack_names():
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="unknown attack 'cw'"):
        robust_accuracy(net, torch.rand(2, 1, 2, 2), torch.tensor([0, 1]), [AttackSpec("cw", "Linf", 0.1)], 2)
    with pytest.raises(ValueError, match="unknown norm 'L1'"):
        robust_accuracy(net, torch.rand(2, 1, 2, 2), torch.tensor([0, 1]), [AttackSpec("pgd", "L1", 0.1)], 2)
