"""Shared test set-up: fixed threads and seeds, and helpers used by several test files (as fixtures)."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stability.stabilizers import REGISTRY, Stabilizer

os.environ.setdefault("PYTHONHASHSEED", "0")
# pytest-xdist runs one worker per core: share the cores between workers instead of oversubscribing them — the
# processes the tests start too (stability fit, sweeps, benchmarks): two threads of each of two processes on two
# cores wait on each other at every parallel region (a local Lipschitz estimate measured 96 s instead of 2 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, torch.get_num_threads()) // _WORKERS)
torch.set_num_threads(_THREADS)
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker: its share, whatever the controller (which reads this too) set
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
else:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# every due validation measured (max_share 0): a test's measured epochs must not follow its machine's speed
QUICK = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--lipschitz.max_share", "0", "--robustness.max_share", "0"]
SMALL_VIT = ["--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device (as Lightning's ``RunIf(min_cuda_gpus=1)``): skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_check.py runs these where there is one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def quick_args() -> list[str]:
    """Command-line flags that keep a ``stability fit`` quiet."""
    return list(QUICK)


@pytest.fixture
def tiny_vit_args() -> list[str]:
    """Quiet flags and a 1-block, 16-d ViT: a run of a few seconds."""
    return QUICK + SMALL_VIT


@pytest.fixture
def counted(monkeypatch):
    """FixedBatch compiles counted (its backend replaced by a counting one that runs the traced graphs as they are:
    fast, and rounding as eager); yields the counter."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from stability.robustness import fixed_batch

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fixed_batch, "BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.fixture
def counted_compile(monkeypatch):
    """Every ``torch.compile`` inside the test traced by Dynamo and AOT autograd with a counting backend (its mode
    dropped: no Inductor); yields the counter."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **options: real_compile(fn, backend=counter,
                                                                                         **options))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def read_scalars(run_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


@pytest.fixture(scope="session")
def scalars():
    """``scalars(run_dir, tag)``: the values of a TensorBoard scalar of a run, in order."""
    return read_scalars


class Recorder(Stabilizer):
    """Test stabilizer that records each hook call and uses each hook for real."""

    name = "recorder"
    needs_attention_probs = True

    def __init__(self, weight: float = 0.1, bound: float = 3.0):
        self.weight, self.bound = weight, bound
        self.calls = {"prepare": 0, "loss": 0, "after_step": 0}
        self.prob_shapes = []

    def prepare(self, network):
        self.calls["prepare"] += 1
        network.backbone.head.bias.data.fill_(0.0)

    def loss(self, step):
        self.calls["loss"] += 1
        self.prob_shapes = [tuple(p.shape) for p in step.attention_probs]
        return self.weight * step.logits.pow(2).mean()

    def after_optimizer_step(self, network, global_step=0):
        self.calls["after_step"] += 1
        with torch.no_grad():
            network.backbone.head.weight.clamp_(-0.05, 0.05)

    def lipschitz_bound(self, network):
        return self.bound


@pytest.fixture
def recorder(monkeypatch) -> type[Recorder]:
    """The :class:`Recorder` test stabilizer, registered as ``--stabilizer recorder``."""
    monkeypatch.setitem(REGISTRY, "recorder", Recorder)
    return Recorder


def write_cifar_files(root, name, n_train_per_file=12, n_test=10):
    rng = np.random.default_rng(0)
    if name == "cifar10":
        folder, files, key, classes = "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], b"labels", 10
        test_files = ["test_batch"]
    else:
        folder, files, key, classes = "cifar-100-python", ["train"], b"fine_labels", 100
        test_files = ["test"]
    directory = root / folder
    directory.mkdir(parents=True)
    written = {}
    for file, n in [(f, n_train_per_file) for f in files] + [(f, n_test) for f in test_files]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, classes, size=n).tolist()
        entry = {b"batch_label": file.encode(), b"data": data, key: labels,
                 b"filenames": [f"{i}.png".encode() for i in range(n)]}
        if name == "cifar100":
            entry[b"coarse_labels"] = [0] * n
        with open(directory / file, "wb") as handle:
            pickle.dump(entry, handle, protocol=2)
        written[file] = (data, labels)
    return written


@pytest.fixture
def write_cifar():
    """``write_cifar(root, "cifar10" | "cifar100")``: small files in the official pickle format."""
    return write_cifar_files


TINY_RUN = {  # sweep overrides for a run of a few seconds: 1-layer 16-d ViT, 3 steps, small measurements
    "model.backbone_options": {"embed_dim": 16, "depth": 1, "num_heads": 2},
    "trainer.max_epochs": 1, "trainer.limit_train_batches": 3, "trainer.log_every_n_steps": 1,
    "trainer.enable_model_summary": False, "timing.enabled": True,
    "lipschitz.num_points": 8, "lipschitz.iterations": 2, "lipschitz.attention": False,
    "robustness.every_n_epochs": 1, "robustness.num_points": 8, "robustness.pgd_steps": 2,
    "robustness.test_attacks": ["fgsm", "pgd"], "test_after_fit": True,
}


def write_sweep_file(directory: Path, seeds: list[int], extra_variants: list[dict] = ()) -> Path:
    spec = {"name": "tiny", "args": TINY_RUN, "variants": [{"stabilizer": "none"}, *extra_variants], "seeds": seeds}
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def sweep_file():
    """``sweep_file(directory, seeds, extra_variants=())``: a sweep file of tiny runs ("tiny")."""
    return write_sweep_file


def run_sweep_command(cwd: Path, spec: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stability", "sweep", str(spec), "--sweeps_dir", "sweeps", *extra],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def run_sweep():
    """``run_sweep(cwd, spec_file, *flags)``: ``stability sweep`` in a subprocess, into cwd/sweeps."""
    return run_sweep_command
