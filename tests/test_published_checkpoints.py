"""The models committed under ``results/``: each is a slim checkpoint (weights and hyperparameters, no optimizer
state), the shipped configs it names rebuild exactly its recipe, and its certified bound, in float64 on the trained
weights, is never below the exact Jacobian norm, whole and per class pair — while the bound without the pixel
normalisation's 1/σ (the planted error) is, at one of the same points at least."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from stability.classifier import ImageClassifier
from stability.cli import LINKED_FROM_DATA
from stability.lipschitz.certified import certified_bound

ROOT = Path(__file__).parents[1]
CERTIFIED_TRANSFORMER = ["configs/vit_mnist.yaml", "configs/stabilizer/lipschitz_transformer_certified.yaml"]
# checkpoint → (configs, overrides): the command line its recipe is (`stability fit --config … --config … overrides`)
PUBLISHED = {
    "results/certified_transformers/certified_transformer_gloro_100ep.ckpt": (CERTIFIED_TRANSFORMER, []),
    "results/certified_transformers/certified_transformer_residual_half.ckpt": (
        CERTIFIED_TRANSFORMER, ["--lipschitz_transformer.residual_scale", "4.0", "--trainer.max_epochs", "10"]),
    "results/certified_hybrid/hybrid_mnist_60ep.ckpt": (["configs/hybrid_mnist.yaml"], []),
}


def test_every_committed_checkpoint_names_its_recipe():
    """Every checkpoint published under results/ — not those of a study's unfinished runs, kept in their runs'
    ``checkpoints/`` folders so that another machine resumes them."""
    committed = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*.ckpt")
                       if p.parent.name != "checkpoints")
    assert committed == sorted(PUBLISHED)


def recipe(configs: list[str], overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "stability", "fit", *(a for c in configs for a in ("--config", c)), *overrides,
               "--print_config"]
    printed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    return yaml.safe_load(printed.stdout)


@pytest.mark.parametrize("path", sorted(PUBLISHED))
def test_the_shipped_configs_are_the_checkpoints_recipe(path):
    checkpoint = torch.load(ROOT / path, map_location="cpu", weights_only=True)
    assert "optimizer_states" not in checkpoint and "lr_schedulers" not in checkpoint  # slim: re-measuring only
    config = recipe(*PUBLISHED[path])
    model = {k: v for k, v in checkpoint["hyper_parameters"].items()
             if not k.startswith("_") and k not in LINKED_FROM_DATA}
    stabilizers, options = model.pop("stabilizer"), model.pop("stabilizer_options")
    assert {k: config["model"][k] for k in model} == model
    assert config["stabilizer"] == stabilizers
    assert {name: {k: config[name][k] for k in opts} for name, opts in options.items()} == options
    data = {k: v for k, v in checkpoint["datamodule_hyper_parameters"].items() if not k.startswith("_")}
    assert checkpoint["datamodule_hyper_parameters"]["_class_path"] == config["data"]["class_path"]
    assert {k: config["data"]["init_args"][k] for k in data} == data
    assert checkpoint["epoch"] + 1 == config["trainer"]["max_epochs"]  # the schedules are set by max_epochs


def jacobian(network: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.func.jacrev(network)(x).reshape(-1, x.numel())


@pytest.mark.parametrize("path", sorted(PUBLISHED))
def test_the_certified_bound_of_the_trained_weights_is_above_the_exact_jacobian_norm(path):
    classifier = ImageClassifier.load_from_checkpoint(ROOT / path, map_location="cpu")
    network = classifier.network.double().eval()
    bound, reason = certified_bound(network)
    assert bound is not None, reason
    rows = bound.head_weight.double()
    size = classifier.hparams.image_size
    gen = torch.Generator().manual_seed(0)
    largest = 0.0
    for _ in range(3):
        x = torch.rand(1, classifier.hparams.in_chans, size, size, generator=gen, dtype=torch.float64)
        logits = jacobian(network, x).detach()
        exact = float(torch.linalg.matrix_norm(logits, ord=2))
        assert exact <= bound.value
        largest = max(largest, exact)
        for i in range(logits.shape[0]):
            for j in range(i + 1, logits.shape[0]):
                pair = float(torch.linalg.vector_norm(logits[i] - logits[j]))
                assert pair <= bound.features * float(torch.linalg.vector_norm(rows[i] - rows[j])) * (1 + 1e-12)
    forgetful = copy.deepcopy(network)  # the planted error: the pixel normalisation's 1/σ left out of the bound
    forgetful.std.fill_(1.0)
    planted, _ = certified_bound(forgetful)
    assert largest > planted.value  # the trained weights violate it at one of the same points
