"""Long measurements a user can see, stop and resume: `stability test` says what it will run and for how long, writes
one line per measurement, stops within seconds of SIGTERM mid-AutoAttack with exit status 143 and a partial
results.json, and, rerun, resumes from the points already attacked to the numbers of an uninterrupted run; the
checkpoint's data module takes overrides without its class restated."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
TINY = ["--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"]
AUTOATTACK = ["--robustness.test_attacks", "[autoattack]", "--robustness.autoattack_num_points", "48",
              "--robustness.batch_size", "48", "--robustness.autoattack_batch_size", "16",
              "--lipschitz.every_n_epochs", "0"]  # AutoAttack's own batches: a SIGTERM in the second keeps the first


def command() -> list[str]:
    exe = shutil.which("stability", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "stability"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command() + list(args), cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("long")
    run("fit", *QUIET, *TINY, "--trainer.max_epochs", "2", "--lipschitz.every_n_epochs", "0",
        "--robustness.every_n_epochs", "0", cwd=root)
    return root / "runs" / "digits" / "vit" / "none" / "version_0" / "checkpoints" / "last.ckpt"


def seconds_in(text: str) -> float:
    """The seconds of a duration as format_seconds writes it at the start of ``text``: "42 s", "3 min 5 s",
    "2 h 4 min"."""
    import re

    match = re.match(r"(?:(\d+) h )?(?:(\d+) min)?\s*(?:(\d+) s)?", text.strip())
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return 3600 * hours + 60 * minutes + seconds


def copy_of(checkpoint: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    return Path(shutil.copy(checkpoint, where / "last.ckpt"))


def test_sigterm_mid_autoattack_stops_within_seconds_and_a_rerun_resumes(checkpoint, tmp_path):
    stopped = copy_of(checkpoint, tmp_path / "stopped")
    process = subprocess.Popen(command() + ["test", "--ckpt_path", str(stopped), *QUIET, *AUTOATTACK],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("autoattack_Linf_2/255 on 48 points — at most ≈" in line for line in lines):  # the plan line
        assert process.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)
    kept_batches = stopped.parent / "measurements"
    while not list(kept_batches.glob("*/autoattack*.batch0.pt")):  # one AutoAttack batch done: into the second
        assert process.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.1)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=120)
    took = time.time() - sent
    reader.join(timeout=5)
    said = "".join(lines)
    assert status == 143, said[-3000:]
    assert took < 15, (took, said[-2000:])  # within seconds: the next forward pass checks the flag
    partial = json.loads((stopped.parent / "results.json").read_text())
    assert partial["complete"] is False and "stopped by SIGTERM" in partial["robustness"]["interrupted"]
    attacked = partial["robustness"].get("attacks", {}).get("autoattack_Linf_2/255", {}).get("points", 0)
    assert attacked % 16 == 0 and 16 <= attacked < 48  # whole AutoAttack batches, with their number of points
    kept = list((stopped.parent / "measurements").glob("*/*.pt"))
    assert kept  # the clean pass at least: a rerun starts from there
    # the rerun resumes and ends with the numbers of an uninterrupted run
    resumed = run("test", "--ckpt_path", str(stopped), *QUIET, *AUTOATTACK, cwd=tmp_path)
    said_again = resumed.stderr + resumed.stdout
    assert any("autoattack_Linf_2/255 on 48 points" in line and "kept from an interrupted run" in line
               for line in said_again.splitlines()), said_again[-2000:]
    whole = copy_of(checkpoint, tmp_path / "whole")
    said = run("test", "--ckpt_path", str(whole), *QUIET, *AUTOATTACK, cwd=tmp_path)
    lines = (said.stdout + said.stderr).splitlines()
    plan = next(line for line in lines if "autoattack_Linf_2/255 on 48 points — at most ≈" in line)
    took = next(line for line in lines if "autoattack_Linf_2/255 on 48 points in " in line)
    bound, taken = seconds_in(plan.split("at most ≈ ")[1]), seconds_in(took.split(" points in ")[1])
    assert taken <= bound, (plan, took)  # the plan line is an upper bound
    first, second = (json.loads((p.parent / "results.json").read_text()) for p in (stopped, whole))
    assert first["complete"] and first["robustness"]["accuracy"] == second["robustness"]["accuracy"]
    assert first["robustness"]["attacks"] == second["robustness"]["attacks"]
    assert not (stopped.parent / "measurements").exists()  # removed once the whole test is measured


def test_a_test_says_what_it_runs_for_how_long_and_one_line_per_measurement(checkpoint, tmp_path):
    copied = copy_of(checkpoint, tmp_path / "said")
    done = run("test", "--ckpt_path", str(copied), *QUIET, "--robustness.test_attacks", "[fgsm, pgd]",
               "--lipschitz.iterations", "2", "--lipschitz.attention_points", "8", cwd=tmp_path)
    said = done.stdout + done.stderr
    plan = [line for line in said.splitlines() if "points — at most ≈" in line]
    assert len(plan) == 1 and "--robustness.autoattack_num_points" in plan[0] and "on 270" in plan[0]
    for measurement in ("clean", "fgsm_Linf_8/255", "pgd_Linf_2/255",
                        "local Lipschitz estimates (power)",  # auto: 10 logits > 2 × 2 iterations
                        "attention diagnostics"):
        assert any(f": {measurement} on " in line and "points/s" in line for line in said.splitlines()), measurement
    assert "%|" not in said  # no bars with the progress bar off
    assert "dirpath has changed" not in said and "checkpoint directory" not in said.lower()
    assert "callbacks used to create the checkpoint" not in said


def fake_mnist(root: Path, train: int = 120, test: int = 40) -> Path:
    """The four IDX files (uncompressed, as torchvision leaves them) of a small random MNIST under root/MNIST/raw."""
    import numpy as np

    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            (2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in (count, 28, 28)) + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            (2049).to_bytes(4, "big") + count.to_bytes(4, "big") + labels.tobytes())
    return root


def test_the_checkpoints_data_module_takes_overrides_without_its_class_restated(tmp_path):
    """Fit on MNIST in one folder, test with the data in another: --data.root parses against the checkpoint's
    MNIST, not the default Digits ('Option root is not accepted')."""
    first, moved = fake_mnist(tmp_path / "here"), tmp_path / "elsewhere"
    run("fit", *QUIET, "--data", "MNIST", "--data.root", str(first), "--model.backbone_options",
        "{patch_size: 7, embed_dim: 16, depth: 1, num_heads: 2}", "--trainer.max_epochs", "1",
        "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0", cwd=tmp_path)
    shutil.move(str(first), str(moved))
    ckpt = tmp_path / "runs" / "mnist" / "vit" / "none" / "version_0" / "checkpoints" / "last.ckpt"
    run("test", "--ckpt_path", str(ckpt), "--data.root", str(moved), *QUIET, "--lipschitz.every_n_epochs", "0",
        "--robustness.every_n_epochs", "0", cwd=tmp_path)
    results = json.loads((ckpt.parent / "results.json").read_text())
    assert results["data"]["name"] == "mnist" and results["data"]["root"] == str(moved)
    assert results["test_points"] == 40


def test_sigterm_during_a_fits_measurement_stops_within_seconds_and_keeps_the_epoch(tmp_path):
    """The official AutoAttack at validation during fit: SIGTERM drops this validation's robustness, the epoch's
    checkpoint is still written, and the fit stops at once with status 143 (a scheduler's grace period is short)."""
    process = subprocess.Popen(command() + ["fit", *QUIET, *TINY, "--trainer.max_epochs", "3",
                                            "--trainer.limit_train_batches", "4", "--lipschitz.every_n_epochs", "0",
                                            "--robustness.every_n_epochs", "1", "--robustness.attacks", "[autoattack]",
                                            "--robustness.num_points", "128", "--robustness.batch_size", "32",
                                            "--run_dir", str(tmp_path / "run")],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("robustness (fit): autoattack_Linf_2/255 on 128 points — at most" in line for line in lines):
        assert process.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)
    time.sleep(3)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=120)
    took = time.time() - sent
    reader.join(timeout=5)
    said = "".join(lines)
    assert status == 143 and took < 15, (status, took, said[-3000:])
    assert "stopped by SIGTERM" in said
    import torch

    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4 and last["epoch"] == 0  # the first epoch, kept


def test_only_a_missing_model_checkpoint_is_left_unsaid():
    """The filter stability test / validate apply: Lightning's line goes when the ModelCheckpoint they leave out is all
    it names, and stays when it names another callback (a user's stateful callback is still reported)."""
    import warnings

    from stability.cli import ONLY_MODEL_CHECKPOINT_MISSING

    def said(missing: list[str]) -> list[str]:
        message = ("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided "
                   f"during `Trainer` instantiation. Please add the following callbacks: {missing}.")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=ONLY_MODEL_CHECKPOINT_MISSING)
            warnings.warn(message, UserWarning, stacklevel=2)
        return [str(w.message) for w in caught]

    checkpoint = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1}"
    assert said([checkpoint]) == [] and said([checkpoint, checkpoint.replace("None", "'val/acc'")]) == []
    assert len(said([checkpoint, "EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}"])) == 1
    assert len(said(["MyCallback"])) == 1
