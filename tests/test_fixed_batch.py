"""Attacks through one batch shape, compiled (``--robustness.compile``): any number of points gets the logits and
input gradients it gets from the network itself; the compiled network compiles once per kind of forward, whatever
sizes an attack leaves; FGSM, PGD and the official AutoAttack give the same points as eager, without AutoAttack's
dynamic-defence warning; the monitor's results equal the eager run's."""
import json
import os

import lightning as L
import pytest
import torch
from pyautoattack import AutoAttack, checks

from stability.callbacks.measuring import seconds_per_point
from stability.classifier import ImageClassifier
from stability.cli import main
from stability.data import Digits
from stability.robustness import AttackSpec
from stability.robustness.attacks import AttackSettings, evaluating, gradients_allowed, survivors
from stability.robustness.fixed_batch import FixedBatch, attacked_network, paid_points


@pytest.fixture(scope="module")
def digits():
    data = Digits()
    data.setup()
    return data


@pytest.fixture(scope="module")
def vit(digits):
    """A tiny ViT trained briefly on the 8 × 8 digits: points near its decision boundaries for the attacks."""
    L.seed_everything(0)
    network = ImageClassifier(backbone_options=dict(embed_dim=32, depth=1, num_heads=2)).network
    images, labels = digits.train_set.tensors
    optimizer = torch.optim.Adam(network.parameters(), lr=3e-3)
    for step in range(300):
        batch = slice(64 * step % 1280, 64 * step % 1280 + 64)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(network(images[batch]), labels[batch]).backward()
        optimizer.step()
    return network.eval()


@pytest.mark.parametrize("points", [1, 5, 8, 13, 17])
def test_any_number_of_points_gets_its_own_logits_and_gradients(vit, points):
    network = vit.double()
    try:
        padded = FixedBatch(network, 8)
        x = torch.rand(points, 1, 8, 8, dtype=torch.float64, requires_grad=True)
        expected = network(x)
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
        got = padded(x)
        (grad,) = torch.autograd.grad(got.square().sum(), x)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    finally:
        network.float()


def test_paid_points_round_up_to_whole_batches(vit):
    assert paid_points(20, vit) == 20
    assert paid_points(20, FixedBatch(vit, 8)) == 24
    assert paid_points(16, FixedBatch(vit, 8)) == 16
    assert attacked_network(vit, 8, compile=False) is vit
    with pytest.raises(ValueError, match="batch_size >= 1"):
        FixedBatch(vit, 0)


def test_compiled_once_per_kind_of_forward_before_the_first_attack(vit, counted):
    """Its first call compiles all three graphs (no gradient; the weights'; the input's), so nothing compiles inside
    an attack — AutoAttack's dynamic-defence check would count it — whatever sizes the attacks leave."""
    compiled = attacked_network(vit, 8, compile=True)
    settings = AttackSettings(10, 3, None, "standard", 0)
    images, labels = torch.rand(13, 1, 8, 8), torch.randint(0, 10, (13,))
    with torch.no_grad():
        compiled(images[:3])
    assert counted.frame_count == 3
    short_autoattack(compiled, images[:5], labels[:5])
    for size in (3, 8, 13):
        survivors(compiled, images[:size], labels[:size], AttackSpec("pgd", "Linf", 8 / 255), settings, 1)
        survivors(compiled, images[:size], labels[:size], AttackSpec("fgsm", "L2", 0.5), settings, 2)
    seconds_per_point(compiled, images[:5], labels[:5])
    assert counted.frame_count == 3


def test_the_wrapper_leaves_the_network_in_its_mode(vit):
    """A new module starts in train mode: the measurements' eval-and-restore must give the network back in eval."""
    assert not vit.training
    with evaluating(FixedBatch(vit, 8)):
        pass
    assert not vit.training


def short_autoattack(network, images, labels):
    """The official AutoAttack's four attacks at a few iterations each (its standard version takes a minute here)."""
    attack = AutoAttack(network, norm="L2", eps=0.3, version="custom", attacks=["apgd-ce", "apgd-t", "fab-t", "square"],
                        seed=0, device=images.device)
    attack.apgd.n_iter = attack.apgd_targeted.n_iter = attack.fab.n_iter = 8
    attack.apgd_targeted.n_target_classes = attack.fab.n_target_classes = 2
    attack.square.n_queries = 40
    with gradients_allowed(), evaluating(network):
        return attack.run_standard_evaluation(images.clone(), labels.clone(), batch_size=len(labels))[0]


