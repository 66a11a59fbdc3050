"""The `stability` command as a user runs it: fit, configs, overrides, errors, test on a checkpoint."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from stability.cli import main
from stability.stabilizers import REGISTRY


def console_script() -> list[str]:
    exe = shutil.which("stability", path=str(Path(sys.executable).parent)) or shutil.which("stability")
    return [exe] if exe else [sys.executable, "-m", "stability"]


def test_fit_through_the_console_script_learns_and_logs_to_tensorboard(tmp_path, scalars, quick_args):
    cmd = console_script() + ["fit", *quick_args, "--trainer.max_epochs", "4", "--data.batch_size", "16",
                              "--model.scheduler", "constant", "--model.lr", "3e-3", "--lipschitz.num_points", "16"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "digits" / "vit" / "none" / "version_0"
    assert list(run.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    accuracy = scalars(run, "val/acc")
    assert len(accuracy) == 4 and accuracy[-1] > 0.5, accuracy  # chance is 0.1
    assert scalars(run, "hp/val_acc")[-1] == pytest.approx(accuracy[-1])
    assert b"_hparams_/session_start_info" in next(run.glob("events.out.tfevents.*")).read_bytes()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["stabilizer"] == "none" and saved["data"]["class_path"] == "stability.data.Digits"

    checkpoint = str(run / "checkpoints" / "last.ckpt")
    test = subprocess.run(console_script() + ["test", *quick_args, "--ckpt_path", checkpoint,
                                              "--robustness.test_attacks", "[fgsm]", "--robustness.num_points", "32"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert test.returncode == 0, test.stderr[-3000:]
    assert "test/acc" in test.stdout and "test_lipschitz/local_mean" in test.stdout
    assert "test_robust/fgsm_Linf_8/255" in test.stdout  # attacks run under inference mode


def print_config(capsys, *args) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_config_file_and_dotted_overrides(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  backbone: swin\n  lr: 1.0e-3\ntrainer:\n  max_epochs: 7\n"
                      "data:\n  class_path: stability.data.Digits\n  init_args:\n    image_size: 16\n")
    printed = print_config(capsys, "--config", str(config), "--model.lr", "3e-3", "--seed_everything", "1")
    assert printed["model"]["backbone"] == "swin" and printed["model"]["lr"] == 3e-3
    assert printed["trainer"]["max_epochs"] == 7 and printed["seed_everything"] == 1
    assert printed["data"]["init_args"]["image_size"] == 16
    default = print_config(capsys)
    assert default["stabilizer"] == "none" and default["trainer"]["max_epochs"] == 30
    assert default["trainer"]["devices"] == 1  # not Lightning's "auto", which takes every GPU of a node


@pytest.mark.parametrize("name", ["vit_digits", "swin_digits", "cswin_digits", "vit_cifar10", "swin_cifar10",
                                  "cswin_cifar10"])
def test_shipped_configs_parse(name, capsys):
    config = Path(__file__).parents[1] / "configs" / f"{name}.yaml"
    printed = print_config(capsys, "--config", str(config))
    assert printed["model"]["backbone"] == name.split("_")[0]


STABILIZER_CONFIGS = sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "stabilizer").glob("*.yaml"))


@pytest.mark.parametrize("name", STABILIZER_CONFIGS)
def test_stabilizer_configs_compose_with_a_run_config(name, capsys):
    configs = Path(__file__).parents[1] / "configs"
    printed = print_config(capsys, "--config", str(configs / "vit_digits.yaml"),
                           "--config", str(configs / "stabilizer" / f"{name}.yaml"))
    selected = printed["stabilizer"] if isinstance(printed["stabilizer"], list) else [printed["stabilizer"]]
    assert set(selected) <= set(REGISTRY) - {"none"} and selected


def test_unknown_stabilizer_lists_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--stabilizer", "jasmine"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"unknown stabilizer 'jasmine'; valid names: {sorted(REGISTRY)}" in error


def test_stabilizer_options_live_in_their_own_group_and_never_carry_over(recorder, tmp_path, capsys):
    printed = print_config(capsys, "--stabilizer", "recorder", "--recorder.weight", "0.5")
    assert printed["stabilizer"] == "recorder" and printed["recorder"] == {"weight": 0.5, "bound": 3.0}
    # a config that set recorder's option, then a sweep switching to another stabilizer: refused, not carried
    config = tmp_path / "recorder.yaml"
    config.write_text("stabilizer: recorder\nrecorder:\n  weight: 0.5\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--stabilizer", "none"])
    assert exit_info.value.code == 2
    assert "set for stabilizer 'recorder', which is not selected" in capsys.readouterr().err


def test_stabilizer_options_reach_the_model_and_the_checkpoint(recorder, tmp_path, scalars, tiny_vit_args):
    os.chdir(tmp_path)
    main(["fit", *tiny_vit_args, "--stabilizer", "recorder", "--recorder.weight", "0.25",
          "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])
    run = tmp_path / "runs" / "digits" / "vit" / "recorder" / "version_0"
    assert scalars(run, "loss/recorder_epoch")
    logged = yaml.safe_load((run / "hparams.yaml").read_text())
    assert logged["stabilizer"] == "recorder" and logged["recorder.weight"] == 0.25
    # the HParams table lists the settings a user chose, not LightningCLI's own entries
    assert not [k for k in logged if k.startswith("_") or "._" in k], sorted(logged)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert saved["stabilizer"] == ["recorder"] and saved["stabilizer_options"]["recorder"]["weight"] == 0.25


def test_same_seed_same_numbers(tmp_path, scalars, tiny_vit_args):
    os.chdir(tmp_path)
    losses = []
    for runs_dir in ("a", "a", "b"):
        seed = "3" if runs_dir == "a" else "4"
        main(["fit", *tiny_vit_args, "--runs_dir", runs_dir, "--seed_everything", seed,
              "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2"])
        version = len(list((tmp_path / runs_dir / "digits" / "vit" / "none").iterdir())) - 1
        losses.append(scalars(tmp_path / runs_dir / "digits" / "vit" / "none" / f"version_{version}", "val/loss"))
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


@pytest.mark.parametrize("backbone", ["swin", "cswin"])
def test_fit_runs_every_backbone(backbone, tmp_path, quick_args):
    os.chdir(tmp_path)
    main(["fit", *quick_args, "--model.backbone", backbone, "--data.image_size", "16", "--trainer.max_epochs", "1",
          "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])
    assert list((tmp_path / "runs" / "digits" / backbone / "none" / "version_0").glob("events.out.tfevents.*"))


def test_missing_cifar_data_is_a_clear_error(tmp_path, capsys, quick_args):
    os.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *quick_args, "--data", "CIFAR10", "--data.root", str(tmp_path / "data")])
    assert exit_info.value.code == 2
    assert "--data.download true" in capsys.readouterr().err


def test_switching_data_class_does_not_carry_the_default_class_options(tmp_path, tiny_vit_args, write_cifar):
    write_cifar(tmp_path / "data", "cifar10")
    os.chdir(tmp_path)
    main(["fit", *tiny_vit_args, "--data", "CIFAR10", "--data.root", "data", "--data.batch_size", "8",
          "--trainer.max_epochs", "1", "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0"])
    saved = yaml.safe_load((tmp_path / "runs" / "cifar10" / "vit" / "none" / "version_0" / "config.yaml").read_text())
    init = saved["data"]["init_args"]
    # CIFAR10's own defaults, not Digits' (random_crop 0, no flip, val_fraction 0.15); the override still applies
    assert (init["random_crop"], init["horizontal_flip"], init["val_fraction"], init["batch_size"]) == (4, True, 0.1, 8)


def test_print_config_shows_the_chosen_data_class_defaults(tmp_path, capsys):
    printed = print_config(capsys, "--data", "CIFAR10")
    assert printed["data"]["init_args"]["random_crop"] == 4 and printed["data"]["init_args"]["val_fraction"] == 0.1
    config = tmp_path / "c100.yaml"
    config.write_text("data:\n  class_path: stability.data.CIFAR100\n")
    printed = print_config(capsys, "--config", str(config))
    assert printed["data"]["init_args"]["horizontal_flip"] is True


def test_default_root_dir_moves_the_runs_as_lightning_users_expect(tmp_path, tiny_vit_args, capsys):
    os.chdir(tmp_path)
    short = [*tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
             "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0"]
    main(["fit", *short, "--trainer.default_root_dir", "elsewhere"])
    assert (tmp_path / "elsewhere" / "digits" / "vit" / "none" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit) as exit_info:  # two places for the same thing: say so, do not pick one
        main(["fit", *short, "--trainer.default_root_dir", "a", "--runs_dir", "b"])
    assert exit_info.value.code == 2 and "--runs_dir" in capsys.readouterr().err


def test_the_best_checkpoint_is_the_epoch_with_the_best_validation_value(tmp_path, scalars, tiny_vit_args):
    """``--best_checkpoint TAG`` keeps best.ckpt from the epoch whose logged value is the best, beside last.ckpt.
    Asked for the *largest* validation loss, it must keep the first epoch while last.ckpt holds the fourth (a
    best.ckpt that is just the last epoch fails); ``--best_checkpoint_mode min`` keeps the least loss."""
    os.chdir(tmp_path)
    for mode, pick in (("max", max), ("min", min)):
        main(["fit", *tiny_vit_args, "--run_dir", mode, "--best_checkpoint", "val/loss", "--best_checkpoint_mode",
              mode, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches",
              "2"])
        losses = scalars(tmp_path / mode, "val/loss")
        best = torch.load(tmp_path / mode / "checkpoints" / "best.ckpt", weights_only=False)
        last = torch.load(tmp_path / mode / "checkpoints" / "last.ckpt", weights_only=False)
        assert len(losses) == 4 and last["epoch"] == 3
        assert best["epoch"] == losses.index(pick(losses))
        for checkpoint in (best, last):  # last.ckpt too: a resumed run goes on comparing with the true best
            state = next(v for k, v in checkpoint["callbacks"].items() if "val/loss" in k)
            assert float(state["best_model_score"]) == pytest.approx(pick(losses), rel=1e-6)
        if mode == "max":
            assert best["epoch"] == 0  # the loss falls: the largest is the first epoch's, not the last's


def test_the_best_checkpoint_follows_a_measurement_at_its_own_cadence(tmp_path, scalars, tiny_vit_args, quick_args):
    """A measurement's tag exists only at the epochs it measures (here every second one): the validations without it
    are passed over, and best.ckpt is the measured epoch with the best value; testing best.ckpt writes its own
    results_best.json beside the final weights' results.json."""
    os.chdir(tmp_path)
    main(["fit", *tiny_vit_args, "--run_dir", "run", "--best_checkpoint", "lipschitz/local_mean",
          "--best_checkpoint_mode", "min", "--lipschitz.every_n_epochs", "2", "--lipschitz.num_points", "16",
          "--lipschitz.attention", "false", "--lipschitz.iterations", "3", "--trainer.max_epochs", "4",
          "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "--test_after_fit", "true",
          "--robustness.test_attacks", "[]", "--lipschitz.test_num_points", "16", "--trainer.limit_test_batches", "2"])
    measured = scalars(tmp_path / "run", "lipschitz/local_mean")
    assert len(measured) == 2  # epochs 1 and 3
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.ckpt", weights_only=False)
    assert best["epoch"] == (1, 3)[measured.index(min(measured))]
    checkpoints = tmp_path / "run" / "checkpoints"
    final = json.loads((checkpoints / "results.json").read_text())
    main(["test", *quick_args, "--ckpt_path", str(checkpoints / "best.ckpt"), "--robustness.test_attacks", "[]",
          "--lipschitz.test_num_points", "16", "--lipschitz.attention", "false", "--lipschitz.iterations", "3",
          "--trainer.limit_test_batches", "2"])
    assert json.loads((checkpoints / "results.json").read_text()) == final
    assert (checkpoints / "results_best.json").is_file()


