"""The local estimates compiled (``--lipschitz.compile``): the exact norm from one forward and one backward pass over
K copies of each point, and the lower bound's ascent, each through the network at one batch shape; the numbers equal
the eager run's, and every measurement of a run reuses the same compiled graphs."""
import json
import os

import pytest
import torch

from stability.cli import main

MEASURED = ["--lipschitz.num_points", "20", "--lipschitz.test_num_points", "20", "--lipschitz.batch_size", "8",
            "--lipschitz.attention", "false", "--robustness.every_n_epochs", "0", "--test_after_fit", "true"]


def lipschitz_results(root):
    (path,) = root.rglob("results.json")
    return json.loads(path.read_text())["lipschitz"]


def test_the_compiled_estimates_equal_the_eager_ones_and_compile_once_for_every_measurement(tmp_path, tiny_vit_args,
                                                                                            counted, scalars):
    os.chdir(tmp_path)
    for compile in ("false", "true"):
        main(["fit", *tiny_vit_args, "--runs_dir", compile, "--trainer.max_epochs", "3",
              "--trainer.limit_train_batches", "4", *MEASURED, "--lipschitz.compile", compile])
    eager, compiled = lipschitz_results(tmp_path / "false"), lipschitz_results(tmp_path / "true")
    assert eager["local_method"] == compiled["local_method"] == "exact"
    assert (eager["compiled"], compiled["compiled"]) == (False, True)
    for key in ("local_mean", "local_median", "local_max", "lower_bound_max"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-5), key
    assert eager["local_max"] > 0 and eager["lower_bound_max"] > 0
    (run,) = (tmp_path / "true").rglob("version_0")
    (eager_run,) = (tmp_path / "false").rglob("version_0")
    fit_local = scalars(run, "lipschitz/local_max")
    assert len(fit_local) == 3 and fit_local == pytest.approx(scalars(eager_run, "lipschitz/local_max"), rel=1e-5)
    # the local estimate's one graph (8 points × 10 copies, the input's gradient) and the ascent's two (8 points: no
    # gradient, the input's), once during fit (with the training-stability callback's hooks on the blocks) and once
    # at test (without them): 6 frames; compiled again at each of the three epochs, it would be 12 or more
    assert counted.frame_count == 6


def test_power_iteration_stays_eager_and_says_so(tmp_path, tiny_vit_args, counted, caplog):
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", *MEASURED,
          "--lipschitz.compile", "true", "--lipschitz.iterations", "2"])  # 10 logits > 2 × 2: power iteration
    results = lipschitz_results(tmp_path)
    assert results["local_method"] == "power" and results["compiled"] is False
    said = [r.getMessage() for r in caplog.records if "--lipschitz.compile" in r.getMessage()]
    assert len(said) == 1 and "power iteration (10 logits > 2 × 2 iterations" in said[0]


TINY = {"vit": (8, dict(embed_dim=16, depth=1, num_heads=2)),
        "swin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
        "cswin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2))),
        "hybrid": (8, {}), "lipcnn": (8, {})}


@pytest.mark.parametrize("backbone", list(TINY))
def test_every_backbone_compiles_the_one_pass_norm_and_the_ascent_to_the_eager_numbers(counted, backbone):
    """float64, traced by Dynamo and AOT autograd (the counted backend): the one-pass norm through the compiled fixed
    batch equals the eager K-backward norm, and the lower bound's ascent the eager ascent, to float64 rounding."""
    from stability.classifier import ImageClassifier
    from stability.lipschitz import empirical_lower_bound, jacobian_norm, jacobian_norm_one_pass
    from stability.robustness.attacks import evaluating, gradients_allowed
    from stability.robustness.fixed_batch import FixedBatch

    size, options = TINY[backbone]
    torch.manual_seed(0)
    network = ImageClassifier(backbone=backbone, image_size=size, backbone_options=options).network.double().eval()
    images = torch.rand(5, 1, size, size, dtype=torch.float64)
    local, points = FixedBatch(network, 4 * 10, compile=True), FixedBatch(network, 4, compile=True)
    with gradients_allowed(), evaluating(network), evaluating(local), evaluating(points):
        exact = jacobian_norm(network, images, method="exact")
        lower = empirical_lower_bound(network, images[:4], seed=3)
        got = torch.cat([jacobian_norm_one_pass(local, images[:4], 10), jacobian_norm_one_pass(local, images[4:], 10)])
        got_lower = empirical_lower_bound(points, images[:4], seed=3)
    assert counted.frame_count == 6  # every kind of forward of both wrappers compiled (warm_up's three each)
    torch.testing.assert_close(got, exact, rtol=1e-10, atol=0)
    torch.testing.assert_close(got_lower, lower, rtol=1e-10, atol=0)


