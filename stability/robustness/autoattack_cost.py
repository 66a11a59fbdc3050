"""An upper bound on the time the official AutoAttack (pyautoattack) takes, for the plan line a measurement says
before it starts.

AutoAttack's work is counted in *calls* of the network on a batch, not in points: each of its attacks runs a fixed
number of iterations on the batch's points that still resist, so a batch where no point falls takes the most calls.
Counted with a model that no attack breaks (tests/test_autoattack_cost.py counts them again against pyautoattack),
per batch, as (calls with a backward pass, calls without):

* standard: APGD-CE (101, 10), APGD-T 9 targets (909, 19), FAB-T (900, 937; its backward also reaches the network's
  weights where they need gradients, which the monitors' attacks freeze), Square 5,000 queries (0, 5,012): 1,910 and
  5,978, 7,888 in all;
* plus: APGD-CE and APGD-DLR with 5 restarts, FAB with 5 (untargeted: a backward pass per class at each of its
  calls), Square, APGD-T, FAB-T;
* rand: APGD-CE and APGD-DLR with 20 EOT draws each;
* the standard version at ℓ1: APGD-CE with 5 restarts, APGD-T with 5 targets.

Each call costs the network's pass on the batch (forward, or forward and a full backward: measured) and the attack's
own work around it (projections, sampling, bookkeeping: on a small network or a GPU the larger part). That overhead
is measured per attack by running it briefly, with a few iterations, on a stand-in network of the same input shape and
batch that classifies every point as class 0 by a margin no attack can overcome (so no point ever falls).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..wall_clock import seconds
from .fixed_batch import repeated_to

# (calls with a backward pass, calls without) per batch, every point resisting every attack (ℓ∞ and ℓ2; the
# standard version at ℓ1 runs APGD with 5 restarts and 5 targets: CALLS_L1)
CALLS: dict[str, dict[str, tuple[int, int]]] = {
    "standard": {"apgd-ce": (101, 10), "apgd-t": (909, 19), "fab-t": (900, 937), "square": (0, 5012)},
    "plus": {"apgd-ce": (505, 10), "apgd-dlr": (505, 10), "fab": (500, 520), "square": (0, 5012),
             "apgd-t": (909, 19), "fab-t": (900, 937)},
    "rand": {"apgd-ce": (2020, 5), "apgd-dlr": (2020, 5)},
}
CALLS_L1 = {"standard": {"apgd-ce": (515, 10), "apgd-t": (515, 15), "fab-t": (900, 937), "square": (0, 5012)}}
JACOBIAN = {"fab"}  # untargeted FAB: each call with a backward pass takes one backward pass per class


def calls(version: str, norm: str) -> dict[str, tuple[int, int]]:
    """The calls per batch of ``version`` at ``norm`` (module docstring)."""
    return (CALLS_L1 if norm == "L1" else CALLS).get(version, CALLS[version])


PROBE_ITERATIONS = 8  # of each attack, on the stand-in, to time its own work per call (the slower of two runs)
MARGIN = 2.0  # timed passes and probes of the attacks' own work vary by up to ≈ 1.6× between runs on a shared
# machine (2 CPU cores: the probe's per-call time of Square 0.54–0.94 ms against 0.90–0.93 ms in the full attack);
# twice the timed cost keeps the plan above the time taken (tests/test_autoattack_cost.py, test_long_measurements.py)


class Unbreakable(nn.Module):
    """Class 0 for every input, by a margin of 1,000 that no perturbation of an image in [0, 1] can close (its
    logits move by at most 1e-3 per unit of input); counts its calls, those that build a graph for a backward pass,
    and the backward passes that reach its weights (FAB's)."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.calls = self.graph_calls = self.weight_backwards = 0
        with torch.no_grad():
            self.linear.weight.uniform_(-1e-3 / features, 1e-3 / features)
            self.linear.bias.zero_()
            self.linear.bias[0] = 1000.0
        self.linear.weight.register_hook(self._count_backward)

    def _count_backward(self, grad: torch.Tensor) -> None:
        self.weight_backwards += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.graph_calls += int(torch.is_grad_enabled() and x.requires_grad)
        return self.linear(x.flatten(1))


def attack_overheads(images: torch.Tensor, classes: int, norm: str, eps: float, version: str,
                     seed: int = 0) -> dict[str, float]:
    """Seconds of each attack's own work per call, on a batch shaped as ``images``: a few iterations of it on
    :class:`Unbreakable` (whose own pass is a matrix–vector product), timed. The global random generators are left
    as they were."""
    from ..nn.precision import float32_math
    from .attacks import gradients_allowed

    devices = [images.device] if images.is_cuda else []
    with torch.random.fork_rng(devices=devices), gradients_allowed(), float32_math(images.device.type):
        # the attacks seed the global generators: they are left as they were; float32 as the measured attack
        return _overheads(images.detach().clone(), classes, norm, eps, version, seed)  # (not inference tensors)


def _overheads(images: torch.Tensor, classes: int, norm: str, eps: float, version: str, seed: int) -> dict[str, float]:
    from pyautoattack import AutoAttack

    stand_in = Unbreakable(images[0].numel(), classes).to(images.device)
    labels = torch.zeros(len(images), dtype=torch.long, device=images.device)
    overheads = {}
    for name in calls(version, norm):
        attack = AutoAttack(stand_in, norm=norm, eps=eps, version="custom", attacks=[name], seed=seed,
                            device=images.device)
        for apgd in (attack.apgd, attack.apgd_targeted):
            apgd.n_iter, apgd.n_restarts = PROBE_ITERATIONS, 1
        attack.apgd_targeted.n_target_classes = attack.fab.n_target_classes = 1
        attack.fab.n_iter, attack.fab.n_restarts = PROBE_ITERATIONS, 1
        attack.square.n_queries = 4 * PROBE_ITERATIONS
        evaluation = functools.partial(attack.run_standard_evaluation, images, labels, batch_size=len(labels))
        runs = []
        for _ in range(2):
            stand_in.calls = 0
            elapsed = seconds(evaluation, images.device)
            runs.append(elapsed / max(1, stand_in.calls))
        overheads[name] = max(runs)
    return overheads


def network_pass_seconds(network: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(forward and a backward to the input, forward alone) of ``network`` on the batch ``images``, in seconds: the
    slower of two timed passes after a warm-up, with the weights frozen, as every attack runs
    (:func:`~.attacks.survivors`; FAB's backward then stops at the input too)."""
    from .attacks import evaluating, frozen_weights, gradients_allowed, input_gradient

    def forward_backward() -> None:
        input_gradient(network, images, labels)

    def forward() -> None:
        with torch.no_grad():
            network(images)

    times = []
    with gradients_allowed(), evaluating(network), frozen_weights(network):
        for step in (forward_backward, forward):
            step()  # warm-up
            times.append(max(seconds(step, images.device) for _ in range(2)))  # the slower of two
    return times[0], times[1]


def autoattack_seconds(network: nn.Module, images: torch.Tensor, labels: torch.Tensor, points: int, batch_size: int,
                       norm: str, eps: float, version: str, classes: int) -> float:
    """At most how long the official AutoAttack takes on ``points`` points in batches of ``batch_size``: per batch,
    every attack's calls (:data:`CALLS`) times the network's pass on a full batch plus the attack's own work per
    call, times :data:`MARGIN`. ``images``, ``labels``: points of the measurement (the first batch is timed at the
    batch size; fewer points are repeated to it)."""
    size = min(points, batch_size)
    batch, batch_labels = repeated_to(size, images, labels)
    backward, forward = network_pass_seconds(network, batch, batch_labels)
    overheads = attack_overheads(batch, classes, norm, eps, version)
    per_batch = 0.0
    for name, (with_grad, without) in calls(version, norm).items():
        graph_call = forward + classes * (backward - forward) if name in JACOBIAN else backward
        per_batch += with_grad * (graph_call + overheads[name]) + without * (forward + overheads[name])
    return MARGIN * per_batch * math.ceil(points / size)


__all__ = ["CALLS", "CALLS_L1", "JACOBIAN", "Unbreakable", "attack_overheads", "autoattack_seconds", "calls",
           "network_pass_seconds"]
