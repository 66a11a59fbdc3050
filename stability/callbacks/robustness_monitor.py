"""Logs clean and robust accuracy on a fixed, seeded evaluation subset: during fit every
``every_n_epochs`` validation (``robust/<attack>_<norm>_<eps>``) and at test (``test_robust/…``),
with FGSM / PGD / AutoAttack (torchattacks) at a list of budgets."""
from __future__ import annotations

from collections.abc import Sequence

import lightning as L

from ..robustness import ATTACKS, AttackSpec, robust_accuracy
from .subset import first_points, has_finite_weights


class RobustnessMonitor(L.Callback):
    """Args:
        every_n_epochs: validation epochs between evaluations (0: off, also at test).
        attacks: during fit (default FGSM and PGD); ``test_attacks`` at test (AutoAttack too).
        eps: ℓ∞ budgets (pixel scale); ``l2_eps`` ℓ2 budgets (empty: none).
        autoattack_eps: the ℓ∞ budgets AutoAttack runs at (it is by far the most expensive;
            the JaSMin paper reports it at 2/255 only).
        pgd_steps: PGD iterations (step size 2.5·ε/steps).
        num_points: size of the evaluation subset (the first points of the loader).
    """

    def __init__(self, every_n_epochs: int = 5, num_points: int = 128, attacks: Sequence[str] = ("fgsm", "pgd"),
                 test_attacks: Sequence[str] = ("fgsm", "pgd", "autoattack"),
                 eps: Sequence[float] = (2 / 255, 4 / 255, 8 / 255), l2_eps: Sequence[float] = (),
                 autoattack_eps: Sequence[float] = (2 / 255,),
                 pgd_steps: int = 10, seed: int = 0) -> None:
        for name in (*attacks, *test_attacks):
            if name not in ATTACKS:
                raise ValueError(f"unknown attack {name!r}; choose from {ATTACKS}")
        if every_n_epochs < 0 or num_points < 1:
            raise ValueError(f"need every_n_epochs >= 0 (0: off) and num_points >= 1; got {every_n_epochs}, "
                             f"{num_points}")
        self.every_n_epochs, self.num_points = every_n_epochs, num_points
        self.attacks, self.test_attacks = tuple(attacks), tuple(test_attacks)
        self.eps, self.l2_eps, self.pgd_steps, self.seed = tuple(eps), tuple(l2_eps), pgd_steps, seed
        self.autoattack_eps = tuple(autoattack_eps)

    def specs(self, attacks: Sequence[str]) -> list[AttackSpec]:
        return ([AttackSpec(a, "Linf", e) for a in attacks
                 for e in (self.autoattack_eps if a == "autoattack" else self.eps)]
                + [AttackSpec(a, "L2", e) for a in attacks if a != "autoattack" for e in self.l2_eps])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        self._evaluate(pl_module, trainer.val_dataloaders, self.attacks, "robust")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs:
            self._evaluate(pl_module, trainer.test_dataloaders, self.test_attacks, "test_robust")

    def _evaluate(self, pl_module, loaders, attacks, prefix: str) -> None:
        if not has_finite_weights(pl_module):  # a diverged run: nothing to attack
            return
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        images, labels = first_points(loader, self.num_points)
        results = robust_accuracy(pl_module.network, images.to(pl_module.device), labels.to(pl_module.device),
                                  self.specs(attacks), pl_module.hparams.num_classes, self.pgd_steps, seed=self.seed)
        pl_module.log_dict({f"{prefix}/{k}": v for k, v in results.items()})
