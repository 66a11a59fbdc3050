"""Logs Lipschitz measurements during fit (every ``every_n_epochs`` validation, on a fixed subset of
the validation set) and at test (the whole test split unless ``test_num_points`` limits it):

* ``lipschitz/local_{mean,median,max}`` — local estimate ‖J_f(x)‖₂ at each point, with a histogram: by
  default (``method="auto"``) the exact norm of the full Jacobian where the network has at most 2 · ``iterations``
  logits (10 classes: one vector–Jacobian product per logit, the fused attention kept), else power iteration (a
  lower bound of the local norm that tightens with iterations);
  ``lipschitz/local_noembed_*`` the same from the patch embedding on (optional);
* ``lipschitz/lower_bound_max`` — empirical lower bound by gradient ascent in a small ball;
* ``lipschitz/certified_log10`` — the model's certified global bound, where one exists; when none
  does, nothing is logged and the run says so once; ``lipschitz/certified_tightness`` — the bound
  over the largest local estimate (1 would be tight);
* ``weights/sigma/<layer>``, ``weights/rms/<layer>`` — σ₁ and RMS→RMS norm of every Linear;
* ``attention/<layer>/<statistic>`` — per-layer aggregates over heads of JaSMin's diagnostics (means
  of the ``*_mean`` statistics and the entropy, maxima of the others) on the first
  ``attention_points`` points, and a histogram ``attention/<layer>/g1`` of g₁ over every row;
  ``per_head`` adds ``attention/<layer>/<statistic>_h<head>``.

Points are measured in fixed batches shared between processes (:mod:`stability.callbacks.points`),
in float32 whatever the training precision; the weights once, on the first process.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Literal, NamedTuple

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .. import tags
from ..lipschitz import empirical_lower_bound, jacobian_norm, jacobian_norm_one_pass
from ..lipschitz.attention import MEAN_STATISTICS, point_statistics, pool
from ..lipschitz.local import METHODS, local_method
from ..lipschitz.pairs import certified_pair_constants, margin_lower_bound
from ..nn.spectral import rms_scale, spectral_norms
from ..robustness.attacks import evaluating, frozen_weights, gradients_allowed, input_gradient
from ..robustness.batch_memory import largest_batch, unit_bytes
from ..robustness.fixed_batch import FixedBatch
from ..testing.profiling import saved_for_backward
from .bounds import exact_certificate
from .measuring import (
    SHARE_LIMIT,
    EpochShare,
    MeasurementInterrupted,
    Session,
    SharedMeasurements,
    results_path,
    store_key,
)
from .points import dataset_of, has_finite_weights, measure_batches, memory_sized, point_count
from .precision import float32_network


def _saved_by(unit, images: torch.Tensor, _labels: torch.Tensor) -> int:
    return saved_for_backward(functools.partial(unit, images))


ONE_PASS_ROWS = 2 ** 15  # the one-pass estimate's fixed batch at most (K copies a point; larger inputs are split):
#                         fused attention kernels have failed past 65,535 rows on CUDA


class CompiledPasses(NamedTuple):
    """``--lipschitz.compile``'s networks: ``local`` at K·B points (the one-pass exact estimate), ``points`` at B."""

    local: FixedBatch
    points: FixedBatch
    num_logits: int


COPIES = 12  # input-sized buffers a point keeps beside the graph: x, v, Jᵀu, δ; the pairs' x₁, x₂, their gradients,
#             Adam's four moments, the pairs kept


