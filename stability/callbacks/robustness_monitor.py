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

from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .. import tags
from ..robustness import AttackSettings, AttackSpec, certified_at, certified_radii, evaluate_batch, l2_radius, survivors
from ..robustness.attacks import ATTACKS, accuracies, budget_label, evaluating, worst_case
from .bounds import exact_certificate
from .points import dataset_of, has_finite_weights, measure_batches, point_count
from .precision import float32_network


class RobustnessMonitor(L.Callback):
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
        batch_size: points attacked at once.
        seed: base seed (batch b uses seed + b).
    """

    def __init__(self, every_n_epochs: int = 5, num_points: int = 128, test_num_points: int | None = None,
                 attacks: Sequence[str] = ("fgsm", "pgd"),
                 test_attacks: Sequence[str] = ("fgsm", "pgd", "autoattack"),
                 eps: Sequence[float] = (2 / 255, 4 / 255, 8 / 255), l2_eps: Sequence[float] = (),
                 autoattack_eps: Sequence[float] = (2 / 255,), autoattack_l2_eps: Sequence[float] = (),
                 autoattack_version: str = "standard", attack_num_points: int | None = None,
                 autoattack_num_points: int | None = None,
                 certified_radii: Sequence[float] = (0.1, 0.25, 0.5, 1.0), pgd_steps: int = 10,
                 batch_size: int = 256, seed: int = 0) -> None:
        for name in (*attacks, *test_attacks):
            if name not in ATTACKS:
                raise ValueError(f"unknown attack {name!r}; choose from {ATTACKS}")
        if every_n_epochs < 0 or num_points < 1 or batch_size < 1:
            raise ValueError(f"need every_n_epochs >= 0 (0: off), num_points >= 1 and batch_size >= 1; got "
                             f"{every_n_epochs}, {num_points}, {batch_size}")
        for label, value in (("test_num_points", test_num_points), ("attack_num_points", attack_num_points),
                             ("autoattack_num_points", autoattack_num_points)):
            if value is not None and value < 1:
                raise ValueError(f"{label} must be >= 1 or None (all points), got {value}")
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
        AttackSettings(10, pgd_steps, None, autoattack_version, seed)  # validates the version
        self._said_no_bound = False
        self.last_results: dict[str, dict] = {}  # by stage: what was measured last (results.json)

    def specs(self, attacks: Sequence[str]) -> list[AttackSpec]:
        specs = []
        for name in attacks:
            is_autoattack = name.startswith("autoattack")
            specs += [AttackSpec(name, "Linf", e) for e in (self.autoattack_eps if is_autoattack else self.eps)]
            specs += [AttackSpec(name, "L2", e) for e in (self.autoattack_l2_eps if is_autoattack else self.l2_eps)]
        return specs

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        self._evaluate(trainer, pl_module, trainer.val_dataloaders, self.attacks, self.num_points, "fit")

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

            def measure(index: int, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
                start = index * self.batch_size
                out = evaluate_batch(network, images, labels, [], settings, index)  # clean, on every point
                for spec in specs:  # each attack on the points of this batch inside its prefix
                    inside = max(0, min(len(labels), prefix[spec.label] - start))
                    if inside:
                        out[spec.label] = survivors(network, images[:inside], labels[:inside], spec, settings, index)
                if bound is not None:
                    with evaluating(exact), torch.no_grad():
                        out["radius"] = certified_radii(exact(images.double()), labels, bound)
                return out

            batches = measure_batches(dataset, count, self.batch_size, pl_module.device, measure)
        masks = {key: torch.cat([b[key] for b in batches if key in b])
                 for key in dict.fromkeys(k for b in batches for k in b) if key != "radius"}
        input_size = int(torch.as_tensor(dataset[0][0]).numel())
        metrics = accuracies({**masks, **worst_case(masks, specs)})
        if any(not s.name.startswith("autoattack") for s in specs) and attacked < count:
            metrics["attack_clean"] = float(masks["clean"][:attacked].float().mean())
        if any(s.name.startswith("autoattack") for s in specs) and aa_count < count:
            metrics["autoattack_clean"] = float(masks["clean"][:aa_count].float().mean())
        radii = torch.cat([b["radius"] for b in batches]) if bound is not None else None
        if radii is not None:
            budgets = [("L2", r) for r in self.certified_radii] + [(s.norm, s.eps) for s in specs if s.norm != "L1"]
            for norm, eps in budgets:
                certified = certified_at(radii, l2_radius(norm, eps, input_size))
                metrics[f"acc_{budget_label(norm, eps)}"] = float(certified.float().mean())
        elif not self._said_no_bound:
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
        }
        if trainer.is_global_zero:
            pl_module.log_dict({**robust, **certified}, sync_dist=True, rank_zero_only=True)
            if radii is not None:
                for logger in trainer.loggers:
                    if hasattr(logger.experiment, "add_histogram"):
                        logger.experiment.add_histogram(f"{tags.group(tags.CERTIFIED, stage)}/radius",
                                                        radii.float(), trainer.global_step)
