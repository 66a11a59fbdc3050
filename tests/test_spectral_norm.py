"""Spectral normalisation: both modes keep σ₁ at or below σ_max, checked by exact SVD."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.models import linear_layers
from stability.stabilizers.spectral_norm import SpectralNorm

VIT = dict(embed_dim=16, depth=1, num_heads=2)


def max_sigma(network, layers="all"):
    return max(float(torch.linalg.matrix_norm(lin.weight.detach(), ord=2)) for lin in linear_layers(network, layers))


@pytest.mark.parametrize("layers", ["all", "attention", "mlp"])
def test_project_caps_every_chosen_weight_and_leaves_small_ones(layers):
    module = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm",
                             stabilizer_options={"spectral_norm": {"sigma_max": 0.5, "layers": layers}})
    assert max_sigma(module.network, layers) <= 0.5 + 1e-5
    stab = module.stabilizers[0]
    with torch.no_grad():
        for lin in linear_layers(module.network, layers):
            lin.weight.mul_(100.0)
    small = linear_layers(module.network, layers)[0]
    with torch.no_grad():
        small.weight.mul_(0.01)
    before = small.weight.clone()
    stab.after_optimizer_step(module.network)
    assert max_sigma(module.network, layers) <= 0.5 + 1e-5
    assert torch.equal(small.weight, before)  # below the cap: untouched
    capped = linear_layers(module.network, layers)[-1]
    assert float(torch.linalg.matrix_norm(capped.weight.detach(), ord=2)) == pytest.approx(0.5, rel=1e-5)


def test_parametrize_sets_sigma_to_sigma_max_and_checkpoints_reload():
    options = {"spectral_norm": {"sigma_max": 2.0, "mode": "parametrize"}}
    module = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm", stabilizer_options=options)
    module.train()
    for _ in range(50):  # torch's spectral_norm refines u, v on each training forward
        module.network(torch.rand(2, 1, 8, 8))
    module.eval()
    for lin in linear_layers(module.network, "all"):
        assert float(torch.linalg.matrix_norm(lin.weight, ord=2)) == pytest.approx(2.0, rel=1e-3)
    again = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm", stabilizer_options=options)
    again.load_state_dict(module.state_dict())
    again.eval()
    x = torch.rand(2, 1, 8, 8)
    torch.testing.assert_close(again(x), module(x))


def test_bad_options():
    with pytest.raises(ValueError, match="sigma_max must be > 0"):
        SpectralNorm(sigma_max=0)
    with pytest.raises(ValueError, match="layers must be 'all', 'attention' or 'mlp'"):
        SpectralNorm(layers="heads")
    with pytest.raises(ValueError, match="mode must be 'project' or 'parametrize'"):
        SpectralNorm(mode="clip")
    with pytest.raises(ValueError, match="method must be 'iterative' or 'exact'"):
        SpectralNorm(method="power")
    with pytest.raises(ValueError, match="check_every >= 0"):
        SpectralNorm(check_every=-1)


def test_exact_method_skips_only_what_is_certainly_below_the_cap_and_never_lets_a_weight_through():
    """``method: exact``: the certified bound b ≥ σ₁ (last exact σ₁ + ‖ΔW‖_F since) spares the exact computation
    of weights far below the cap, and every weight is at or below the cap after every step (checked by SVD)."""
    module = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm",
                             stabilizer_options={"spectral_norm": {"sigma_max": 1.0, "method": "exact"}})
    stab = module.stabilizers[0]
    weights = [lin.weight for lin in linear_layers(module.network, "all")]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # half the weights at the cap, half far below it
        for i, w in enumerate(weights):
            w.mul_((1.0 if i % 2 else 0.05) / float(torch.linalg.matrix_norm(w, ord=2)))
    stab._previous = None  # changed behind its back: start again from exact values
    stab.after_optimizer_step(module.network)
    computed = stab.exact_computations
    for step in range(20):
        with torch.no_grad():
            for w in weights:
                w.add_(torch.randn(w.shape, generator=gen) * 1e-3)
        stab.after_optimizer_step(module.network)
        assert max_sigma(module.network) <= 1.0 + 1e-6, step
    # the weights far below the cap were never recomputed; those at the cap were, every step
    assert stab.exact_computations - computed == 20 * (len(weights) // 2)


def test_iterative_checks_find_report_and_fix_what_the_estimate_missed():
    """A weight pushed far above the cap along directions the estimator's block cannot see (u ⟂ W V, v ⟂ V, so
    WᵀW V does not change) passes the power-iteration projection; the exact check of that step projects it,
    keeps its excess (logged as a signal) and warns once."""
    module = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm",
                             stabilizer_options={"spectral_norm": {"sigma_max": 1.0, "check_every": 5}})
    stab = module.stabilizers[0]
    linear = linear_layers(module.network, "all")[0]
    weight, basis = linear.weight, linear.spectral_norm_basis  # (m, n), (n, b)

    def orthogonal_to(columns: torch.Tensor) -> torch.Tensor:
        extended = torch.cat([columns, torch.randn(columns.shape[0], 1, dtype=columns.dtype)], dim=1)
        return torch.linalg.qr(extended)[0][:, -1]

    with torch.no_grad():
        hidden = torch.outer(orthogonal_to(weight @ basis), orthogonal_to(basis))
        weight.add_(3.0 * hidden)
    with pytest.warns(UserWarning, match="exact check found"):
        stab.after_optimizer_step(module.network, global_step=4)  # the 5th step: a check
    assert max_sigma(module.network) <= 1.0 + 1e-6 and stab.largest_excess > 1.0
    assert stab.signals() == {"excess": stab.largest_excess}


def test_iterative_projection_holds_the_cap_during_training_without_checks():
    """On digits at a large learning rate (the top direction moves every step), with the checks off, the
    estimate alone keeps every weight within 1e-4 of the cap at every step (exact SVD)."""
    from stability.data import Digits

    torch.manual_seed(0)
    module = ImageClassifier(backbone_options=VIT, stabilizer="spectral_norm", lr=1e-2, scheduler="constant",
                             stabilizer_options={"spectral_norm": {"sigma_max": 1.0, "check_every": 0}})
    data = Digits(batch_size=64)
    data.setup()
    optimizer = module.build_optimizer()
    for step, (images, labels) in zip(range(25), data.train_dataloader()):
        optimizer.zero_grad()
        sum(module.losses(images, labels)[1].values()).backward()
        optimizer.step()
        module.after_optimizer_step(step)
        assert max_sigma(module.network) <= 1.0 + 1e-4, step
