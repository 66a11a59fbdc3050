"""Robustness evaluation: robust ≤ clean, PGD ≤ FGSM, ε = 0 is clean accuracy, seeded, works under
Lightning's inference mode; the official AutoAttack equals pyautoattack called directly; the worst
case is at most every attack; certified accuracy is at most the empirical robust accuracy."""
import math

import lightning as L
import pytest
import torch
import torchattacks
from pyautoattack import AutoAttack
from torch import nn

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.lipschitz.certified import Bound
from stability.robustness import AttackSpec, certified_at, certified_radii, l2_radius, robust_accuracy
from stability.robustness.pgd import PGD, random_start


@pytest.fixture(scope="module")
def trained():
    L.seed_everything(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=32, depth=2, num_heads=2), lr=3e-3, scheduler="constant")
    data = Digits(batch_size=16)
    L.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, data)
    images, labels = data.val_set.tensors[0][:96], data.val_set.tensors[1][:96]
    return module.network.eval(), images, labels


@pytest.fixture(scope="module")
def linear():
    """A linear classifier of the 8×8 digits (its exact Lipschitz constant is σ₁(W)), and 32 points."""
    data = Digits()
    data.setup()
    x, y = data.train_set.tensors
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), data.val_set.tensors[0][:32], data.val_set.tensors[1][:32]


def test_sanity_of_fgsm_pgd_and_budgets(trained):
    network, images, labels = trained
    specs = [AttackSpec(name, "Linf", eps) for name in ("fgsm", "pgd") for eps in (0.0, 2 / 255, 8 / 255)]
    specs.append(AttackSpec("pgd", "L2", 0.5))
    with torch.inference_mode():  # as in Lightning's validate / test
        results = robust_accuracy(network, images, labels, specs, num_classes=10, pgd_steps=10, batch_size=40)
    clean = results["clean"]
    assert clean > 0.7
    assert results["fgsm_Linf_0/255"] == results["pgd_Linf_0/255"] == clean
    for label, value in results.items():
        assert value <= clean, label
    for eps in ("2/255", "8/255"):  # PGD (10 steps of 2.5ε/10) is no weaker than FGSM but for a point or two
        assert results[f"pgd_Linf_{eps}"] <= results[f"fgsm_Linf_{eps}"] + 2 / len(labels)
        assert results[f"worst_Linf_{eps}"] <= min(results[f"pgd_Linf_{eps}"], results[f"fgsm_Linf_{eps}"])
    assert results["pgd_Linf_8/255"] <= results["pgd_Linf_2/255"]
    assert "worst_Linf_0/255" not in results  # ε = 0 is no attack
    again = robust_accuracy(network, images, labels, specs, num_classes=10, pgd_steps=10, batch_size=40)
    assert again == results  # seeded: identical


def test_pgd_matches_torchattacks_called_directly(trained):
    network, images, labels = trained
    torch.manual_seed(5)
    direct = torchattacks.PGD(network, eps=4 / 255, alpha=1 / 255, steps=5, random_start=True)(images, labels)
    with torch.no_grad():  # robust: right as it is and after the attack
        robust = (network(direct).argmax(-1) == labels) & (network(images).argmax(-1) == labels)
    expected = float(robust.float().mean())
    ours = robust_accuracy(network, images, labels, [AttackSpec("pgd", "Linf", 4 / 255)], 10, pgd_steps=5,
                           pgd_alpha=1 / 255, seed=5)
    assert ours["pgd_Linf_4/255"] == pytest.approx(expected)


@pytest.mark.parametrize("norm", ["Linf", "L2"])
def test_our_pgd_is_torchattacks_pgd_bit_for_bit_on_the_cpu(trained, norm):
    """Same seed, same adversarial images: the start drawn from a CPU generator seeded s is what torchattacks draws from
    the global CPU generator after torch.manual_seed(s), and every step is its step."""
    network, images, labels = trained
    eps, alpha = (4 / 255, 1 / 255) if norm == "Linf" else (0.5, 0.1)
    reference = torchattacks.PGD if norm == "Linf" else torchattacks.PGDL2
    torch.manual_seed(5)
    direct = reference(network, eps=eps, alpha=alpha, steps=5, random_start=True)(images, labels)
    ours = PGD(network, norm, eps, alpha, steps=5, seed=5)(images, labels)
    assert torch.equal(ours, direct)
    assert not torch.equal(PGD(network, norm, eps, alpha, steps=5, seed=6)(images, labels), direct)


