"""Certified training: GloRo's ⊥ logit and its TRADES term, EMMA, the Lipschitz margin — each against a direct
computation of its definition —, the radius's schedule, the stabilizers on both certified families, and the warning
that names a constant classifier."""
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from stability.certified_training import (
    EpsilonSchedule,
    MarginBound,
    bottom_kl,
    emma_logits,
    emma_loss,
    gloro_logits,
    gloro_loss,
    linear_weight,
    margin_logits,
)
from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.metrics import ConstantClassifierWarning
from stability.stabilizers import ForwardStep

K = 5


def random_bound(seed=0, linear_head=True):
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(K, 7, generator=gen, dtype=torch.float64)
    features = torch.tensor(0.8, dtype=torch.float64)
    total = features * torch.linalg.matrix_norm(head, ord=2)
    return MarginBound(total, features, head) if linear_head else MarginBound(total)


def logits_and_labels(seed=1, batch=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, K, generator=gen, dtype=torch.float64), torch.randint(0, K, (batch,), generator=gen)


def pair(bound: MarginBound, i: int, j: int) -> float:
    """K_ij by its definition."""
    if bound.head is None:
        return 0.0 if i == j else math.sqrt(2) * float(bound.total)
    return float(bound.features) * float(torch.linalg.vector_norm(bound.head[i] - bound.head[j]))


@pytest.mark.parametrize("linear_head", [True, False])
def test_gloro_bottom_logit_is_max_over_the_other_classes_of_z_plus_eps_k(linear_head):
    bound, (z, _) = random_bound(linear_head=linear_head), logits_and_labels()
    eps = 0.3
    extended = gloro_logits(z, bound, eps)
    assert extended.shape == (len(z), K + 1)
    torch.testing.assert_close(extended[:, :K], z)
    for b in range(len(z)):
        top = int(z[b].argmax())
        expected = max(float(z[b, j]) + eps * pair(bound, top, j) for j in range(K) if j != top)
        assert float(extended[b, K]) == pytest.approx(expected, rel=1e-12)


def test_gloro_certifies_exactly_when_the_prediction_beats_bottom():
    """z_ŷ > z_⊥ ⇔ z_ŷ − z_j > ε·K_ŷj for every j ≠ ŷ: the per-pair certificate at radius ε."""
    bound, (z, _) = random_bound(), logits_and_labels(batch=64)
    eps = 0.05
    beats = gloro_logits(z, bound, eps).argmax(-1) != K
    for b in range(len(z)):
        top = int(z[b].argmax())
        certified = all(float(z[b, top] - z[b, j]) > eps * pair(bound, top, j) for j in range(K) if j != top)
        assert bool(beats[b]) == certified


def test_the_trades_term_is_the_kl_of_the_padded_clean_softmax_to_the_extended_one():
    bound, (z, _) = random_bound(), logits_and_labels()
    extended = gloro_logits(z, bound, 0.4)
    p = F.pad(z.softmax(-1), (0, 1))  # ⊥ gets 0
    q = extended.softmax(-1)
    direct = torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(bottom_kl(extended), direct, rtol=1e-10, atol=1e-12)


def test_gloro_loss_plain_trades_and_temperature():
    bound, (z, y) = random_bound(), logits_and_labels()
    eps, tau, lam = 0.2, 3.0, 1.5
    extended = gloro_logits(z, bound, eps)
    plain = F.cross_entropy(extended, y)
    torch.testing.assert_close(gloro_loss(z, y, bound, eps), plain)
    trades = F.cross_entropy(z, y) + lam * bottom_kl(extended).mean()
    torch.testing.assert_close(gloro_loss(z, y, bound, eps, trades=lam), trades)
    hot = F.cross_entropy(tau * extended, y) / tau
    torch.testing.assert_close(gloro_loss(z, y, bound, eps, temperature=tau), hot)
    soft = F.one_hot(y, K).double()  # soft labels: ⊥ receives nothing, as with hard labels
    torch.testing.assert_close(gloro_loss(z, soft, bound, eps), plain)
    # TRADES at temperature τ, written out: both softmaxes read τ·logits, the KL in full, the sum divided by τ
    p = F.pad((tau * z).softmax(-1), (0, 1))
    q = (tau * extended).softmax(-1)
    kl = torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)
    written_out = (F.cross_entropy(tau * z, y) + lam * kl.mean()) / tau
    torch.testing.assert_close(gloro_loss(z, y, bound, eps, trades=lam, temperature=tau), written_out)


