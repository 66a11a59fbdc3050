"""The plan line's bound on the official AutoAttack (stability/robustness/autoattack_cost.py): its calls per batch are
pyautoattack's, counted again here on a network no attack breaks, and the bound holds for that network, on which the
attack takes every call it can."""
import time

import pytest
import torch

from stability.robustness.autoattack_cost import (
    CALLS,
    JACOBIAN,
    Unbreakable,
    attack_overheads,
    autoattack_seconds,
    calls,
)


@pytest.mark.parametrize("version, norm", [("standard", "Linf"), ("standard", "L1"), ("plus", "L2"), ("rand", "L2")])
def test_the_calls_per_batch_are_the_official_autoattacks(version, norm):
    """Counted on a network no attack breaks: every attack's calls with a graph and without, and untargeted FAB's
    backward passes (one per class at each call with a graph)."""
    from pyautoattack import AutoAttack

    images = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # ℓ2's Square needs 8 × 8
    labels, network = torch.zeros(1, dtype=torch.long), Unbreakable(64, 10)
    eps = {"Linf": 8 / 255, "L2": 0.5, "L1": 5.0}[norm]
    for name, (with_graph, without) in calls(version, norm).items():
        network.calls = network.graph_calls = network.weight_backwards = 0
        attack = AutoAttack(network, norm=norm, eps=eps, version=version, seed=0)
        attack.attacks_to_run = [name]
        attack.run_standard_evaluation(images, labels, batch_size=1)
        assert (network.graph_calls, network.calls - network.graph_calls) == (with_graph, without), name
        if name in JACOBIAN:
            assert network.weight_backwards == 10 * with_graph, name


def test_the_bound_holds_where_no_point_falls():
    from pyautoattack import AutoAttack

    images = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    labels, network = torch.zeros(2, dtype=torch.long), Unbreakable(64, 10)
    before = autoattack_seconds(network, images, labels, 2, 256, "Linf", 8 / 255, "standard", 10)
    started = time.perf_counter()
    AutoAttack(network, norm="Linf", eps=8 / 255, version="standard", seed=0).run_standard_evaluation(
        images, labels, batch_size=2)
    taken = time.perf_counter() - started
    after = autoattack_seconds(network, images, labels, 2, 256, "Linf", 8 / 255, "standard", 10)
    # one-sided (the counts above are the exact check), timed on both sides of the attack: the load of a shared
    # machine (other tests beside this one) changes between a plan and its attack, not the attack's calls
    assert taken <= max(before, after), (taken, before, after)


def test_the_overhead_probe_leaves_the_random_generators_as_they_were():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    overheads = attack_overheads(torch.rand(2, 1, 8, 8), 10, "L2", 0.5, "standard")
    torch.manual_seed(7)  # the same draws again
    assert torch.equal(torch.rand(3), expected)
    assert set(overheads) == set(CALLS["standard"]) and all(v > 0 for v in overheads.values())


@pytest.mark.parametrize("version", ["standard", "plus", "rand"])
def test_the_bound_is_every_attacks_calls_times_their_cost_per_batch(version, monkeypatch):
    """With the timings fixed: calls with a graph cost the forward-and-backward pass (untargeted FAB's a forward and
    a backward per class), the others the forward, each plus its attack's own work; batches of at most batch_size
    points, a smaller last one counted as full."""
    from stability.robustness import autoattack_cost

    monkeypatch.setattr(autoattack_cost, "network_pass_seconds", lambda network, images, labels: (3.0, 1.0))
    monkeypatch.setattr(autoattack_cost, "attack_overheads",
                        lambda images, classes, norm, eps, version: {name: 0.5 for name in calls(version, norm)})
    images, labels = torch.rand(2, 1, 8, 8), torch.zeros(2, dtype=torch.long)
    per_batch = sum(g * ((1.0 + 10 * 2.0 if name in JACOBIAN else 3.0) + 0.5) + n * 1.5
                    for name, (g, n) in CALLS[version].items())  # untargeted FAB: a forward and 10 backward passes
    seconds = autoattack_seconds(Unbreakable(64, 10), images, labels, 5, 2, "Linf", 8 / 255, version, 10)
    assert seconds == pytest.approx(autoattack_cost.MARGIN * 3 * per_batch)  # 5 points in batches of 2: 3
