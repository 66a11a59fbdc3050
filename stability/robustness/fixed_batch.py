"""The network an attack calls, at one batch shape and optionally compiled (``--robustness.compile``).

An attack calls its network hundreds to thousands of times per batch of points, on a changing number of points: the
official AutoAttack runs each of its attacks only on the points that still resist, and an epoch's last batch is
smaller. :class:`FixedBatch` computes ``network(x)`` for any number of points on batches of exactly ``batch_size``:
a smaller input is padded with zero images, a larger one split. In eval mode a network treats each point on its own,
so every point gets the logits (and the input gradient) it gets unpadded, up to the rounding of a kernel that may
block a batch differently. One input shape means one compilation for the whole measurement (``torch.compile``,
``dynamic=False``), where the shapes an attack leaves would each compile again, and on a GPU few large kernels in
place of one launch per operation, which is where a small network's time goes.

The compiled network is torch.compile's: hooks registered on the network's modules after its first call are not
seen by the compiled code. The measurement's own stop check hooks :class:`FixedBatch` itself, which runs eagerly.
"""
from __future__ import annotations

import torch
from torch import nn

BACKEND = "inductor"  # torch.compile's backend for ``compile=True`` (tests use a faster one)
RECOMPILE_LIMIT = 64  # dynamo's cache entries per code object, at least, once a FixedBatch compiles


class FixedBatch(nn.Module):
    """``network(x)`` computed ``batch_size`` points at a time: padded with zeros below, split above.

    Args:
        network: the measured network (eval mode while an attack runs: points independent).
        batch_size: the one batch shape the network sees.
        compile: run the network through ``torch.compile(network, dynamic=False)``, compiled at the first call
            (:meth:`warm_up`: once per kind of forward an attack makes).
        graphs: the kinds of forward :meth:`warm_up` compiles: ``no_grad`` (no gradient), ``weights`` (the weights'
            gradients only) and ``input`` (the input's, with its backward); a measurement that makes fewer kinds
            compiles only those.
    """

    GRAPHS = ("no_grad", "weights", "input")

    def __init__(self, network: nn.Module, batch_size: int, compile: bool = False,
                 graphs: tuple[str, ...] = GRAPHS) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"FixedBatch needs batch_size >= 1, got {batch_size}")
        if not graphs or set(graphs) - set(self.GRAPHS):
            raise ValueError(f"FixedBatch graphs must be among {list(self.GRAPHS)}, got {list(graphs)}")
        self.graphs = tuple(graphs)
        self.network, self.batch_size = network, int(batch_size)
        self.train(network.training)  # a new module starts in train mode: restoring its mode must not change the net
        if compile:
            # the network's forward is one code object for every compiled use: training (--model.compile), and
            # three graphs per batch size here, for the attacks and the Lipschitz estimates (--lipschitz.compile: two
            # sizes), at fit and again at test; past torch's limit (8) dynamo would quietly run it eagerly
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # not a submodule: the compiled wrapper shares the network's parameters and must not list them twice
        self.__dict__["_run"] = torch.compile(network, backend=BACKEND, dynamic=False) if compile else network
        self._warm = self._compiled = bool(compile)

    def warm_up(self, example: torch.Tensor) -> None:
        """Compile every graph an attack calls now, on zero images shaped like ``example``'s: the forward without
        gradients, with the weights' gradients only, and with the input's too, with its backward. Done at the first
        call, so that nothing compiles inside an attack: the official AutoAttack's check for dynamic defences traces
        the first forward it runs and counts calls named ``backward`` or ``grad``, which compiling a backward makes;
        its counter is never reset, so it would warn at every later run in the process."""
        from .attacks import evaluating, frozen_weights, gradients_allowed

        self._warm = False
        zeros = example.detach().new_zeros(self.batch_size, *example.shape[1:])
        with gradients_allowed(), evaluating(self), frozen_weights(self.network):  # as every compiled call runs
            if "no_grad" in self.graphs:
                with torch.no_grad():
                    self._run(zeros)
            if "weights" in self.graphs:
                self._run(zeros)  # an input that needs no gradient is a graph of its own
            if "input" in self.graphs:
                x = zeros.clone().requires_grad_(True)
                torch.autograd.grad(self._run(x).sum(), x)

    def _frozen(self):
        """Compiled, the network's weights need no gradient while its graph runs (:func:`~.attacks.frozen_weights`):
        torch does not recompile when a weight's ``requires_grad`` changes, so a graph compiled with the weights
        trainable would compute their gradients in every backward, and one compiled frozen would fail a caller that
        asks for them. Every compiled call is frozen (measurements differentiate with respect to their inputs only);
        the autograd graph it builds keeps that, whatever the weights need after it."""
        from .attacks import frozen_weights

        return frozen_weights(self.network, self._compiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(x):
            return self.network(x)
        if self._warm:
            self.warm_up(x)
        size = self.batch_size
        outputs = []
        for start in range(0, len(x), size):
            part = x[start:start + size]
            missing = size - len(part)
            if missing:
                part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
            with self._frozen():
                out = self._run(part)
            outputs.append(out[:size - missing] if missing else out)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def paid_points(points: int, network: nn.Module) -> int:
    """The points an attack's passes cost on ``network``: a :class:`FixedBatch` pays its whole batch for the last,
    smaller one."""
    if not isinstance(network, FixedBatch):
        return points
    return -(-points // network.batch_size) * network.batch_size


def repeated_to(size: int, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` of ``images`` and ``labels`` repeated end to end: a batch of ``size`` points to time or
    count a pass on, from however many points are at hand."""
    index = torch.arange(size, device=labels.device) % len(labels)
    return images[index], labels[index]


def attacked_network(network: nn.Module, batch_size: int, compile: bool) -> nn.Module:
    """What an attack on batches of ``batch_size`` calls: ``network`` itself (eager, every shape as it comes), or,
    compiled, the network at that one batch shape (:class:`FixedBatch`)."""
    return FixedBatch(network, batch_size, compile=True) if compile else network


__all__ = ["BACKEND", "RECOMPILE_LIMIT", "FixedBatch", "attacked_network", "paid_points", "repeated_to"]