def test_compiled_attacks_find_what_eager_ones_find(vit, digits, counted):
    """Same seeds, same points: FGSM and PGD (batch 8, points 13: the second batch padded) through the compiled network
    leave the same points standing as on the network itself; the official AutoAttack's four attacks (5 points,
    padded) find the same adversarial images to float32 rounding; the logits agree to it. AutoAttack's check for
    dynamic defences counts nothing (its counter is global and never reset: one count would warn at every later run
    in the process)."""
    images, labels = (t[:13] for t in digits.val_set.tensors)
    with torch.no_grad():
        assert (vit(images).argmax(-1) == labels).float().mean() > 0.5
    settings = AttackSettings(10, 5, None, "standard", 0)
    compiled = attacked_network(vit, 8, compile=True)
    before = dict(checks.funcs)
    for spec in (AttackSpec("fgsm", "Linf", 8 / 255), AttackSpec("pgd", "L2", 0.3)):
        eager = torch.cat([survivors(vit, images[i:j], labels[i:j], spec, settings, b)
                           for b, (i, j) in enumerate(((0, 8), (8, 13)))])
        through = torch.cat([survivors(compiled, images[i:j], labels[i:j], spec, settings, b)
                             for b, (i, j) in enumerate(((0, 8), (8, 13)))])
        assert through.tolist() == eager.tolist(), spec.label
    eager, through = (short_autoattack(net, images[2:7], labels[2:7]) for net in (vit, compiled))
    assert (eager != images[2:7]).any()  # it moved points
    torch.testing.assert_close(through, eager, rtol=0, atol=1e-5)
    assert dict(checks.funcs) == before
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), vit(images), rtol=1e-5, atol=1e-6)


def test_the_monitor_compiled_reports_what_it_reports_eager(tmp_path, tiny_vit_args, counted):
    """One fit, then its test: FGSM and PGD on 20 points in batches of 8 (the last padded), compiled and not."""
    os.chdir(tmp_path)
    results, saved = {}, {}
    for compile in ("false", "true"):
        main(["fit", *tiny_vit_args, "--runs_dir", compile, "--trainer.max_epochs", "4", "--data.batch_size", "16",
              "--model.lr", "5e-3", "--lipschitz.every_n_epochs", "0", "--test_after_fit", "true",
              "--robustness.every_n_epochs", "4",
              "--robustness.num_points", "20", "--robustness.test_num_points", "20", "--robustness.batch_size", "8",
              "--robustness.test_attacks", "[fgsm, pgd]", "--robustness.eps", "[0.02, 0.05]",
              "--robustness.pgd_steps", "3", "--robustness.autoattack_batch_size", "4",  # no AutoAttack here
              "--robustness.compile", compile])
        (path,) = (tmp_path / compile).rglob("results.json")
        saved[compile] = json.loads(path.read_text())["robustness"]
        results[compile] = saved[compile]["accuracy"]
    assert counted.frame_count >= 1  # the compiled run did compile
    eager, compiled = results["false"], results["true"]
    assert eager["clean"] > 0.2 and eager["pgd_Linf_0.05"] < eager["clean"]  # above chance; the attacks had work
    assert compiled == eager
    assert saved["true"]["compiled"] is True and saved["false"]["compiled"] is False


def test_inductor_compiled_pgd_finds_what_eager_pgd_finds(digits):
    """The default backend's kernels (inductor), on a small MaxMin network: the same points survive PGD."""
    from stability.nn.lipschitz_blocks import MaxMin

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), MaxMin(), torch.nn.Linear(32, 10))
    images, labels = digits.train_set.tensors
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-2)
    for _ in range(100):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(network(images[:512]), labels[:512]).backward()
        optimizer.step()
    network.eval()
    images, labels = (t[:24] for t in digits.val_set.tensors)
    settings = AttackSettings(10, 5, None, "standard", 0)
    torch._dynamo.reset()
    try:
        check_inductor_pgd(network, images, labels, settings)
    finally:
        torch._dynamo.reset()


