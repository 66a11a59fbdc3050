"""Certified global bounds: finite only where every factor is bounded, and never below what
the network really does (exact local Jacobian norms, empirical lower bounds)."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz import empirical_lower_bound, jacobian_norm
from stability.lipschitz.certified import certified_bound

VIT = dict(embed_dim=16, depth=2, num_heads=2)


@pytest.mark.parametrize("options", [{}, {"eps": 1.0, "tau": 2.0}, {"eps": 0.5, "alpha": 0.5, "spectral_init": False}])
def test_lipsformer_vit_bound_is_finite_and_above_every_measurement(options):
    torch.manual_seed(0)
    module = ImageClassifier(backbone_options=VIT, stabilizer="lipsformer", stabilizer_options={"lipsformer": options})
    network = module.network.eval().double()
    bound, reason = certified_bound(network)
    assert bound is not None and reason == "" and bound.value < float("inf")
    images = torch.rand(8, 1, 8, 8, dtype=torch.float64)
    assert float(jacobian_norm(network, images, method="exact").max()) <= bound.value
    assert float(empirical_lower_bound(network, images, radius=0.5, steps=20).max()) <= bound.value
    assert module.stabilizers[0].lipschitz_bound(network).value == pytest.approx(bound.value)


@pytest.mark.parametrize("stabilizer,options,why", [
    ("none", {}, "dot-product attention has no global Lipschitz bound"),
    ("lipsformer", {"center_norm": False}, "LayerNorm has no global Lipschitz bound"),
    ("lipsformer", {"normalize_v": False}, "without V normalisation is not Lipschitz"),
])
def test_no_bound_where_a_factor_is_unbounded(stabilizer, options, why):
    module = ImageClassifier(backbone_options=VIT, stabilizer=stabilizer, stabilizer_options={stabilizer: options}
                             if options else None)
    bound, reason = certified_bound(module.network)
    assert bound is None and why in reason


def test_other_backbones_say_the_bound_is_not_implemented():
    module = ImageClassifier(backbone="swin", image_size=16, stabilizer="lipsformer")
    bound, reason = certified_bound(module.network)
    assert bound is None and "implemented for the ViT backbone" in reason


def test_lipsformer_bound_keeps_the_features_bound_of_its_linear_head():
    torch.manual_seed(0)
    module = ImageClassifier(backbone_options=VIT, stabilizer="lipsformer")
    bound, _ = certified_bound(module.network.eval().double())
    head = module.network.backbone.head.weight.detach().double()
    assert bound.value == pytest.approx(bound.features * float(torch.linalg.matrix_norm(head, ord=2)))
    assert torch.equal(bound.head_weight, module.network.backbone.head.weight.detach())


def test_constrained_models_without_the_architecture_have_no_bound():
    module = ImageClassifier(backbone_options=VIT, stabilizer="muon")
    assert module.stabilizers[0].lipschitz_bound(module.network) is None
    assert certified_bound(module.network)[0] is None