class LipschitzMonitor(SharedMeasurements, L.Callback):
    """Args: every_n_epochs (0: off, also at test), num_points during fit, test_num_points at test
    (None: all), ``method`` of the local estimate (``auto``, ``exact`` or ``power``: module doc) and its power
    ``iterations``, ``exclude_patch_embed`` (log that variant too), ``lower_bound``,
    ``weights``, ``attention`` (the diagnostics) on ``attention_points`` points, ``per_head`` scalars,
    ``batch_size`` points per batch (``memory``: the largest whose estimated peak fits half the device's memory,
    from the bytes the largest of the measurements' units of work saves per point, :meth:`_units`,
    :mod:`~stability.robustness.batch_memory`; the batches' seeds make the numbers depend on it); ``pair_points``: at
    test, the margins' global lower bound by gradient ascent on pairs from that many points (GloRo's tool,
    ``pair_steps`` Adam steps; 0: off), against the certified per-pair constants (``margin_lower_bound``,
    ``margin_bound``, ``margin_tightness``); ``compile``: the exact local estimate as one forward and one backward
    pass over K copies of each point (:func:`~stability.lipschitz.local.jacobian_norm_one_pass`) and the lower
    bound's ascent, each through the network compiled at one batch shape
    (:class:`~stability.robustness.fixed_batch.FixedBatch`): on a GPU few large kernels in place of one launch per
    operation, the numbers equal up to rounding. Power iteration (its double backward), the variant from the patch
    embedding (a hook inside the network) and the attention diagnostics stay eager. ``max_share``: the bound on the
    measurements at validation during fit, a share of an epoch's training time (10%: later validations are skipped
    where one costs more, :class:`~stability.callbacks.measuring.EpochShare`; 0: every ``every_n_epochs``)."""

    def __init__(self, every_n_epochs: int = 1, num_points: int = 64, test_num_points: int | None = None,
                 iterations: int = 10, exclude_patch_embed: bool = False, lower_bound: bool = True,
                 weights: bool = True, attention: bool = True, attention_points: int = 16, per_head: bool = False,
                 batch_size: int | Literal["memory"] = 64, pair_points: int = 0, pair_steps: int = 200,
                 method: Literal["auto", "exact", "power"] = "auto", compile: bool = False,
                 max_share: float = SHARE_LIMIT) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        self.method, self.compile = method, bool(compile)
        self._said_eager = False
        if pair_points < 0 or pair_steps < 1:
            raise ValueError(f"need pair_points >= 0 (0: off) and pair_steps >= 1; got {pair_points}, {pair_steps}")
        self.pair_points, self.pair_steps = pair_points, pair_steps
        if every_n_epochs < 0 or num_points < 1 or iterations < 1 or attention_points < 1:
            raise ValueError(f"need every_n_epochs >= 0 (0: off), num_points >= 1, iterations >= 1 and "
                             f"attention_points >= 1; got {every_n_epochs}, {num_points}, {iterations}, "
                             f"{attention_points}")
        if batch_size != "memory" and (isinstance(batch_size, str) or batch_size < 1):
            raise ValueError(f"batch_size must be >= 1 or 'memory' (sized by the device's memory), got "
                             f"{batch_size!r}")
        if test_num_points is not None and test_num_points < 1:
            raise ValueError(f"test_num_points must be >= 1 or None (all points), got {test_num_points}")
        self.every_n_epochs, self.num_points, self.test_num_points = every_n_epochs, num_points, test_num_points
        self.iterations, self.batch_size = iterations, batch_size
        self.exclude_patch_embed, self.lower_bound, self.weights = exclude_patch_embed, lower_bound, weights
        self.attention, self.attention_points, self.per_head = attention, attention_points, per_head
        self._said_no_bound = False
        self._sized: dict[tuple, int] = {}  # memory-sized batches, by (stage, points, pairs)
        self.last_results: dict[str, dict] = {}  # by stage: what was measured last (results.json)
        self._share = EpochShare("--lipschitz.num_points, --lipschitz.attention_points, --lipschitz.pair_points, "
                                 "--lipschitz.every_n_epochs", limit=max_share)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not self.measured_now(trainer):
            return
        started = time.perf_counter()
        self._measure(trainer, pl_module, trainer.val_dataloaders, self.num_points, "fit")
        self.report_share(trainer, "lipschitz (fit)", time.perf_counter() - started)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs:
            self._measure(trainer, pl_module, trainer.test_dataloaders, self.test_num_points, "test")

    def measure_points(self, network: torch.nn.Module, index: int, images: torch.Tensor,
                       compiled: CompiledPasses | None = None, method: str | None = None) -> dict[str, torch.Tensor]:
        """The per-point measurements of one batch (no Lightning needed); ``compiled``: the exact local estimate and
        the lower bound through these fixed-batch networks; ``method``: the local estimate's, resolved (default: the
        monitor's ``method``, ``auto`` resolved from the network's outputs)."""
        method = method or self.method
        out = {}
        with gradients_allowed(), evaluating(network):
            images = images.clone()
            if compiled is not None:
                with evaluating(compiled.local), frozen_weights(network):
                    out["local"] = jacobian_norm_one_pass(compiled.local, images, compiled.num_logits)
            else:
                out["local"] = jacobian_norm(network, images, self.iterations, method, seed=index)
            if self.exclude_patch_embed and hasattr(network.backbone, "patch_embed"):  # not the convolutional anchor
                out["local_noembed"] = jacobian_norm(network, images, self.iterations, method,
                                                     exclude_patch_embed=True, seed=index)
            if self.lower_bound:
                ascended = network if compiled is None else compiled.points
                with evaluating(ascended), frozen_weights(network, compiled is not None):
                    out["lower_bound"] = empirical_lower_bound(ascended, images, seed=index)
        return out

    def _jacobian_rows(self, method: str, num_logits: int) -> int:
        """Input-sized rows a point keeps beside :data:`COPIES` for the exact local estimate: its K Jacobian rows, and
        compiled (one pass) the K copies of the point and their gradients too."""
        if method != "exact":
            return 0
        return 2 * num_logits if self.compile else num_logits

    def _compiled_passes(self, network: torch.nn.Module, method: str, num_logits: int, batch: int,
                         count: int) -> CompiledPasses | None:
        """The fixed-batch compiled networks of ``--lipschitz.compile`` (None: eager), kept from one measurement to
        the next while the network and the sizes are the same (their warm-up runs once); said once where the local
        estimate cannot be compiled."""
        if not self.compile:
            return None
        if method != "exact":
            if not self._said_eager:
                why = ("--lipschitz.method power" if self.method == "power" else
                       f"{num_logits} logits > 2 × {self.iterations} iterations: --lipschitz.method exact forces it")
                rank_zero_info(f"lipschitz: --lipschitz.compile runs the exact local estimate compiled; this one is "
                               f"power iteration ({why}), which stays eager")
                self._said_eager = True
            return None
        points = min(batch, count)
        rows = min(points * num_logits, max(num_logits, ONE_PASS_ROWS // num_logits * num_logits))
        kept = self.__dict__.get("_kept_passes")
        if kept is not None and kept[0] is network and kept[1] == (rows, points, num_logits):
            return kept[2]
        passes = CompiledPasses(FixedBatch(network, rows, compile=True, graphs=("input",)),
                                FixedBatch(network, points, compile=True, graphs=("no_grad", "input")), num_logits)
        self.__dict__["_kept_passes"] = (network, (rows, points, num_logits), passes)
        return passes

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_kept_passes"}  # compiled wrappers do not pickle

    def _measure(self, trainer, pl_module, loaders, num_points, stage: tags.Stage) -> None:
        if not has_finite_weights(pl_module):
            rank_zero_info(f"lipschitz: weights are not finite (the run diverged); {stage} not measured")
            return
        dataset = dataset_of(loaders)
        count = point_count(dataset, num_points)
        method = local_method(self.method, pl_module.hparams.num_classes, self.iterations)
        with float32_network(pl_module.network) as network:
            bound, reason, exact = exact_certificate(pl_module.stabilizers, network)  # float64, rounded outward
            pairs = stage == "test" and self.pair_points and bound is not None and bound.value > 0
            batch = self._measured_batch(trainer, network, exact if pairs else None, dataset, count,
                                         pl_module.device, stage,
                                         exact_logits=pl_module.hparams.num_classes if method == "exact" else 0)
            store = None
            if stage == "test" and (path := results_path(trainer)) is not None:
                store = path.parent / "measurements" / ("lipschitz-" + store_key(
                    network, dataset, self.method, self.compile, self.iterations, self.exclude_patch_embed,
                    self.lower_bound, self.attention, self.attention_points, self.pair_points, self.pair_steps, count,
                    batch))
            session = Session.of(trainer, f"lipschitz ({stage})", store)
            compiled = self._compiled_passes(network, method, pl_module.hparams.num_classes, batch, count)
            # the stop check hooks the fixed-batch wrappers where compiled: a hook on the network itself would be a new
            # hook inside its compiled graph (a recompilation each measurement)
            stop_checked = network if compiled is None else [compiled.local, compiled.points]
            try:
                batches = measure_batches(
                    dataset, count, batch, pl_module.device,
                    lambda index, images, _: self.measure_points(network, index, images, compiled, method),
                    session, f"local Lipschitz estimates ({method}{', compiled' if compiled else ''})",
                    stop_checked)
            except MeasurementInterrupted as stopped:
                self._interrupted(stage, stopped, count)
                return
            values = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
            metrics: dict[str, float] = {}
            for key in ("local", "local_noembed"):
                if key in values:
                    metrics.update(_summary(key, values[key]))
            if "lower_bound" in values:
                metrics["lower_bound_max"] = float(values["lower_bound"].max())
            metrics.update({f"{name}_bound_log10": math.log10(value) for stab in pl_module.stabilizers
                            for name, value in stab.labelled_bounds(network).items() if value > 0})
            if bound is not None and bound.value > 0:  # 0: a constant network (a zero-initialised head)
                metrics["certified_log10"] = math.log10(bound.value)
                metrics["certified_tightness"] = bound.value / float(values["local"].max())
                if stage == "test" and self.pair_points:
                    try:
                        metrics.update(self._pairs(dataset, count, network, bound, exact, pl_module, session,
                                                   batch))
                    except MeasurementInterrupted as stopped:
                        self._interrupted(stage, stopped, count)
                        return
            elif bound is None and not self._said_no_bound:
                rank_zero_info(f"lipschitz: this model has no certified global bound ({reason}); only local "
                               f"estimates are logged")
                self._said_no_bound = True
            logged = {f"{tags.group(tags.LIPSCHITZ, stage)}/{k}": v for k, v in metrics.items()}
            histograms = {f"{tags.group(tags.LIPSCHITZ, stage)}/local": values["local"]}
            if self.attention:
                attention_count = min(count, self.attention_points)
                def diagnostics(index, images, _):
                    with evaluating(network):
                        return point_statistics(network, images)

                try:
                    per_point = measure_batches(dataset, attention_count, batch, pl_module.device,
                                                diagnostics, session, "attention diagnostics", network)
                except MeasurementInterrupted as stopped:
                    self._interrupted(stage, stopped, count)
                    return
                attention, rows = self._attention(per_point)
                logged.update(attention)
                histograms.update(rows)
            if self.weights and trainer.is_global_zero:
                logged.update(_weight_norms(network))
        session.finished()
        self.last_results[stage] = {
            "points": count, "batch_size": batch,
            "local_method": method, "compiled": self.compile and method == "exact", **metrics,
            "certified_bound": None if bound is None else {"value": bound.value, "label": bound.label,
                                                           "domain": bound.domain}}
        if trainer.is_global_zero:
            pl_module.log_dict(logged, sync_dist=True, rank_zero_only=True)
            for logger in trainer.loggers:
                if hasattr(logger.experiment, "add_histogram"):
                    for tag, value in histograms.items():
                        logger.experiment.add_histogram(tag, value.float(), trainer.global_step)

    def _measured_batch(self, trainer, network: torch.nn.Module, exact: torch.nn.Module | None, dataset, count: int,
                        device, stage: tags.Stage, exact_logits: int = 0) -> int:
        """The batch size: as set, or (``memory``) the largest whose estimate fits the device's memory, from the
        bytes the largest of the measurements' units of work saves (:meth:`_units`), counted on rank 0 and
        broadcast; ``exact_logits``: K where the local estimate is the exact norm, whose rows a point keeps
        (:meth:`_jacobian_rows`), 0 where it is power iteration."""
        if self.batch_size != "memory":
            return self.batch_size
        key = (stage, count, exact is not None, exact_logits)
        if key not in self._sized:  # the size depends on the architecture, not on the weights: once per run
            self._sized[key] = self._memory_batch(trainer, network, exact, dataset, count, device, stage,
                                                  exact_logits)
        return self._sized[key]

    def _memory_batch(self, trainer, network: torch.nn.Module, exact: torch.nn.Module | None, dataset, count: int,
                      device, stage: tags.Stage, exact_logits: int = 0) -> int:
        def size(images: torch.Tensor, labels: torch.Tensor, share: int, memory: int) -> int:
            one_pass = exact_logits if self.compile else 0
            estimates = [unit_bytes(functools.partial(_saved_by, unit), images, labels)
                         for unit in self._units(network, exact, one_pass)]
            per_point, fixed = max(e[0] for e in estimates), max(e[1] for e in estimates)
            rows = COPIES + self._jacobian_rows("exact", exact_logits)
            copies = rows * images[0].numel() * images.element_size()
            return largest_batch(per_point, fixed, copies, share, memory)

        return memory_sized(trainer, dataset, count, device, size, f"lipschitz ({stage}):", "lipschitz.batch_size")

    def _units(self, network: torch.nn.Module, exact: torch.nn.Module | None = None, one_pass: int = 0) -> list:
        """The measurements' units of work on a batch, one graph each (the peak is the largest, not their sum): a
        local estimate by power iteration (the network's graph, its attention maps materialised, and a differentiable
        vector–Jacobian product's: at least what the exact method's graph, on the fused kernels, holds), a step of
        the lower bound's ascent (a forward and backward pass) and, where the pairs run (``exact`` given), a step of
        their ascent (two graphs at once) and their float64 evaluation on ``exact``
        (counted with its graph: at least what it holds without one). The attention diagnostics keep no graph; the
        maps they compute are those the local estimate's graph holds. ``one_pass`` (K, with ``compile``): the compiled
        exact estimate's graph too, K copies of each point in one forward pass."""
        def local(x: torch.Tensor) -> None:
            with gradients_allowed(), evaluating(network):
                jacobian_norm(network, x, 1)

        def ascent_step(x: torch.Tensor) -> None:
            with gradients_allowed(), evaluating(network):
                input_gradient(network, x, torch.zeros(len(x), dtype=torch.long, device=x.device))

        def pair_step(x: torch.Tensor) -> None:
            with gradients_allowed(), evaluating(network):
                margin_lower_bound(network, x, 1)

        def float64_pairs(x: torch.Tensor) -> None:
            with gradients_allowed(), evaluating(exact):
                x = x.double().requires_grad_(True)
                exact(x), exact(x.flip(0))

        def local_one_pass(x: torch.Tensor) -> None:
            with gradients_allowed(), evaluating(network):
                jacobian_norm_one_pass(network, x, one_pass)

        return ([local, ascent_step] + ([local_one_pass] if one_pass else [])
                + ([pair_step, float64_pairs] if exact is not None else []))

    def _pairs(self, dataset, count: int, network, bound, exact, pl_module, session,
               batch: int) -> dict[str, float]:
        """The margins' lower bound from pairs against the certified per-pair constants (lipschitz/pairs.py): the
        ascent runs on the measured network, each point's best pair is evaluated again on the certificate's float64
        copy ``exact``."""
        k = certified_pair_constants(bound, pl_module.hparams.num_classes)

        def ascent(index, images, _):
            with evaluating(network), evaluating(exact):
                ratio, pair = margin_lower_bound(network, images, self.pair_steps, seed=index, exact=exact)
            return {"ratio": ratio, "pair": pair}

        batches = measure_batches(dataset, min(count, self.pair_points), batch, pl_module.device, ascent,
                                  session, "margin lower bound (pairs)", network)
        ratio = torch.cat([b["ratio"] for b in batches]).double()
        pair = torch.cat([b["pair"] for b in batches])
        certified_of_pair = k[pair[:, 0].cpu(), pair[:, 1].cpu()]
        best = int(ratio.argmax())
        return {"margin_lower_bound": float(ratio[best]), "margin_bound": float(k.max()),
                "margin_tightness": float(k.max() / ratio[best]) if ratio[best] > 0 else float("inf"),
                "margin_pair_tightness_min": float((certified_of_pair / ratio.clamp_min(1e-300)).min())}

    def _interrupted(self, stage: tags.Stage, stopped: MeasurementInterrupted, count: int) -> None:
        """SIGTERM during a measurement: during fit, this validation's estimates are dropped (the fit stops at its next
        step); at test, the run stops (exit 143) with what was measured said in results.json, and a rerun resumes from
        the finished batches."""
        done = f"{stopped.name} stopped by SIGTERM after {stopped.points} of {count} points"
        rank_zero_info(f"lipschitz ({stage}): {done}" + ("; not logged" if stage != "test" else ""))
        if stage == "test":
            self.last_results[stage] = {"points": stopped.points, "interrupted": done, "complete": False}
            raise SIGTERMException

    def _attention(self, per_point: list[dict[str, dict[str, torch.Tensor]]]
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Per-layer aggregates over heads (and per-head scalars with ``per_head``), and the g₁ rows."""
        scalars, rows = {}, {}
        for layer in per_point[0]:
            stats = {stat: torch.cat([b[layer][stat] for b in per_point]) for stat in per_point[0][layer]}
            heads = pool(stats)  # (H,) each
            for stat, values in heads.items():
                reduced = values.mean() if stat in MEAN_STATISTICS else values.max()
                scalars[f"{tags.ATTENTION}/{layer}/{stat}"] = float(reduced)
                if self.per_head:
                    scalars.update({f"{tags.ATTENTION}/{layer}/{stat}_h{h}": float(v) for h, v in enumerate(values)})
            rows[f"{tags.ATTENTION}/{layer}/g1"] = stats["g1_rows"].flatten()
        return scalars, rows


def _weight_norms(network: torch.nn.Module) -> dict[str, float]:
    """σ₁ and RMS→RMS norm of the weight every Linear multiplies by (the effective one where a layer rescales its
    parameter: AOL, last-layer normalisation)."""
    linears = {name: (m.effective_weight() if hasattr(m, "effective_weight") else m.weight).detach()
               for name, m in network.named_modules() if isinstance(m, torch.nn.Linear)}
    metrics = {}
    for (name, weight), sigma in zip(linears.items(), spectral_norms(list(linears.values())).tolist()):
        metrics[f"{tags.WEIGHTS}/sigma/{name}"] = sigma
        metrics[f"{tags.WEIGHTS}/rms/{name}"] = sigma * rms_scale(weight)
    return metrics


def _summary(name: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{name}_mean": float(values.mean()), f"{name}_median": float(values.median()),
            f"{name}_max": float(values.max())}