def test_emma_scales_each_pair_by_its_clipped_radius_and_holds_the_scale_constant():
    bound, (z, y) = random_bound(), logits_and_labels(batch=16)
    z = z.clone().requires_grad_(True)
    eps = 0.5
    out = emma_logits(z, y, bound, eps)
    expected = z.detach().clone()
    for b in range(len(y)):
        for j in range(K):
            if j == y[b]:
                continue
            k = pair(bound, int(y[b]), j)
            scale = min(1.0, max(0.01, float(z[b, y[b]] - z[b, j]) / (eps * k)))
            expected[b, j] += scale * eps * k
    torch.testing.assert_close(out.detach(), expected, rtol=1e-12, atol=1e-12)
    # the gradient is that of CE(z + constant offsets): ∂/∂z of the scale is not taken
    loss = emma_loss(z, y, bound, eps)
    (grad,) = torch.autograd.grad(loss, z)
    constant = expected - z.detach()
    zc = z.detach().clone().requires_grad_(True)
    (reference,) = torch.autograd.grad(F.cross_entropy(zc + constant, y), zc)
    torch.testing.assert_close(grad, reference)
    with pytest.raises(ValueError, match="emma needs class labels"):
        emma_logits(z, F.one_hot(y, K).double(), bound, eps)


def test_the_lipschitz_margin_whole_and_per_pair():
    bound, (z, y) = random_bound(), logits_and_labels()
    eps = 0.25
    whole = margin_logits(z, y, bound, eps)
    pairwise = margin_logits(z, y, bound, eps, pairwise=True)
    for b in range(len(y)):
        for j in range(K):
            extra = 0.0 if j == y[b] else eps
            assert float(whole[b, j] - z[b, j]) == pytest.approx(extra * math.sqrt(2) * float(bound.total))
            assert float(pairwise[b, j] - z[b, j]) == pytest.approx(eps * pair(bound, int(y[b]), j) if extra else 0)


def test_pair_constants_keep_float64_and_reach_the_head_with_a_gradient():
    bound = random_bound()
    head = bound.head.clone().requires_grad_(True)
    constants = MarginBound(bound.total, bound.features, head).pair_constants(torch.tensor([0, 3]), K)
    assert constants.dtype == torch.float64
    constants.sum().backward()
    assert torch.isfinite(head.grad).all() and head.grad.abs().sum() > 0  # finite at the zero pair too


@pytest.mark.parametrize("ramp", ["linear", "log"])
def test_the_schedule_reaches_its_values(ramp):
    schedule = EpsilonSchedule(1.58, overshoot=1.1, ramp=ramp, ramp_start=0.1, ramp_end=0.5, start=0.01)
    final, begin = 1.1 * 1.58, 0.0158  # GloRo's [0.01]-log-[50%:1.1] at ε = 1.58: from 0.01·ε to 1.1·ε
    assert schedule.final == pytest.approx(final)
    assert schedule.at(0.0) == pytest.approx(begin) == schedule.at(0.1)
    assert schedule.at(0.5) == pytest.approx(final) == schedule.at(0.9) == schedule.at(1.0)
    assert schedule.at(None) == pytest.approx(final)
    values = [schedule.at(t / 100) for t in range(101)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))  # never decreases
    t = 0.25  # halfway through the ramp
    if ramp == "linear":
        assert schedule.at(0.3) == pytest.approx(begin + 0.5 * (final - begin))
    else:  # GloRo's log curve: log((e^end − e^start)·t + e^start)
        assert schedule.at(0.2) == pytest.approx(math.log((math.exp(final) - math.exp(begin)) * t + math.exp(begin)))
    assert EpsilonSchedule(0.5).at(0.0) == 0.5  # no ramp: the final value throughout


def test_bad_schedules_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="ramp must be one of"):
        EpsilonSchedule(0.5, ramp="cosine")
    with pytest.raises(ValueError, match="ramp_start < ramp_end"):
        EpsilonSchedule(0.5, ramp="linear", ramp_start=0.6, ramp_end=0.5)
    with pytest.raises(ValueError, match="gloro: ramp must be one of"):
        ImageClassifier(backbone="lipcnn", stabilizer="gloro", stabilizer_options={"gloro": {"ramp": "cos"}})


def test_the_trades_weight_rises_linearly():
    assert linear_weight(3.0, 0.0, True) == 0.0
    assert linear_weight(3.0, 0.5, True) == pytest.approx(1.5)
    assert linear_weight(3.0, 1.0, True) == linear_weight(3.0, 0.3, False) == linear_weight(3.0, None, True) == 3.0


