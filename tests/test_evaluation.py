"""`stability test` as a researcher reports numbers: the whole test split by default, results.json
beside the checkpoint, certified accuracy where a bound exists, the same numbers on one process and
on two DDP processes (CPU, gloo), and float32 measurements under mixed precision."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stability.callbacks.bounds import certified_bound_of
from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.robustness import AttackSpec, certified_radii, robust_accuracy
from stability.testing import parity

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
TINY = ["--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"]
MEASURE = ["--robustness.test_attacks", "[fgsm, pgd]", "--robustness.pgd_steps", "3", "--lipschitz.iterations", "3",
           "--lipschitz.attention_points", "8", "--robustness.batch_size", "64", "--lipschitz.batch_size", "64"]


def stability(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("stability", path=str(Path(sys.executable).parent))
    command = [exe] if exe else [sys.executable, "-m", "stability"]
    done = subprocess.run(command + list(args), cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A LipsFormer ViT (it has a certified bound) trained for a few epochs."""
    root = tmp_path_factory.mktemp("evaluation")
    stability("fit", *QUIET, *TINY, "--stabilizer", "lipsformer", "--trainer.max_epochs", "4", "--model.lr", "5e-3",
              "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0", cwd=root)
    return root / "runs" / "digits" / "vit" / "lipsformer" / "version_0" / "checkpoints" / "last.ckpt"


