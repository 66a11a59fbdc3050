"""Clean, robust and certified accuracy on the same evaluation points, during fit (every
``every_n_epochs`` validations, a small fixed subset of the validation set: ``robust/…``,
``certified/…``) and at test (the whole test split unless ``test_num_points`` limits it:
``test_robust/…``, ``test_certified/…``).

* ``robust/clean`` — clean accuracy on the attacked points;
* ``robust/<attack>_<norm>_<ε>`` — empirical robust accuracy (FGSM, PGD, official AutoAttack,
  torchattacks' AutoAttack as ``autoattack_tap``); ``robust/worst_<norm>_<ε>`` — the share of
  points that survive every attack run at that budget;
* ``certified/acc_<norm>_<ε>`` — certified accuracy from the model's certified Lipschitz bound, at
  the attack budgets and at the ℓ2 radii ``certified_radii``, with the histogram
  ``certified/radius`` of certified radii. Models without a certified bound log nothing here and
  say why once; a local estimate is never used as a certificate.

See :mod:`stability.callbacks.points` for how points are chosen and shared between processes.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from .. import tags
from ..robustness import AttackSettings, AttackSpec, certified_at, certified_radii, evaluate_batch, l2_radius, survivors
from ..robustness.attacks import ATTACKS, accuracies, budget_label, evaluating, worst_case
from ..robustness.autoattack_cost import autoattack_seconds
from ..robustness.batch_memory import memory_sized_batch
from ..robustness.fixed_batch import attacked_network, paid_points
from .bounds import exact_certificate
from .measuring import (
    SHARE_LIMIT,
    EpochShare,
    MeasurementInterrupted,
    Session,
    SharedMeasurements,
    format_seconds,
    results_path,
    seconds_per_point,
    store_key,
)
from .points import dataset_of, has_finite_weights, load, measure_batches, memory_sized, point_count
from .precision import float32_network


class RobustnessMonitor(SharedMeasurements, L.Callback):
    """Args:
        every_n_epochs: validation epochs between evaluations during fit (0: off, also at test).
        num_points: evaluation points during fit (the first of the validation set).
        test_num_points: evaluation points at test (None: the whole test split).
        attacks: during fit (default FGSM and PGD); ``test_attacks`` at test (official AutoAttack too).
        eps: ℓ∞ budgets (pixel scale); ``l2_eps`` ℓ2 budgets (empty: none).
        autoattack_eps: the ℓ∞ budgets AutoAttack (either) runs at; ``autoattack_l2_eps`` its ℓ2 ones.
        autoattack_version: ``standard`` (APGD-CE, APGD-T, FAB-T, Square), ``plus`` or ``rand``.
        attack_num_points: FGSM and PGD run on the first this many evaluation points only (None:
            all); their clean accuracy is logged as ``attack_clean`` — clean and certified accuracy
            always cover every evaluation point.
        autoattack_num_points: AutoAttack runs on the first this many evaluation points only
            (None: as FGSM and PGD); its clean accuracy on them is logged as ``autoattack_clean``.
        certified_radii: ℓ2 radii at which certified accuracy is logged besides the attack budgets.
        pgd_steps: PGD iterations (step size 2.5·ε/steps).
        batch_size: points measured and attacked at once; ``memory``: sized as ``autoattack_batch_size memory``
            below, for the network's pass on all the measured points.
        autoattack_batch_size: points the official AutoAttack (and ``autoattack_tap``) attacks at once (None:
            ``batch_size``). A batch is the unit a stopped test resumes from, so on a CPU, where a batch of points
            that resist takes an hour, smaller batches lose less to a SIGTERM; on a GPU larger ones cost little more
            per batch. The batches' seeds (seed + b) make the numbers depend on it. ``memory``: the largest batch
            whose estimated peak fits half the device's total memory, at most the points
            (:mod:`~stability.robustness.batch_memory`); the same on every run on the same device and network.
        compile: attack through the network compiled at one batch shape (``torch.compile``; each attack's batch
            padded to its batch size: :mod:`~stability.robustness.fixed_batch`): one compilation per measurement
            where attacks leave many shapes, and on a GPU few large kernels in place of one launch per operation.
            The numbers equal the eager ones up to rounding (a point on the edge of its budget can fall the other
            way). Clean and certified accuracy stay eager.
        seed: base seed (batch b uses seed + b).
        max_share: the bound on the evaluations during fit, a share of an epoch's training time (10%: later
            validations are skipped where one costs more, :class:`~stability.callbacks.measuring.EpochShare`; 0:
            every ``every_n_epochs``).
    """

    def __init__(self, every_n_epochs: int = 5, num_points: int = 128, test_num_points: int | None = None,
                 attacks: Sequence[str] = ("fgsm", "pgd"),
                 test_attacks: Sequence[str] = ("fgsm", "pgd", "autoattack"),
                 eps: Sequence[float] = (2 / 255, 4 / 255, 8 / 255), l2_eps: Sequence[float] = (),
                 autoattack_eps: Sequence[float] = (2 / 255,), autoattack_l2_eps: Sequence[float] = (),
                 autoattack_version: str = "standard", attack_num_points: int | None = None,
                 autoattack_num_points: int | None = None,
                 certified_radii: Sequence[float] = (0.1, 0.25, 0.5, 1.0), pgd_steps: int = 10,
                 batch_size: int | Literal["memory"] = 256,
                 autoattack_batch_size: int | Literal["memory"] | None = None,
                 compile: bool = False,
                 seed: int = 0, max_share: float = SHARE_LIMIT) -> None:
        for name in (*attacks, *test_attacks):
            if name not in ATTACKS:
                raise ValueError(f"unknown attack {name!r}; choose from {ATTACKS}")
        if every_n_epochs < 0 or num_points < 1:
            raise ValueError(f"need every_n_epochs >= 0 (0: off) and num_points >= 1; got {every_n_epochs}, "
                             f"{num_points}")
        if batch_size != "memory" and (isinstance(batch_size, str) or batch_size < 1):
            raise ValueError(f"batch_size must be >= 1 or 'memory' (sized by the device's memory), got "
                             f"{batch_size!r}")
        for label, value in (("test_num_points", test_num_points), ("attack_num_points", attack_num_points),
                             ("autoattack_num_points", autoattack_num_points)):
            if value is not None and value < 1:
                raise ValueError(f"{label} must be >= 1 or None (all points), got {value}")
        if autoattack_batch_size is not None and autoattack_batch_size != "memory" and (
                isinstance(autoattack_batch_size, str) or autoattack_batch_size < 1):
            raise ValueError(f"autoattack_batch_size must be >= 1, 'memory' (sized by the device's memory) or None "
                             f"(batch_size), got {autoattack_batch_size!r}")
        if any(r < 0 for r in certified_radii):
            raise ValueError(f"certified_radii must be >= 0, got {list(certified_radii)}")
        self.every_n_epochs, self.num_points, self.test_num_points = every_n_epochs, num_points, test_num_points
        self.attacks, self.test_attacks = tuple(attacks), tuple(test_attacks)
        self.eps, self.l2_eps = tuple(eps), tuple(l2_eps)
        self.autoattack_eps, self.autoattack_l2_eps = tuple(autoattack_eps), tuple(autoattack_l2_eps)
        self.autoattack_version, self.autoattack_num_points = autoattack_version, autoattack_num_points
        self.attack_num_points = attack_num_points
        self.certified_radii, self.pgd_steps, self.batch_size, self.seed = tuple(certified_radii), pgd_steps, \
            batch_size, seed
        self.autoattack_batch_size = batch_size if autoattack_batch_size is None else autoattack_batch_size
        self._autoattack_follows = autoattack_batch_size is None
        self.compile = bool(compile)
        AttackSettings(10, pgd_steps, None, autoattack_version, seed)  # validates the version
        self._said_no_bound = False
        self._sized: dict[tuple, int] = {}  # memory-sized batches, by (what, stage, points)
        self.last_results: dict[str, dict] = {}  # by stage: what was measured last (results.json)
        self._share = EpochShare("--robustness.num_points, --robustness.attacks, --robustness.every_n_epochs",
                                 limit=max_share)

    def specs(self, attacks: Sequence[str]) -> list[AttackSpec]:
        specs = []
        for name in attacks:
            is_autoattack = name.startswith("autoattack")
            specs += [AttackSpec(name, "Linf", e) for e in (self.autoattack_eps if is_autoattack else self.eps)]
            specs += [AttackSpec(name, "L2", e) for e in (self.autoattack_l2_eps if is_autoattack else self.l2_eps)]
        return specs

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not self.measured_now(trainer):
            return
        started = time.perf_counter()
        self._evaluate(trainer, pl_module, trainer.val_dataloaders, self.attacks, self.num_points, "fit")
        self.report_share(trainer, "robustness (fit)", time.perf_counter() - started)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs:
            self._evaluate(trainer, pl_module, trainer.test_dataloaders, self.test_attacks, self.test_num_points,
                           "test")

    def _evaluate(self, trainer, pl_module, loaders, attacks, num_points, stage: tags.Stage) -> None:
        if not has_finite_weights(pl_module):  # a diverged run: nothing to attack
            return
        dataset = dataset_of(loaders)
        count = point_count(dataset, num_points)
        specs = self.specs(attacks)
        attacked = count if self.attack_num_points is None else min(count, self.attack_num_points)
        aa_count = attacked if self.autoattack_num_points is None else min(count, self.autoattack_num_points)
        prefix = {s.label: aa_count if s.name.startswith("autoattack") else attacked for s in specs}
        settings = AttackSettings(pl_module.hparams.num_classes, self.pgd_steps, None, self.autoattack_version,
                                  self.seed)
        with float32_network(pl_module.network) as network:
            bound, reason, exact = exact_certificate(pl_module.stabilizers, network)  # float64: rounding shrinks radii
            batch = self._measured_batch(trainer, network, exact if bound is not None else None, dataset, count,
                                         settings, pl_module.device, stage)
            aa_batch = self._autoattack_batch(trainer, network, dataset, specs, prefix, settings, pl_module.device,
                                              stage, batch)
            store = None
            if stage == "test" and (path := results_path(trainer)) is not None:
                store = path.parent / "measurements" / ("robustness-" + store_key(
                    network, dataset, settings, [(s.label, prefix[s.label]) for s in specs], count, batch,
                    self.certified_radii, aa_batch))
            session = Session.of(trainer, f"robustness ({stage})", store)

            def clean(index: int, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
                out = evaluate_batch(network, images, labels, [], settings, index)  # clean, on every point
                if bound is not None:
                    with evaluating(exact), torch.no_grad():
                        out["radius"] = certified_radii(exact(images.double()), labels, bound)
                return out

            # what each attack calls: compiled, at its batch size, or at its points where they are fewer
            sizes = {s.label: min(self._batch_size(s, aa_batch, batch), prefix[s.label]) for s in specs}
            networks = {size: attacked_network(network, size, self.compile) for size in set(sizes.values())}
            attacked = {label: networks[size] for label, size in sizes.items()}

            def attack(spec: AttackSpec):
                def measure(index: int, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
                    return {spec.label: survivors(attacked[spec.label], images, labels, spec, settings, index)}
                return measure

            batches_of: dict[str, list] = {}
            try:
                name = "clean and certified" if bound is not None else "clean"
                batches_of["clean"] = measure_batches(dataset, count, batch, pl_module.device, clean,
                                                      session, name, exact)
                if specs:
                    self._say_plan(attacked, dataset, specs, prefix, count, settings, pl_module.device, stage,
                                   aa_batch)
                for spec in specs:  # each attack over its points in turn: batch b attacked with seed + b, as ever
                    batches_of[spec.label] = measure_batches(dataset, prefix[spec.label],
                                                             self._batch_size(spec, aa_batch, batch), pl_module.device,
                                                             attack(spec), session, spec.label, attacked[spec.label])
            except MeasurementInterrupted as stopped:
                self._interrupted(trainer, pl_module, stage, stopped, batches_of, count, specs, prefix, bound,
                                  dataset, session, aa_batch, batch)
                return
        session.finished()
        self._record(trainer, pl_module, stage, _concatenated(batches_of), specs, prefix, count, bound, reason,
                     dataset, aa_batch, batch)

    @staticmethod
    def _batch_size(spec: AttackSpec, autoattack_batch: int, batch: int) -> int:
        return autoattack_batch if spec.name.startswith("autoattack") else batch

    def _measured_batch(self, trainer, network: nn.Module, exact: nn.Module | None, dataset, count: int, settings,
                        device, stage: tags.Stage) -> int:
        """The batch of clean and certified accuracy, FGSM and PGD: as set, or (``memory``) as AutoAttack's, and
        within the certificate's float64 forward (``exact``) where there is one."""
        if self.batch_size != "memory":
            return self.batch_size
        key = ("batch", stage, count)
        if key not in self._sized:  # the size depends on the architecture, not on the weights: once per run
            self._sized[key] = self._memory_batch(trainer, network, dataset, count, settings, device, stage,
                                                  "batch_size", "the measurements and attacks take", exact)
        return self._sized[key]

    def _autoattack_batch(self, trainer, network: nn.Module, dataset, specs, prefix, settings, device,
                          stage: tags.Stage, batch: int) -> int:
        """AutoAttack's batch size: as set, or (``memory``) sized by the device's total memory on rank 0 and
        broadcast, so that every process splits the points alike."""
        if self.autoattack_batch_size != "memory":
            return self.autoattack_batch_size
        points = max((prefix[s.label] for s in specs if s.name.startswith("autoattack")), default=0)
        if not points:
            return batch  # no AutoAttack in this measurement
        option = "batch_size" if self._autoattack_follows else "autoattack_batch_size"
        key = ("autoattack", stage, points)
        if key not in self._sized:
            self._sized[key] = self._memory_batch(trainer, network, dataset, points, settings, device, stage, option,
                                                  "AutoAttack attacks")
        return self._sized[key]

    @staticmethod
    def _memory_batch(trainer, network: nn.Module, dataset, points: int, settings, device, stage: tags.Stage,
                      option: str, what: str, exact: nn.Module | None = None) -> int:
        """The largest batch of ``points`` whose estimated peak fits the device's memory
        (:func:`~stability.robustness.batch_memory.memory_sized_batch`), decided on rank 0 and broadcast."""
        def size(images: torch.Tensor, labels: torch.Tensor, share: int, memory: int) -> int:
            return memory_sized_batch(network, images, labels, share, settings.num_classes, memory, exact=exact)

        return memory_sized(trainer, dataset, points, device, size, f"robustness ({stage}): {what}",
                            f"robustness.{option}")

    def _say_plan(self, attacked: dict[str, nn.Module], dataset, specs, prefix, count, settings, device,
                  stage: tags.Stage, autoattack_batch: int) -> None:
        """One line before the first attack: what runs on how many points, an upper bound on its time on this machine
        (FGSM and PGD: one forward and backward pass per point, measured now, times the passes each makes; the
        official AutoAttack: its calls per batch, each the network's pass on the batch and the attack's own work,
        both timed now — :mod:`~stability.robustness.autoattack_cost`), and the options that limit it."""
        images, labels = load(dataset, 0, min(count, 64), device)
        per_pass: dict[int, float] = {}  # per attacked network (id): a forward and backward pass per point
        parts, seconds, official = [], 0.0, {}
        for spec in specs:
            network = attacked[spec.label]
            if id(network) not in per_pass:
                per_pass[id(network)] = seconds_per_point(network, images, labels)
            if spec.name == "autoattack":  # the official one: its calls per batch, timed once per norm and points
                key = (spec.norm, prefix[spec.label])
                if key not in official:  # its cost does not depend on the budget ε
                    official[key] = autoattack_seconds(network, images, labels, prefix[spec.label],
                                                       autoattack_batch, spec.norm, spec.eps,
                                                       settings.autoattack_version, settings.num_classes)
                seconds += official[key]
            else:
                seconds += attack_passes(spec, settings) * paid_points(prefix[spec.label], network) \
                    * per_pass[id(network)]
            parts.append(f"{spec.label} on {prefix[spec.label]}")
        limits = "--robustness.test_num_points, --robustness.attack_num_points, --robustness.autoattack_num_points" \
            if stage == "test" else ("--robustness.num_points, --robustness.every_n_epochs" + (
                f"; during fit at most {self._share.limit * 100:g}% of an epoch's training (--robustness.max_share)"
                if self._share.limit else ""))
        worst = " if every point resists every attack" if any(s.name.startswith("autoattack") for s in specs) else ""
        rank_zero_info(f"robustness ({stage}): {', '.join(parts)} points — at most ≈ {format_seconds(seconds)} on this "
                       f"machine{worst} ({max(per_pass.values()) * 1e3:.3g} ms a forward and backward pass per "
                       f"point); limit it with {limits}")

    def _interrupted(self, trainer, pl_module, stage: tags.Stage, stopped: MeasurementInterrupted,
                     batches_of: dict[str, list], count: int, specs, prefix, bound, dataset, session,
                     autoattack_batch: int, batch: int) -> None:
        """SIGTERM during a measurement. At test: the points measured so far are recorded (each with its number of
        points; results.json says the run is incomplete), the finished batches stay for a rerun to resume from, and
        the run stops (exit status 143). During fit: this validation's measurement is dropped and the fit stops at its
        next step, as Lightning stops it, after the checkpoint of this epoch."""
        done = f"{stopped.name} stopped by SIGTERM after {stopped.points} points"
        if stage != "test":
            rank_zero_info(f"robustness (fit): {done}; this validation's robustness is not logged")
            return
        partial = dict(batches_of)
        if stopped.completed:
            partial[stopped.name] = [stopped.completed[i] for i in sorted(stopped.completed)]
        measured = {label: sum(len(next(iter(b.values()))) for b in parts) for label, parts in partial.items()}
        if "clean" in measured and measured["clean"] == count:
            points = {s.label: measured.get(s.label, 0) for s in specs}
            self._record(trainer, pl_module, stage, _concatenated(partial), [s for s in specs if points[s.label]],
                         points, count, bound, "", dataset, autoattack_batch, batch, log=False)
        else:
            self.last_results[stage] = {"points": measured.get("clean", 0)}
        self.last_results[stage].update(interrupted=done, complete=False)
        rank_zero_info(f"robustness (test): {done}; what was measured is in results.json, and rerunning the same "
                       f"command resumes from the {sum(measured.values())} point-measurements kept in "
                       f"{session.store}")
        raise SIGTERMException

    def _record(self, trainer, pl_module, stage: tags.Stage, masks: dict[str, torch.Tensor], specs, prefix, count,
                bound, reason, dataset, autoattack_batch: int, batch: int, log: bool = True) -> None:
        radii = masks.pop("radius", None)
        attacked = max((prefix[s.label] for s in specs if not s.name.startswith("autoattack")), default=count)
        aa_count = max((prefix[s.label] for s in specs if s.name.startswith("autoattack")), default=attacked)
        input_size = int(torch.as_tensor(dataset[0][0]).numel())
        metrics = accuracies({**masks, **worst_case(masks, specs)})
        if any(not s.name.startswith("autoattack") for s in specs) and attacked < count:
            metrics["attack_clean"] = float(masks["clean"][:attacked].float().mean())
        if any(s.name.startswith("autoattack") for s in specs) and aa_count < count:
            metrics["autoattack_clean"] = float(masks["clean"][:aa_count].float().mean())
        if radii is not None:
            budgets = [("L2", r) for r in self.certified_radii] + [(s.norm, s.eps) for s in specs if s.norm != "L1"]
            for norm, eps in budgets:
                certified = certified_at(radii, l2_radius(norm, eps, input_size))
                metrics[f"acc_{budget_label(norm, eps)}"] = float(certified.float().mean())
        elif not self._said_no_bound and reason:
            rank_zero_info(f"robustness: no certified accuracy is logged ({reason})")
            self._said_no_bound = True
        robust = {f"{tags.group(tags.ROBUST, stage)}/{k}": v for k, v in metrics.items() if not k.startswith("acc_")}
        certified = {f"{tags.group(tags.CERTIFIED, stage)}/{k}": v for k, v in metrics.items()
                     if k.startswith("acc_")}
        self.last_results[stage] = {
            "points": count, "attack_points": attacked,
            "autoattack_points": aa_count if any(s.name.startswith("autoattack") for s in specs) else None,
            "accuracy": {k: v for k, v in metrics.items() if not k.startswith("acc_")},
            "certified": {k[len("acc_"):]: v for k, v in metrics.items() if k.startswith("acc_")},
            "certified_bound": None if bound is None else {"value": bound.value, "label": bound.label,
                                                           "domain": bound.domain},
            "attacks": {s.label: {"attack": s.name, "norm": s.norm, "eps": s.eps, "points": prefix[s.label]}
                        for s in specs},
            "autoattack_version": self.autoattack_version,
            "batch_size": batch,
            "autoattack_batch_size": autoattack_batch if any(s.name.startswith("autoattack") for s in specs) else None,
            "compiled": self.compile,  # the attacks' network (--robustness.compile): equal up to rounding
        }
        if log and trainer.is_global_zero:
            pl_module.log_dict({**robust, **certified}, sync_dist=True, rank_zero_only=True)
            if radii is not None:
                for logger in trainer.loggers:
                    if hasattr(logger.experiment, "add_histogram"):
                        logger.experiment.add_histogram(f"{tags.group(tags.CERTIFIED, stage)}/radius",
                                                        radii.float(), trainer.global_step)


def _concatenated(batches_of: dict[str, list[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Each measurement's per-point values, its batches put end to end: {"clean", "radius", <attack label>: (n,)}."""
    return {key: torch.cat([b[key] for b in parts]) for parts in batches_of.values() if parts
            for key in parts[0]}


def attack_passes(spec: AttackSpec, settings: AttackSettings) -> int:
    """How many forward-and-backward passes FGSM (one), PGD (its steps) and torchattacks' 10-iteration AutoAttack
    (≈ 1,900) make per point at most (points that fall are attacked no further); the official AutoAttack is bounded
    by its calls per batch instead (:mod:`~stability.robustness.autoattack_cost`)."""
    return {"fgsm": 1, "pgd": settings.pgd_steps + 1, "autoattack_tap": 1900}[spec.name]
