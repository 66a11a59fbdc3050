"""Callbacks: divergence is a result with an exit status, monitors log what they say."""
import json
import math
import os

import pytest
import torch

from stability import exit_codes
from stability.callbacks import DivergenceDetector, DivergenceMonitor, LipschitzMonitor, RobustnessMonitor
from stability.cli import main
from stability.stabilizers import REGISTRY, Stabilizer


def test_detector_counts_spikes_and_flags_divergence():
    detector = DivergenceDetector(spike_factor=3, divergence_factor=100, beta=0.5, warmup_steps=2)
    for step, loss in enumerate([1.0, 1.0, 1.0, 4.0, 1.0]):
        assert not detector.update(loss, step)
    assert detector.spikes == 1
    assert detector.update(1e4, 5) and detector.diverged_at_step == 5 and "running loss" in detector.reason
    fresh = DivergenceDetector()
    assert fresh.update(math.nan, 7) and fresh.diverged_at_step == 7 and "non-finite" in fresh.reason
    late = DivergenceDetector(warmup_steps=0)  # a loss near zero: noise is neither a spike nor divergence
    for step, loss in enumerate([1e-3] * 10 + [0.25, 1e-3]):
        assert not late.update(loss, step)
    assert late.spikes == 0


def test_a_loss_that_climbs_slowly_enough_for_the_running_value_to_follow_is_still_divergence():
    # ×1.5 a step: the running value (β = 0.9) trails the loss by a factor ≈ 4, never 100; against the loss at
    # initialisation it is caught.
    detector = DivergenceDetector()
    losses = [2.3] * 5 + [2.3 * 1.5 ** k for k in range(1, 60)]  # the initial loss: the first, 2.3
    fired = next(step for step, loss in enumerate(losses) if detector.update(loss, step))
    assert "initial loss" in detector.reason
    assert 100 * 2.3 < losses[fired] <= 1.5 * 100 * 2.3  # the first loss above 100 × the initial 2.3
    # the running value alone would not have fired: loss / running stays far below 100
    running = DivergenceDetector(warmup_steps=10**9)
    for step, loss in enumerate(losses[:fired + 1]):
        running.update(loss, step)
    assert losses[fired] / running.running < 10


def test_the_initial_loss_travels_with_checkpoints():
    monitor = DivergenceMonitor()
    for step, loss in enumerate([2.3] * 8):
        monitor.detector.update(loss, step)
    state = monitor.state_dict()
    assert state["initial"] == pytest.approx(2.3)
    resumed = DivergenceMonitor()
    resumed.load_state_dict({**state, "running": 1000.0})  # mid-climb: only the initial loss can judge 500
    assert resumed.detector.update(500.0, 9) and "initial loss 2.3" in resumed.detector.reason
    legacy = DivergenceMonitor()
    legacy.load_state_dict({"running": 2.3, "steps": 8, "spikes": 0})  # a checkpoint from before `initial`
    assert not legacy.detector.update(2.4, 9) and legacy.detector.initial == 2.4  # judged from the first loss seen


def test_an_explosion_during_the_first_steps_is_judged_against_the_loss_at_initialisation():
    # 2.3 at init, 10³ by step 3, the running value takes it in (a LipsFormer at lr 0.1 went to 1,286 by step 9, one
    # at 0.3 to 10²³, and both finished "completed" when only the running value judged)
    detector = DivergenceDetector()
    fired = next(step for step, loss in enumerate([2.3, 40.0, 300.0, 1000.0, 1300.0, 1200.0, 1286.0, 900.0])
                 if detector.update(loss, step))
    assert fired == 5 and "initial loss 2.3" in detector.reason  # the first step judged, after 5 warmup losses


class NaNAt(Stabilizer):
    """Test stabilizer: its loss term turns NaN at a given step."""

    name = "nan_at"

    def __init__(self, step: int = 6):
        self.step = step

    def loss(self, step):
        return torch.tensor(math.nan) if step.global_step >= self.step else None