@pytest.mark.parametrize("norm", ["Linf", "L2"])
def test_pgds_random_start_is_drawn_on_the_cpu_whatever_the_global_generators(norm):
    """The start depends on the seed alone: not on the global generators (which a GPU's differ from), and it lies in the
    ε-ball and the pixel box."""
    images = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    starts = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        starts.append(random_start(images, norm, 0.3, seed=7))
    assert torch.equal(starts[0], starts[1]) and not torch.equal(starts[0], random_start(images, norm, 0.3, seed=8))
    delta = (starts[0] - images).flatten(1)
    size = delta.abs().amax(1) if norm == "Linf" else delta.norm(dim=1)
    assert float(size.max()) <= 0.3 + 1e-6 and 0 <= float(starts[0].min()) and float(starts[0].max()) <= 1


class Periodic(nn.Module):
    """Class 0's logit is sin(k·Σx) and the others 0: a step of ε in every pixel moves Σx by ±64ε, and at
    k·64ε = π a point the network gets wrong (sin < 0) can land where it gets it right."""

    def forward(self, x):
        z0 = torch.sin(torch.pi / 6.4 * x.flatten(1).sum(1, keepdim=True))
        return torch.cat([z0, torch.zeros(len(x), 9)], dim=1)


def test_a_point_the_network_gets_wrong_is_never_robust():
    """FGSM moves wrong points into the right class here; they still count as not robust (x is in its own
    ε-ball), so every robust accuracy is at most the clean one on the same points."""
    network = Periodic().eval()
    images, labels = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(64).long()
    adversarial = torchattacks.FGSM(network, eps=0.1)(images, labels)
    with torch.no_grad():
        right, right_after = network(images).argmax(-1) == labels, network(adversarial).argmax(-1) == labels
    assert (~right & right_after).any()  # the case exists
    results = robust_accuracy(network, images, labels, [AttackSpec("fgsm", "Linf", 0.1)], num_classes=10)
    assert results["fgsm_Linf_0.1"] == pytest.approx(float((right & right_after).float().mean()))
    assert results["fgsm_Linf_0.1"] <= results["clean"]


def test_autoattack_labels_say_which_one():
    assert AttackSpec("autoattack", "Linf", 8 / 255).label == "autoattack_Linf_8/255"
    assert AttackSpec("autoattack_tap", "Linf", 8 / 255).label == "autoattack_tap_Linf_8/255"
    assert AttackSpec("autoattack", "L2", 0.5).label == "autoattack_L2_0.5"


@pytest.mark.parametrize("norm, eps", [("Linf", 0.05), ("L2", 0.5)])
def test_official_autoattack_equals_pyautoattack_called_directly(linear, norm, eps):
    model, images, labels = linear
    ours = robust_accuracy(model, images, labels, [AttackSpec("autoattack", norm, eps)], 10, seed=3, batch_size=32)
    attack = AutoAttack(model, eps=eps, norm=norm, seed=3, version="standard", device="cpu")
    adversarial, _ = attack.run_standard_evaluation(images, labels, batch_size=32)
    expected = float((model(adversarial).argmax(-1) == labels).float().mean())
    assert ours[f"autoattack_{AttackSpec('autoattack', norm, eps).budget}"] == expected
    assert 0 < expected < ours["clean"]  # a budget where it breaks some points and not others
    again = robust_accuracy(model, images, labels, [AttackSpec("autoattack", norm, eps)], 10, seed=3, batch_size=32)
    assert again == ours