def test_a_finished_run_tears_its_process_group_down(monkeypatch):
    """Once a subcommand returns, ``main`` destroys the distributed process group while the interpreter is alive:
    left to the exit, gloo's threads can abort a finished DDP run (status −6, "terminate called without an active
    exception", seen in CI). One gloo process stands in for a DDP run; a main without the release leaves it up."""
    import torch.distributed as dist

    from stability import cli

    class Finished:  # a subcommand that initialised a process group and returned
        def __init__(self, args=None):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.trainer = None

    monkeypatch.setattr(cli, "StabilityCLI", Finished)
    monkeypatch.setattr(cli, "diverged", lambda trainer: None)
    try:
        main(["fit"])
        assert not dist.is_initialized()
        monkeypatch.setattr(cli, "release_process_group", lambda: None)  # the planted error: no release
        main(["fit"])
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_best_checkpoint_of_a_measurement_under_ddp(tmp_path, tiny_vit_args):
    """Two processes (CPU, gloo): the measurements log on the first only, whose value decides on both, so the fit
    saves best.ckpt and finishes (a process without the value used to raise while the other waited)."""
    done = subprocess.run(
        console_script() + ["fit", *tiny_vit_args, "--run_dir", "run", "--best_checkpoint", "lipschitz/local_mean",
                            "--best_checkpoint_mode", "min", "--lipschitz.num_points", "16", "--lipschitz.attention",
                            "false", "--lipschitz.iterations", "3", "--trainer.max_epochs", "2",
                            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
                            "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.ckpt", weights_only=False)
    assert best["epoch"] in (0, 1)
