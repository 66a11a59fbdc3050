"""Learning-rate schedule and weight-decay groups."""
import math

import pytest
import torch

from stability.optim import lr_factor, make_optimizer, param_groups


def test_warmup_then_cosine_to_min_ratio():
    factors = [lr_factor(s, total_steps=110, warmup_steps=10, schedule="cosine", min_ratio=0.1) for s in range(111)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_linear_decay_to_min_ratio():
    factors = [lr_factor(s, total_steps=100, warmup_steps=0, schedule="linear", min_ratio=0.2) for s in (0, 50, 100)]
    assert factors == pytest.approx([1.0, 0.6, 0.2])


def test_no_warmup_and_constant():
    assert lr_factor(0, 100, 0, "cosine", 0.0) == pytest.approx(1.0)
    assert [lr_factor(s, 100, 0, "constant", 0.0) for s in (0, 50, 99)] == [1.0, 1.0, 1.0]


def test_weight_decay_only_on_matrices():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(net.named_parameters(), 0.05)
    assert [p.shape for p in decay["params"]] == [(4, 3)] and decay["weight_decay"] == 0.05
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        make_optimizer([decay, no_decay], "lion", 1e-3, 0.9, (0.9, 0.999))


def test_a_decay_that_starts_later_and_the_exponential_one():
    """GloRo's ``decay_after_half_to_…``: constant for half of training, then geometric to min_ratio."""
    factors = [lr_factor(s, 100, 0, "exponential", 1e-3, decay_start=0.5) for s in (0, 49, 50, 75, 100)]
    assert factors[:3] == [1.0, 1.0, 1.0]
    assert factors[3] == pytest.approx(1e-3 ** 0.5) and factors[4] == pytest.approx(1e-3)
    assert lr_factor(75, 100, 0, "cosine", 0.0, decay_start=0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="min_lr_ratio > 0"):
        lr_factor(60, 100, 0, "exponential", 0.0, decay_start=0.5)


def test_fused_adam_is_kept_off_under_fp16_mixed_precision(monkeypatch):
    """With ``16-mixed`` Lightning does not unscale a fused optimizer's gradients before on_before_optimizer_step: the
    gradient norms there would carry the loss scale and gradient clipping raises. The decision, as on a GPU."""
    from types import SimpleNamespace

    import stability.optim as optim
    from stability.classifier import ImageClassifier

    on_gpu = [SimpleNamespace(is_cuda=True, is_floating_point=lambda: True)]
    assert optim.fused_allowed(on_gpu, "bf16-mixed") and optim.fused_allowed(on_gpu, "32-true")
    assert not optim.fused_allowed(on_gpu, "16-mixed") and not optim.fused_allowed(on_gpu, "16")
    assert not optim.fused_allowed([SimpleNamespace(is_cuda=False, is_floating_point=lambda: True)], None)
    seen = []
    monkeypatch.setattr(optim, "fused_allowed", lambda params, precision=None: seen.append(precision) or False)
    module = ImageClassifier()
    module.__dict__["_trainer"] = SimpleNamespace(precision="16-mixed")  # the trainer's precision reaches the decision
    module.build_optimizer()
    assert seen == ["16-mixed"]


def test_train_lr_is_the_modules_nominal_rate_as_scheduled_even_beside_muon():
    """train/lr is --model.lr times the schedule's factor — not Muon's rate, a role scale or a shape factor, which a
    parameter group's rate carries."""
    import lightning as L

    from stability.classifier import ImageClassifier
    from stability.data import Digits

    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((pl_module.global_step - 1, float(trainer.callback_metrics["train/lr"])))

    L.seed_everything(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=16, depth=1, num_heads=2), lr=3e-3,
                             warmup_epochs=0.5, stabilizer="muon",
                             stabilizer_options={"muon": {"lr": 0.02, "update_scales": {"mlp": 0.5}}})
    trainer = L.Trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, callbacks=[Record()])
    trainer.fit(module, Digits(batch_size=32))
    assert len(seen) == 8
    for step, logged in seen:
        assert logged == pytest.approx(3e-3 * lr_factor(step, 8, 2, "cosine", 0.0), rel=1e-6), (step, logged)