def test_autoattack_at_zero_is_clean_and_where_fgsm_breaks_everything_so_does_autoattack(linear):
    model, images, labels = linear
    results = robust_accuracy(model, images, labels, [AttackSpec("autoattack", "Linf", 0.0),
                                                       AttackSpec("fgsm", "Linf", 0.5),
                                                       AttackSpec("autoattack", "Linf", 0.5)], 10)
    assert results["autoattack_Linf_0/255"] == results["clean"] > 0.8
    assert results["fgsm_Linf_0.5"] == 0.0 and results["autoattack_Linf_0.5"] == 0.0


def test_official_autoattack_is_at_least_as_strong_as_pgd_and_the_worst_case_below_both(linear):
    model, images, labels = linear
    specs = [AttackSpec("pgd", "Linf", 0.05), AttackSpec("autoattack", "Linf", 0.05),
             AttackSpec("autoattack_tap", "Linf", 0.05)]
    results = robust_accuracy(model, images, labels, specs, 10)
    assert results["autoattack_Linf_0.05"] <= results["pgd_Linf_0.05"] + 1e-9
    assert results["worst_Linf_0.05"] <= min(results[s.label] for s in specs)


def test_bad_attack_names():
    with pytest.raises(ValueError, match="unknown attack 'cw'"):
        AttackSpec("cw", "Linf", 0.1)
    with pytest.raises(ValueError, match="unknown norm 'L1' for pgd"):
        AttackSpec("pgd", "L1", 0.1)
    assert AttackSpec("autoattack", "L1", 1.0).label == "autoattack_L1_1"


# ------------------------------------------------------------------------------------ certified
def test_certified_radius_of_a_linear_model_is_the_distance_to_the_nearest_class_boundary(linear):
    """For z = Wx + b with the features bound 1 and the head W, the pairwise radius is exactly
    min_j (z_y − z_j)/‖W_y − W_j‖; the plain one, margin/(√2·σ₁(W)), is smaller."""
    model, images, labels = linear
    w = model[1].weight.detach()
    with torch.no_grad():
        logits = model(images)
    plain = certified_radii(logits, labels, Bound(float(torch.linalg.matrix_norm(w, ord=2))))
    pairwise = certified_radii(logits, labels, Bound(float(torch.linalg.matrix_norm(w, ord=2)), features=1.0,
                                                     head_weight=w))
    correct = logits.argmax(-1) == labels
    for i in range(len(labels)):
        if not correct[i]:
            assert plain[i] == pairwise[i] == 0
            continue
        y = int(labels[i])
        exact = min(float((logits[i, y] - logits[i, j]) / (w[y] - w[j]).norm()) for j in range(10) if j != y)
        assert float(pairwise[i]) == pytest.approx(exact, rel=1e-6)
        assert float(plain[i]) <= float(pairwise[i]) + 1e-12


@pytest.mark.parametrize("radius", [0.1, 0.25, 0.5])
def test_certified_accuracy_is_at_most_empirical_robust_accuracy(linear, radius):
    model, images, labels = linear
    w = model[1].weight.detach()
    bound = Bound(float(torch.linalg.matrix_norm(w, ord=2)), features=1.0, head_weight=w)
    with torch.no_grad():
        radii = certified_radii(model(images), labels, bound)
    certified = float(certified_at(radii, radius).float().mean())
    results = robust_accuracy(model, images, labels, [AttackSpec("pgd", "L2", radius),
                                                       AttackSpec("autoattack", "L2", radius)], 10, pgd_steps=50)
    assert 0 < certified <= results[f"worst_L2_{radius:g}"] <= results["clean"]


def test_linf_budgets_are_certified_through_the_l2_ball_around_them():
    assert l2_radius("Linf", 2 / 255, 784) == pytest.approx(28 * 2 / 255)
    assert l2_radius("L2", 0.5, 784) == 0.5
    radii = torch.tensor([0.0, 0.3, 0.8])
    assert certified_at(radii, 0.0).tolist() == [False, True, True]
    assert certified_at(radii, math.sqrt(64) * 0.05).tolist() == [False, False, True]