def test_a_diverged_run_stops_cleanly_keeps_its_files_and_exits_with_its_status(monkeypatch, tmp_path, capsys,
                                                                                 scalars, tiny_vit_args):
    monkeypatch.setitem(REGISTRY, "nan_at", NaNAt)
    os.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_vit_args, "--stabilizer", "nan_at", "--nan_at.step", "6", "--trainer.max_epochs", "3",
              "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0"])
    assert exit_info.value.code == exit_codes.DIVERGED
    assert "diverged at step 6: non-finite loss" in capsys.readouterr().err
    run = tmp_path / "runs" / "digits" / "vit" / "nan_at" / "version_0"
    assert json.loads((run / "diverged.json").read_text()) == {"diverged_at_step": 6, "reason": "non-finite loss (nan)"}
    assert scalars(run, "hp/diverged_at_step")[-1] == 6 and (run / "config.yaml").is_file()


def test_monitors_log_during_fit(tmp_path, scalars, tiny_vit_args, caplog):
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4",
          "--lipschitz.num_points", "8", "--lipschitz.exclude_patch_embed", "true", "--robustness.every_n_epochs", "2",
          "--robustness.num_points", "16", "--robustness.pgd_steps", "2", "--stability.log_every_n_steps", "1",
          "--trainer.log_every_n_steps", "1"])
    run = tmp_path / "runs" / "digits" / "vit" / "none" / "version_0"
    local, lower = scalars(run, "lipschitz/local_max"), scalars(run, "lipschitz/lower_bound_max")
    assert len(local) == 2 and all(v > 0 for v in local + lower)
    assert scalars(run, "lipschitz/local_noembed_mean") and scalars(run, "weights/sigma/backbone.head")
    assert scalars(run, "attention/blocks.0.attn/g1_mean") and scalars(run, "attention/blocks.0.attn/entropy")
    with pytest.raises(KeyError):  # per-head scalars only with --lipschitz.per_head true
        scalars(run, "attention/blocks.0.attn/g1_mean_h1")
    assert len(scalars(run, "robust/pgd_Linf_8/255")) == 1  # every 2 epochs
    assert scalars(run, "robust/pgd_Linf_8/255")[0] <= scalars(run, "robust/clean")[0]
    assert scalars(run, "stability/grad_norm") and scalars(run, "stability/act_max/blocks.0")
    shares = [r.getMessage() for r in caplog.records if "of this epoch's training (" in r.getMessage()]
    assert sum(m.startswith("lipschitz (fit): measurements") for m in shares) == 2  # every epoch
    assert sum(m.startswith("robustness (fit): measurements") for m in shares) == 1  # every 2 epochs
    said = [r.getMessage() for r in caplog.records]
    assert sum("lipschitz (fit): local Lipschitz estimates (exact) on 8 points in" in m for m in said) == 2  # auto


def test_the_monitors_local_estimate_is_the_exact_norm_by_default_and_power_iteration_when_asked():
    from stability.classifier import ImageClassifier
    from stability.lipschitz import jacobian_norm

    torch.manual_seed(0)
    network = ImageClassifier(backbone="vit", image_size=8, backbone_options=dict(embed_dim=16, depth=1, num_heads=2)
                              ).network.eval()
    images = torch.rand(4, 1, 8, 8)
    exact = jacobian_norm(network, images, method="exact")
    measured = LipschitzMonitor(iterations=5, lower_bound=False).measure_points(network, 7, images)["local"]
    assert torch.equal(measured, exact)  # 10 logits <= 2 * 5 iterations
    power = LipschitzMonitor(iterations=2, method="power", lower_bound=False).measure_points(network, 7, images)
    torch.testing.assert_close(power["local"], jacobian_norm(network, images, 2, seed=7), rtol=0, atol=0)
    assert not torch.allclose(power["local"], exact, rtol=1e-4, atol=0)
    assert (power["local"] <= exact * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match=r"method must be one of \['power', 'exact', 'auto'\], got 'svd'"):
        LipschitzMonitor(method="svd")


def test_the_measurements_say_their_share_of_an_epoch_and_warn_once_above_a_tenth_when_unbounded(caplog):
    from stability.callbacks.measuring import EpochShare

    caplog.set_level("INFO")
    now = iter([0.0, 20.0, 100.0, 120.0, 200.0, 220.0])
    share = EpochShare("--lipschitz.num_points", limit=0, clock=lambda: next(now))
    assert share.report("lipschitz (fit)", 1.0) is None  # no epoch timed yet: nothing said
    share.epoch_started()
    share.validation_started()  # 20 s of training
    assert share.report("lipschitz (fit)", 1.0) == pytest.approx(0.05)
    share.epoch_started()
    share.validation_started()
    with pytest.warns(UserWarning, match=r"take 25% of an epoch's training time .* --lipschitz.num_points"):
        assert share.report("lipschitz (fit)", 5.0) == pytest.approx(0.25)
    share.epoch_started()
    share.validation_started()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run: no second warning
        assert share.report("lipschitz (fit)", 5.0) == pytest.approx(0.25)
    said = [r.getMessage() for r in caplog.records if "of this epoch's training" in r.getMessage()]
    assert said[0] == "lipschitz (fit): measurements 1 s, 5% of this epoch's training (20 s)"