def check_inductor_pgd(network, images, labels, settings):
    compiled = attacked_network(network, 16, compile=True)
    spec = AttackSpec("pgd", "L2", 0.5)
    eager = [survivors(network, images[i:i + 16], labels[i:i + 16], spec, settings, b) for b, i in enumerate((0, 16))]
    through = [survivors(compiled, images[i:i + 16], labels[i:i + 16], spec, settings, b)
               for b, i in enumerate((0, 16))]
    eager, through = torch.cat(eager), torch.cat(through)
    assert eager.any() and not eager.all()  # a budget where some points fall and some stand
    assert through.tolist() == eager.tolist()
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), network(images), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_a_gpu_compiled_attacks_and_autoattack_match_eager(vit, digits):
    """CUDA, inductor's kernels: PGD leaves the same points standing and AutoAttack's four attacks (short) find the
    same adversarial images to float32 rounding, 13 points in batches of 8 (the second padded), and the
    dynamic-defence counter stays at zero."""
    import copy

    network = copy.deepcopy(vit).cuda()
    images, labels = (t[:13].cuda() for t in digits.val_set.tensors)
    settings = AttackSettings(10, 5, None, "standard", 0)
    torch._dynamo.reset()
    compiled = attacked_network(network, 8, compile=True)
    before = dict(checks.funcs)
    spec = AttackSpec("pgd", "L2", 0.3)
    for b, (i, j) in enumerate(((0, 8), (8, 13))):
        eager = survivors(network, images[i:j], labels[i:j], spec, settings, b)
        assert survivors(compiled, images[i:j], labels[i:j], spec, settings, b).tolist() == eager.tolist()
    eager, through = (short_autoattack(net, images[2:7], labels[2:7]) for net in (network, compiled))
    torch.testing.assert_close(through, eager, rtol=0, atol=1e-4)
    assert dict(checks.funcs) == before
    torch._dynamo.reset()


def test_every_compiled_call_runs_frozen_so_wrappers_sharing_graphs_never_mix_the_weights_states(vit, digits,
                                                                                                  counted):
    """torch does not recompile when a weight's requires_grad changes, and wrappers of one network at one size share
    its graphs: a graph compiled frozen (a Lipschitz pass) then serves the AutoAttack plan's timed pass, and one
    compiled unfrozen would serve the attacks. Every compiled call is frozen, so the plan's pass runs (it failed:
    "One of the differentiated Tensors appears to not have been used in the graph"), the weights need their gradients
    again after each call, and the attacks leave no gradient on them."""
    from stability.robustness.autoattack_cost import network_pass_seconds

    vit.zero_grad(set_to_none=True)  # (the fixture's training left gradients)
    images, labels = correct_points(vit, digits)
    first, second = FixedBatch(vit, 8, compile=True), FixedBatch(vit, 8, compile=True)
    with gradients_allowed(), evaluating(first):
        first(images.clone().requires_grad_(True)).sum().backward()
    assert all(p.requires_grad and p.grad is None for p in vit.parameters())
    timed = network_pass_seconds(second, images, labels)
    assert all(t > 0 for t in timed) and all(p.requires_grad for p in vit.parameters())
    settings = AttackSettings(10, 2, None, "standard", 0)
    survivors(second, images, labels, AttackSpec("autoattack", "Linf", 8 / 255), settings)
    assert all(p.grad is None for p in vit.parameters())  # FAB's backward() no longer reaches them


def correct_points(vit, digits, count: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Points the network classifies correctly: the ones an attack works on."""
    images, labels = digits.train_set.tensors
    with torch.no_grad():
        right = vit.eval()(images).argmax(-1) == labels
    return images[right][:count], labels[right][:count]


def test_an_attack_leaves_no_gradient_on_the_weights(vit, digits):
    """Eager too: the official AutoAttack calls backward(), which used to accumulate every weight's gradient."""
    vit.zero_grad(set_to_none=True)  # (the fixture's training left gradients)
    images, labels = correct_points(vit, digits)
    survivors(vit, images, labels, AttackSpec("autoattack", "Linf", 8 / 255), AttackSettings(10, 2, None))
    assert all(p.grad is None and p.requires_grad for p in vit.parameters())
