"""The cross-device comparison can fail: each planted error on the other side — a skipped Muon step, a wrong
orthogonalisation, a PGD step with the wrong sign, a dropped attention term, an update larger than its a-priori size
— fails stability/testing/parity.py's comparison (CPU float32 against float64, as the GPU check compares CPU against
CUDA), and the unplanted comparison passes (tests/test_gpu_readiness.py, every case)."""
import pytest
import torch
from test_gpu_readiness import at_a_generic_point, batch, build, compare_sides

from stability.models import attention_sites
from stability.optim_muon import ShapeBatchedMuon
from stability.robustness import pgd as pgd_module
from stability.testing import parity

OTHER = torch.float64  # the plants act on this side only


def failing(differences, fragment: str) -> list[parity.Difference]:
    return [d for d in parity.failures(differences) if fragment in d.key]


def test_the_unplanted_muon_comparison_passes_with_newton_schulz_in_float32():
    differences = compare_sides("lipschitz_transformer,muon", "vit", "cpu", OTHER)
    assert not parity.failures(differences), parity.describe(differences)
    assert [d for d in differences if d.key.startswith("update size")]  # each side's step against its size


def test_a_skipped_muon_step_fails(monkeypatch):
    original = ShapeBatchedMuon.step

    def step(self, closure=None):
        if self.param_groups[0]["params"][0].dtype == OTHER:
            return None  # the planted error: no update
        return original(self, closure)

    monkeypatch.setattr(ShapeBatchedMuon, "step", step)
    differences = compare_sides("lipschitz_transformer,muon", "vit", "cpu", OTHER)
    assert failing(differences, "after the step"), parity.describe(differences)


def test_a_wrong_orthogonalisation_fails(monkeypatch):
    """The other side orthogonalises with the classical cubic Newton–Schulz (1.5, −0.5, 0) instead of Muon's quintic."""
    original = parity.newton_schulz

    def planted(grad, coefficients, steps, eps=1e-7):
        return original(grad, (1.5, -0.5, 0.0) if grad.dtype == OTHER else coefficients, steps, eps)

    monkeypatch.setattr(parity, "newton_schulz", planted)
    differences = compare_sides("lipschitz_transformer,muon", "vit", "cpu", OTHER)
    assert failing(differences, "after the step"), parity.describe(differences)


def test_an_update_beyond_its_a_priori_size_fails(monkeypatch):
    """The other side's Muon steps with ten times its learning rate."""
    original = ShapeBatchedMuon.step

    def step(self, closure=None):
        if self.param_groups[0]["params"][0].dtype != OTHER:
            return original(self, closure)
        rates = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] *= 10
        try:
            return original(self, closure)
        finally:
            for group, lr in zip(self.param_groups, rates):
                group["lr"] = lr

    monkeypatch.setattr(ShapeBatchedMuon, "step", step)
    differences = compare_sides("muon", "vit", "cpu", OTHER)
    assert failing(differences, "update size (other)"), parity.describe(differences)


def test_a_pgd_step_with_the_wrong_sign_fails(monkeypatch):
    original = pgd_module.PGD.__call__

    def planted(self, images, labels):
        if images.dtype == OTHER:
            self.alpha = -abs(self.alpha)  # descends the loss instead of ascending it
        return original(self, images, labels)

    monkeypatch.setattr(pgd_module.PGD, "__call__", planted)
    differences = compare_sides("none", "vit", "cpu", OTHER)
    assert failing(differences, "pgd δ"), parity.describe(differences)


def test_an_fgsm_step_with_the_wrong_sign_fails(monkeypatch):
    import torchattacks

    original = torchattacks.FGSM.forward

    def planted(self, images, labels):
        adversarial = original(self, images, labels)
        return (2 * images - adversarial).clamp(0, 1) if images.dtype == OTHER else adversarial

    monkeypatch.setattr(torchattacks.FGSM, "forward", planted)
    differences = compare_sides("none", "vit", "cpu", OTHER)
    assert failing(differences, "fgsm δ"), parity.describe(differences)


@pytest.mark.parametrize("stabilizer", ["none", "jasmin"])
def test_a_dropped_attention_term_fails(stabilizer):
    """The other side's first attention block contributes nothing to its residual sum."""
    module = at_a_generic_point(build(stabilizer, "vit")).train()
    site = attention_sites(module.network)[0]
    site.module.register_forward_hook(lambda m, args, out: out * 0 if out.dtype == OTHER else None)
    images, labels = batch(module, 8)
    differences, _ = parity.compare_training_step(module, images, labels, "cpu", OTHER)
    assert failing(differences, "loss task"), parity.describe(differences)