def test_measurements_above_their_share_skip_the_validations_that_keep_them_within_it(caplog):
    """max_share 10%: a measurement that costs 35% of its epoch's training skips the next three due validations
    (one in four: 8.75% of the training time), then measures again and re-plans from its own share; measured every
    second epoch, the skips count in due validations; the share is the one ``agree`` gives (rank 0's in DDP)."""
    from stability.callbacks.measuring import EpochShare

    caplog.set_level("INFO")
    share = EpochShare("--lipschitz.num_points", limit=0.1, clock=lambda: 0.0)
    share.training = 20.0
    assert share.due(0)
    assert share.report("lipschitz (fit)", 7.0, epoch=0) == pytest.approx(0.35)
    assert [share.due(e) for e in range(6)] == [False, False, False, False, True, True]
    assert "next measured at epoch 5 (one due validation in 4" in caplog.text
    share.training = 20.0
    assert share.report("lipschitz (fit)", 1.0, epoch=4) == pytest.approx(0.05)  # within: the next one is due
    assert share.due(5)
    share.training = 20.0
    share.report("lipschitz (fit)", 3.0, epoch=5, every_n_epochs=2, agree=lambda s: 2 * s)  # rank 0's: 30%
    assert [share.due(e) for e in range(6, 13)] == [False] * 5 + [True, True]  # epoch 11: 3 due validations on
    unbounded = EpochShare("--lipschitz.num_points", limit=0, clock=lambda: 0.0)
    unbounded.training = 1.0
    with pytest.warns(UserWarning):
        unbounded.report("lipschitz (fit)", 5.0, epoch=0)
    assert unbounded.due(1)
    with pytest.raises(ValueError, match="max_share must be >= 0"):
        EpochShare("--x", limit=-0.1)
    fresh = EpochShare("--x")  # the schedule itself: every second epoch (1 and 3, 0-based), none with 0
    assert [fresh.due(e, 2) for e in range(4)] == [False, True, False, True] and not fresh.due(0, 0)


def test_a_fit_skips_the_validations_that_would_pass_the_measurements_share(tmp_path, scalars, tiny_vit_args, caplog):
    """A fit whose measurements cost more than ``max_share`` of an epoch's training (a bound of 0.01% here: passed at
    once) measures its first validation, then skips as many as the bound asks, and says so; the robustness monitor's
    plan line names the bound."""
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "2",
          "--lipschitz.num_points", "8", "--lipschitz.attention", "false", "--lipschitz.max_share", "0.0001",
          "--robustness.every_n_epochs", "1", "--robustness.num_points", "8", "--robustness.attacks", "[fgsm]",
          "--robustness.max_share", "0.0001", "--robustness.test_attacks", "[]"])
    run = tmp_path / "runs" / "digits" / "vit" / "none" / "version_0"
    assert len(scalars(run, "lipschitz/local_max")) == 1 and len(scalars(run, "robust/fgsm_Linf_8/255")) == 1
    assert "lipschitz (fit): next measured at epoch" in caplog.text
    assert "during fit at most 0.01% of an epoch's training (--robustness.max_share)" in caplog.text
    # resumed for two more epochs: the checkpoint carries the schedule, so the resumed run skips them too (without
    # it, the first resumed validation would be measured again)
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "5", "--trainer.limit_train_batches", "2",
          "--lipschitz.num_points", "8", "--lipschitz.attention", "false", "--lipschitz.max_share", "0.0001",
          "--robustness.every_n_epochs", "1", "--robustness.num_points", "8", "--robustness.attacks", "[fgsm]",
          "--robustness.max_share", "0.0001", "--robustness.test_attacks", "[]",
          "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert [p.name for p in run.parent.iterdir()] == ["version_0"] and len(scalars(run, "val/acc")) == 5
    assert len(scalars(run, "lipschitz/local_max")) == 1 and len(scalars(run, "robust/fgsm_Linf_8/255")) == 1
    # resumed again without the bound (max_share 0: every due validation), the saved schedule no longer applies
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "6", "--trainer.limit_train_batches", "2",
          "--lipschitz.num_points", "8", "--lipschitz.attention", "false", "--lipschitz.max_share", "0",
          "--robustness.every_n_epochs", "1", "--robustness.num_points", "8", "--robustness.attacks", "[fgsm]",
          "--robustness.max_share", "0", "--robustness.test_attacks", "[]",
          "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert len(scalars(run, "lipschitz/local_max")) == 2 and len(scalars(run, "robust/fgsm_Linf_8/255")) == 2


