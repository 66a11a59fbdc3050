"""Logs Lipschitz measurements during fit (every ``every_n_epochs`` validation) and at test:

* ``lipschitz/local_{mean,median,max}`` — local estimate ‖J_f(x)‖₂ at each point of a fixed
  validation subset (power iteration, a lower bound that tightens with iterations), with a
  histogram; ``lipschitz/local_noembed_*`` the same from the patch embedding on (optional);
* ``lipschitz/lower_bound_max`` — empirical lower bound by gradient ascent in a small ball;
* ``lipschitz/certified_log10`` — a stabilizer's certified global bound, where one exists; when
  none does, nothing is logged and the run says so once;
* ``weights/sigma/<layer>``, ``weights/rms/<layer>`` — σ₁ and RMS→RMS norm of every Linear;
* ``attention/<layer>/<statistic>_h<head>`` — g₁ mean / max, the exact softmax-Jacobian norm on
  sampled rows, entropy and JaSMin's Theorem 3 bound where it applies
  (:mod:`stability.lipschitz.attention`), on the first 16 points of the subset.
"""
from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from ..lipschitz import empirical_lower_bound, jacobian_norm
from ..lipschitz.attention import attention_diagnostics
from ..nn.spectral import rms_scale, spectral_norms
from .subset import first_points, has_finite_weights


class LipschitzMonitor(L.Callback):
    """Args: every_n_epochs (0: off, also at test), num_points of the fixed subset, power
    ``iterations``, ``exclude_patch_embed`` (log that variant too), ``lower_bound``, ``weights``,
    ``attention`` (the per-head diagnostics)."""

    def __init__(self, every_n_epochs: int = 1, num_points: int = 64, iterations: int = 10,
                 exclude_patch_embed: bool = False, lower_bound: bool = True, weights: bool = True,
                 attention: bool = True) -> None:
        if every_n_epochs < 0 or num_points < 1 or iterations < 1:
            raise ValueError(f"need every_n_epochs >= 0 (0: off), num_points >= 1, iterations >= 1; got "
                             f"{every_n_epochs}, {num_points}, {iterations}")
        self.every_n_epochs, self.num_points, self.iterations = every_n_epochs, num_points, iterations
        self.exclude_patch_embed, self.lower_bound, self.weights = exclude_patch_embed, lower_bound, weights
        self.attention = attention
        self._said_no_bound = False

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        self._measure(trainer, pl_module, trainer.val_dataloaders, "lipschitz")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs:
            self._measure(trainer, pl_module, trainer.test_dataloaders, "test_lipschitz")

    def measure(self, pl_module, images: torch.Tensor) -> dict[str, float]:
        """All scalar measurements on ``images`` (no Lightning needed beyond the module)."""
        network = pl_module.network
        metrics: dict[str, float] = {}
        with torch.inference_mode(False), torch.enable_grad():
            images = images.clone()
            local = jacobian_norm(network, images, self.iterations)
            metrics.update(_summary("local", local))
            if self.exclude_patch_embed:
                metrics.update(_summary("local_noembed", jacobian_norm(network, images, self.iterations,
                                                                       exclude_patch_embed=True)))
            if self.lower_bound:
                metrics["lower_bound_max"] = float(empirical_lower_bound(network, images).max())
        self._last_local = local
        bounds = [b for s in pl_module.stabilizers if (b := s.lipschitz_bound(network)) is not None]
        if bounds:
            metrics["certified_log10"] = math.log10(min(bounds))
        elif not self._said_no_bound:
            rank_zero_info("lipschitz: this model has no certified global bound (dot-product attention or "
                           "LayerNorm, or no stabilizer that certifies one); only local estimates are logged")
            self._said_no_bound = True
        return metrics

    def _measure(self, trainer, pl_module, loaders, prefix: str) -> None:
        if not has_finite_weights(pl_module):
            rank_zero_info(f"lipschitz: weights are not finite (the run diverged); {prefix} not measured")
            return
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        images, _ = first_points(loader, self.num_points)
        was_training = pl_module.training
        pl_module.eval()
        try:
            metrics = {f"{prefix}/{k}": v for k, v in self.measure(pl_module, images.to(pl_module.device)).items()}
        finally:
            pl_module.train(was_training)
        if self.attention:
            for layer, stats in attention_diagnostics(pl_module.network, images[:16].to(pl_module.device)).items():
                for stat, values in stats.items():
                    metrics.update({f"attention/{layer}/{stat}_h{h}": float(v) for h, v in enumerate(values)})
        if self.weights:
            linears = {name: m.weight.detach() for name, m in pl_module.network.named_modules()
                       if isinstance(m, torch.nn.Linear)}
            for (name, weight), sigma in zip(linears.items(), spectral_norms(list(linears.values())).tolist()):
                metrics[f"weights/sigma/{name}"] = sigma
                metrics[f"weights/rms/{name}"] = sigma * rms_scale(weight)
        pl_module.log_dict(metrics)
        for logger in trainer.loggers:
            if hasattr(logger.experiment, "add_histogram"):
                logger.experiment.add_histogram(f"{prefix}/local", self._last_local.cpu(), trainer.global_step)


def _summary(name: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{name}_mean": float(values.mean()), f"{name}_median": float(values.median()),
            f"{name}_max": float(values.max())}