@pytest.mark.gpu
def test_inductor_compiled_one_pass_on_the_gpu_is_the_eager_exact_norm():
    """The default backend's kernels on CUDA, float32 with TF32 off (as the monitor measures): the one-pass norm
    through the compiled fixed batch equals the eager K-backward norm to float32 rounding."""
    from stability.classifier import ImageClassifier
    from stability.lipschitz import jacobian_norm, jacobian_norm_one_pass
    from stability.robustness.attacks import evaluating, frozen_weights, gradients_allowed
    from stability.robustness.fixed_batch import FixedBatch

    torch.manual_seed(0)
    network = ImageClassifier(backbone="vit", image_size=8, backbone_options=dict(embed_dim=32, depth=2, num_heads=2)
                              ).network.cuda().eval()
    images = torch.rand(24, 1, 8, 8, device="cuda")
    torch._dynamo.reset()
    compiled = FixedBatch(network, 16 * 10, compile=True, graphs=("input",))  # as --lipschitz.compile: one graph
    with gradients_allowed(), evaluating(network), evaluating(compiled), frozen_weights(network):
        exact = jacobian_norm(network, images, method="exact")
        got = torch.cat([jacobian_norm_one_pass(compiled, images[:16], 10),
                         jacobian_norm_one_pass(compiled, images[16:], 10)])  # the second batch padded
    torch._dynamo.reset()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=0)


def test_frozen_weights_need_no_gradient_inside_and_theirs_again_after_even_on_an_error():
    from stability.robustness.attacks import frozen_weights

    network = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    network[1].bias.requires_grad_(False)  # a parameter frozen before stays frozen
    with pytest.raises(RuntimeError, match="inside"):
        with frozen_weights(network):
            assert not any(p.requires_grad for p in network.parameters())
            raise RuntimeError("inside")
    assert [p.requires_grad for p in network.parameters()] == [True, True, True, False]
    with frozen_weights(network, frozen=False):
        assert network[0].weight.requires_grad


def test_the_compiled_passes_are_kept_for_the_same_network_and_sizes_and_split_past_two_to_the_fifteen_rows():
    from stability.callbacks.lipschitz_monitor import ONE_PASS_ROWS, LipschitzMonitor

    monitor = LipschitzMonitor(compile=True)
    network, other = torch.nn.Linear(4, 10), torch.nn.Linear(4, 10)
    passes = monitor._compiled_passes(network, "exact", 10, 64, 100)
    assert (passes.local.batch_size, passes.points.batch_size) == (640, 64)
    assert passes.local.graphs == ("input",) and passes.points.graphs == ("no_grad", "input")
    assert monitor._compiled_passes(network, "exact", 10, 64, 100) is passes  # warmed up once
    assert monitor._compiled_passes(other, "exact", 10, 64, 100) is not passes
    large = monitor._compiled_passes(other, "exact", 10, 5000, 5000)
    assert large.local.batch_size == ONE_PASS_ROWS // 10 * 10 == 32760  # 50,000 rows go in two calls
    assert LipschitzMonitor(compile=False)._compiled_passes(network, "exact", 10, 64, 100) is None