def test_monitor_options_are_checked():
    with pytest.raises(ValueError, match="unknown attack 'cw'"):
        RobustnessMonitor(attacks=("cw",))
    with pytest.raises(ValueError, match="autoattack_batch_size must be >= 1, .memory. .* or None"):
        RobustnessMonitor(autoattack_batch_size=0)
    with pytest.raises(ValueError, match="every_n_epochs >= 0"):
        LipschitzMonitor(every_n_epochs=-1)
    with pytest.raises(ValueError, match="spike_factor < divergence_factor"):
        DivergenceMonitor(spike_factor=5, divergence_factor=2)


def test_measuring_does_not_change_the_run_it_measures(tmp_path, scalars, tiny_vit_args):
    os.chdir(tmp_path)
    losses = []
    for runs_dir, every in (("on", "1"), ("off", "0")):
        main(["fit", *tiny_vit_args, "--runs_dir", runs_dir, "--trainer.max_epochs", "3",
              "--trainer.limit_train_batches", "4", "--lipschitz.every_n_epochs", every, "--lipschitz.num_points", "8",
              "--robustness.every_n_epochs", every, "--robustness.num_points", "8", "--robustness.pgd_steps", "2"])
        losses.append(scalars(tmp_path / runs_dir / "digits" / "vit" / "none" / "version_0", "val/loss"))
    assert losses[0] == losses[1]


def test_a_regulariser_that_makes_the_total_loss_negative_is_not_divergence(tmp_path, scalars, tiny_vit_args):
    os.chdir(tmp_path)  # λ·Σ log g1 < 0: the total is negative from the first step
    main(["fit", *tiny_vit_args, "--stabilizer", "jasmin", "--jasmin.lam", "1.0", "--jasmin.k", "0",
          "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "12", "--lipschitz.every_n_epochs", "0",
          "--robustness.every_n_epochs", "0"])
    run = tmp_path / "runs" / "digits" / "vit" / "jasmin" / "version_0"
    assert scalars(run, "train/loss_epoch")[0] < 0 and not (run / "diverged.json").exists()


def test_monitors_skip_a_model_whose_weights_are_no_longer_finite(tmp_path, tiny_vit_args):
    """A run that diverges mid-epoch still validates at the epoch's end: the monitors must not crash
    on its NaN weights (an SVD of them raises), so the run ends as 'diverged', not as an error."""
    os.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_vit_args, "--model.optimizer", "sgd", "--model.lr", "1e5", "--trainer.max_epochs", "2",
              "--lipschitz.num_points", "8", "--robustness.every_n_epochs", "1", "--robustness.num_points", "8"])
    assert exit_info.value.code == exit_codes.DIVERGED
    run = tmp_path / "runs" / "digits" / "vit" / "none" / "version_0"
    assert (run / "diverged.json").is_file()


def test_stabilizers_report_their_signals_at_the_logging_steps(tmp_path, scalars, tiny_vit_args):
    os.chdir(tmp_path)
    main(["fit", *tiny_vit_args, "--stabilizer", "spectral_norm", "--trainer.max_epochs", "1",
          "--trainer.limit_train_batches", "4", "--stability.log_every_n_steps", "2",
          "--trainer.log_every_n_steps", "2", "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0"])
    run = tmp_path / "runs" / "digits" / "vit" / "spectral_norm" / "version_0"
    assert scalars(run, "stability/spectral_norm/excess") == [0.0, 0.0]  # steps 2 and 4; no check has run yet
    assert len(scalars(run, "stability/grad_norm")) == 2 and len(scalars(run, "train/lr")) == 2