def test_results(checkpoint: Path, *extra: str, env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    done = stability("test", *QUIET, "--ckpt_path", str(checkpoint), *MEASURE, *extra, cwd=checkpoint.parents[5],
                     env=env)
    return json.loads((checkpoint.parent / "results.json").read_text()), done


test_results.__test__ = False  # a helper, not a test


def measured(results: dict) -> dict:
    """Every accuracy and Lipschitz number of a results.json."""
    robustness, lipschitz = results["robustness"], results["lipschitz"]
    return {"clean": results["clean_accuracy"], **robustness["accuracy"],
            **{f"certified {k}": v for k, v in robustness["certified"].items()},
            **{k: v for k, v in lipschitz.items() if isinstance(v, float)}}


def test_results_json_records_the_whole_test_split_and_certified_accuracy(checkpoint):
    results, done = test_results(checkpoint, "--robustness.attack_num_points", "200")
    assert results["test_points"] == 270 and results["robustness"]["points"] == 270  # the digits test split
    assert results["lipschitz"]["points"] == 270 and results["robustness"]["attack_points"] == 200
    assert results["robustness"]["attacks"]["pgd_Linf_8/255"]["points"] == 200
    accuracy = results["robustness"]["accuracy"]
    assert accuracy["clean"] == pytest.approx(results["clean_accuracy"])  # clean and certified: every point
    assert 0 < accuracy["attack_clean"] <= 1  # the clean accuracy of the 200 attacked points
    assert accuracy["worst_Linf_8/255"] <= min(accuracy["fgsm_Linf_8/255"], accuracy["pgd_Linf_8/255"])
    certified = results["robustness"]["certified"]
    assert {"L2_0.1", "L2_0.5", "Linf_2/255", "Linf_8/255"} <= set(certified)
    for budget, value in certified.items():
        assert 0 <= value <= accuracy["clean"]
        if budget.startswith("Linf"):  # certified ≤ empirical, always (the attacks ran on the first 200)
            assert value <= accuracy[f"worst_{budget}"] + (270 - 200) / 270
    bound = results["robustness"]["certified_bound"]
    assert bound["value"] > 1 and "LipsFormer" in bound["label"] and results["lipschitz"]["certified_log10"] > 0
    assert results["stabilizers"]["lipsformer"]["center_norm"] is True and results["model"]["backbone"] == "vit"
    assert "stability test" in results["command"] or "stability" in results["command"]
    assert "test_certified/acc_L2_0.5" in done.stdout


CPU = ("--trainer.accelerator", "cpu")


def test_two_ddp_processes_give_the_numbers_of_one(checkpoint):
    """On the CPU (gloo), bit for bit: the same kernels run on one process and on two. The same kernels means the same
    threads per process: Lightning gives each of N CPU processes 1/N of the cores, and a reduction split over another
    number of threads rounds differently (the lower bound's ascent differs in the 6th digit, on torch 2.9 and 2.14)."""
    threads = {"OMP_NUM_THREADS": "1"}
    one, _ = test_results(checkpoint, *CPU, env=threads)
    two, done = test_results(checkpoint, "--trainer.strategy", "ddp", "--trainer.devices", "2", *CPU, env=threads)
    assert two["processes"] == 2 and one["processes"] == 1
    assert measured(two) == measured(one)
    assert "sync_dist" not in done.stdout + done.stderr


def test_measurements_run_in_float32_under_mixed_precision(checkpoint):
    full, _ = test_results(checkpoint, *CPU)
    mixed, _ = test_results(checkpoint, "--trainer.precision", "bf16-mixed", *CPU)
    assert mixed["precision"] == "bf16-mixed"
    expected = {k: v for k, v in measured(full).items() if k != "clean"}  # test/acc itself runs in bf16
    assert {k: v for k, v in measured(mixed).items() if k != "clean"} == expected


def compare_results(reference: dict, other: dict, with_clean: bool = True) -> list[parity.Difference]:
    """Two results.json of the same checkpoint computed with different kernels: each accuracy within one point of the
    270 (a point at a decision boundary may flip; PGD starts from the same points on every device), each Lipschitz
    number within 1e-3 of itself. Every key is returned with both values and its tolerance."""
    ours, theirs = measured(reference), measured(other)
    accuracies = set(reference["robustness"]["accuracy"]) | {"clean"} | {k for k in ours if k.startswith("certified ")}
    return [parity.difference(key, value, theirs[key], 1 / 270 + 1e-9 if key in accuracies else 1e-3 * abs(value))
            for key, value in ours.items() if with_clean or key != "clean"]


def test_float64_against_float32_stays_within_the_device_tolerance(checkpoint):
    """The checkpoint's network in float64 and in float32 (rounding of another size, the CPU's stand-in for another
    device's kernels), attacked from the same starts and certified: accuracies within the one point of 270 that
    :func:`compare_results` allows a GPU, radii within 1e-3 of their scale."""
    module = ImageClassifier.load_from_checkpoint(checkpoint).eval()
    data = Digits()
    data.setup("test")
    images, labels = data.test_set.tensors
    specs = [AttackSpec(name, "Linf", eps) for name in ("fgsm", "pgd") for eps in (2 / 255, 8 / 255)]
    network64 = copy.deepcopy(module.network).double()
    ours = robust_accuracy(module.network, images, labels, specs, 10, pgd_steps=3)
    theirs = robust_accuracy(network64, images.double(), labels, specs, 10, pgd_steps=3)
    differences = [parity.difference(k, v, theirs[k], 1 / 270 + 1e-9) for k, v in ours.items()]
    bound, _ = certified_bound_of(module.stabilizers, module.network)
    bound64, _ = certified_bound_of(module.stabilizers, network64)
    with torch.no_grad():
        radii = certified_radii(module.network(images), labels, bound)
        radii64 = certified_radii(network64(images.double()), labels, bound64)
    differences.append(parity.difference("radii", radii, radii64, 1e-3 * parity.scale(radii) + 1e-12))
    assert not parity.failures(differences), parity.describe(differences)


@pytest.mark.gpu
def test_on_a_gpu_measurements_match_the_cpu_and_ignore_the_precision(checkpoint):
    """GPU kernels differ from the CPU's in the last bits (and atomics in the order of sums): compared as
    :func:`compare_results`, under fp32 and under bf16-mixed (whose measurements run in float32; test/acc itself runs
    in bf16, so the clean accuracy is compared under fp32 only)."""
    cpu, _ = test_results(checkpoint, *CPU)
    for precision in ("32-true", "bf16-mixed"):
        gpu, _ = test_results(checkpoint, "--trainer.accelerator", "gpu", "--trainer.precision", precision)
        differences = compare_results(cpu, gpu, with_clean=precision == "32-true")
        assert not parity.failures(differences), f"{precision}:\n{parity.describe(differences)}"