def cnn_module(stabilizer="gloro", options=None, **kwargs):
    torch.manual_seed(0)
    return ImageClassifier(backbone="lipcnn", stabilizer=stabilizer, stabilizer_options=options, **kwargs)


@pytest.mark.parametrize("name", ["gloro", "emma", "lipschitz_margin"])
def test_each_loss_on_the_convolutional_anchor_reads_its_bound_as_the_definition_does(name):
    """The stabilizer's objective equals the loss function at the bound written out by hand: features 1/σ (every AOL
    layer is 1-Lipschitz), the head's weight."""
    options = {name: {"eps": 0.4, "temperature": 2.0}}
    module = cnn_module(name, options)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.network.backbone.head.weight.normal_(generator=gen)
    images, labels = torch.rand(8, 1, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    _, terms = module.losses(images, labels)
    network = module.network
    features = 1 / network.std.min()
    head = network.backbone.head.weight
    bound = MarginBound(features * torch.linalg.matrix_norm(head, ord=2), features, head)
    z = network(images)
    expected = {"gloro": lambda: gloro_loss(z, labels, bound, 0.4, temperature=2.0),
                "emma": lambda: emma_loss(z, labels, bound, 0.4, temperature=2.0),
                "lipschitz_margin": lambda: F.cross_entropy(2.0 * margin_logits(z, labels, bound, 0.4), labels) / 2.0}
    torch.testing.assert_close(terms["task"], expected[name](), rtol=1e-5, atol=1e-6)


def test_the_schedule_is_followed_during_a_fit():
    """GloRo with a linear ramp over the whole run: the radius of the last step is the final one's (steps − 1)/steps,
    the first step's the start, and λ rises with it."""
    module = cnn_module("gloro", {"gloro": {"eps": 0.5, "overshoot": 1.2, "ramp": "linear", "ramp_end": 1.0,
                                            "ramp_from": 0.0, "trades": 2.0, "trades_ramp": True}})
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stab = pl_module.stabilizers[0]
            seen.append((stab.last_eps, stab.last_trades))

    trainer = L.Trainer(max_epochs=2, limit_train_batches=5, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()])
    trainer.fit(module, Digits(batch_size=32))
    final = 1.2 * 0.5
    assert seen[0] == (0.0, 0.0)
    assert seen[-1][0] == pytest.approx(final * 9 / 10) and seen[-1][1] == pytest.approx(2.0 * 9 / 10)
    assert [e for e, _ in seen] == sorted(e for e, _ in seen)


def test_a_loss_that_collapses_the_model_into_one_class_is_named():
    """An unreachable radius (ε = 50 pixels on digits) drives the margin loss to predict one class; the run says so
    with a ConstantClassifierWarning that names the loss, and logs val/top_class_share."""
    module = cnn_module("lipschitz_margin", {"lipschitz_margin": {"eps": 50.0}}, lr=0.05)
    trainer = L.Trainer(max_epochs=2, limit_train_batches=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, Digits(batch_size=32))
    named = [w for w in caught if issubclass(w.category, ConstantClassifierWarning)]
    assert len(named) == 1 and "lipschitz_margin" in str(named[0].message), [str(w.message) for w in caught]
    assert float(trainer.callback_metrics["val/top_class_share"]) >= 0.95


def test_a_healthy_run_raises_no_collapse_warning():
    module = cnn_module("gloro", {"gloro": {"eps": 0.1}}, lr=0.01)
    trainer = L.Trainer(max_epochs=2, limit_train_batches=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, Digits(batch_size=32))
    assert not [w for w in caught if issubclass(w.category, ConstantClassifierWarning)]
    assert float(trainer.callback_metrics["val/top_class_share"]) < 0.5


def test_a_loss_stabilizer_on_a_model_without_a_bound_says_what_to_combine_it_with():
    with pytest.raises(ValueError, match="gloro needs a model with a certified Lipschitz bound"):
        ImageClassifier(stabilizer="gloro")
    with pytest.raises(ValueError, match="applies to the backbones"):
        ImageClassifier(backbone="swin", image_size=16, stabilizer="gloro")


def test_progress_is_unknown_outside_a_trainer():
    step = ForwardStep(torch.nn.Identity(), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))
    assert step.progress is None
    step.total_steps, step.global_step = 10, 4
    assert step.progress == pytest.approx(0.4)
