"""The margins' lower bound by gradient ascent on pairs (GloRo's tool): every ratio it finds is a pair of real points,
so it never exceeds the certified per-pair constant of a sound bound (on the convolutional anchor and the certified
transformer, at random weights), and the ascent finds more than its starting pair."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz.certified import certified_bound
from stability.lipschitz.pairs import certified_pair_constants, margin_lower_bound

CERTIFIED_VIT = {"lipschitz_transformer": {"attention": "l2_unit", "activation": "maxmin", "pooling": "flatten",
                                           "zero_init": False}}


@pytest.mark.parametrize("backbone, stabilizer, options", [("lipcnn", "none", None),
                                                          ("vit", "lipschitz_transformer", CERTIFIED_VIT)])
def test_the_pairs_found_never_exceed_the_certified_constants_and_the_ascent_climbs(backbone, stabilizer, options):
    torch.manual_seed(0)
    module = ImageClassifier(backbone=backbone, stabilizer=stabilizer, stabilizer_options=options,
                             backbone_options={} if backbone == "lipcnn" else dict(embed_dim=16, depth=2,
                                                                                    num_heads=1))
    network = module.network.eval()
    with torch.no_grad():
        for p in network.parameters():  # generic weights (AOL and the caps keep the bound sound whatever they are)
            if p.ndim >= 2:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    bound, reason = certified_bound(network)
    assert bound is not None, reason
    k = certified_pair_constants(bound, 10)
    images = torch.rand(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    first, _ = margin_lower_bound(network, images, steps=1)
    ratio, pair = margin_lower_bound(network, images, steps=150)
    assert (ratio > first).any() and (ratio >= first).all()
    assert (ratio.double() <= k[pair[:, 0], pair[:, 1]] * (1 + 1e-6)).all()


def test_on_a_linear_network_the_ascent_reaches_the_exact_pair_constant():
    """The anchor with no hidden layer is linear, z = W·(x − μ)/σ: each margin's Lipschitz constant is exactly its
    certified K_tj = ‖w_t − w_j‖/σ, and the ascent must find (nearly) that — a constant 2× too small would fail."""
    torch.manual_seed(0)
    module = ImageClassifier(backbone="lipcnn", backbone_options={"convs": [], "dense": []})
    network = module.network.eval()
    bound, _ = certified_bound(network)
    k = certified_pair_constants(bound, 10)
    images = torch.rand(8, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.25
    ratio, pair = margin_lower_bound(network, images, steps=300, lr=1e-2)
    exact = k[pair[:, 0], pair[:, 1]]
    assert (ratio.double() <= exact * (1 + 1e-6)).all()
    reached = ratio.double() / exact
    assert float(reached.median()) >= 0.999 and float(reached.min()) >= 0.9, reached  # the exact constant, found


def test_the_best_pairs_are_evaluated_again_in_float64_and_tiny_distances_are_not_kept():
    """The ratio reported is the float64 copy's (the function the certificate bounds): on the linear network it is
    within float64 rounding of the exact constant, never above it; a pair closer than ``min_distance`` (where
    float32 rounding over the distance is the ratio) is never kept."""
    import copy

    torch.manual_seed(0)
    module = ImageClassifier(backbone="lipcnn", backbone_options={"convs": [], "dense": []})
    network = module.network.eval()
    exact = copy.deepcopy(network).double()
    bound, _ = certified_bound(exact)
    k = certified_pair_constants(bound, 10)
    images = torch.rand(8, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.25
    ratio, pair = margin_lower_bound(network, images, steps=300, exact=exact)
    assert ratio.dtype == torch.float64
    reached = ratio / k[pair[:, 0], pair[:, 1]]
    assert (reached <= 1 + 1e-12).all() and float(reached.median()) >= 0.999, reached
    close, _ = margin_lower_bound(network, images, steps=1, start=1e-5, exact=exact)
    assert (close == 0).all()
    kept, _ = margin_lower_bound(network, images, steps=1, start=1e-5, exact=exact, min_distance=0)
    assert (kept > 0).all()


def test_the_pair_lower_bound_runs_at_test_and_says_the_bound_holds(tmp_path):
    import lightning as L

    from stability.callbacks import LipschitzMonitor
    from stability.data import Digits

    torch.manual_seed(0)
    module = ImageClassifier(backbone="lipcnn")
    monitor = LipschitzMonitor(test_num_points=16, iterations=2, attention=False, pair_points=8, pair_steps=20)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=tmp_path, inference_mode=True)
    trainer.test(module, Digits(batch_size=32))
    found = monitor.last_results["test"]
    assert 0 < found["margin_lower_bound"] <= found["margin_bound"] and found["margin_tightness"] >= 1
    assert found["margin_pair_tightness_min"] >= 1 - 1e-12  # both in float64, on the same copy
    assert trainer.callback_metrics["test_lipschitz/margin_tightness"] >= 1
