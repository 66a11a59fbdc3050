"""Training-stability signals every ``log_every_n_steps`` steps: the global gradient norm and one
per transformer block (``stability/grad_norm[/<block>]``), and the largest |activation| at the
output of each block (``stability/act_max/<block>``). Divergence is
:class:`~stability.callbacks.divergence.DivergenceMonitor`'s job."""
from __future__ import annotations

import lightning as L
import torch

from .. import tags
from ..models import residual_sites


class TrainingStability(L.Callback):
    """Args: log_every_n_steps (0: never)."""

    def __init__(self, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be >= 0 (0: never), got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self._activations: dict[str, float] = {}
        self._handles: list = []
        self._blocks: dict = {}
        self._recording = False

    def _measuring(self, trainer) -> bool:
        return self.log_every_n_steps > 0 and trainer.global_step % self.log_every_n_steps == 0

    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.log_every_n_steps:
            return
        self._blocks = {site.name.rpartition(".")[0]: site.block
                        for site in residual_sites(pl_module.network.backbone)}
        self._handles = [block.register_forward_hook(self._record(name)) for name, block in self._blocks.items()]

    def _record(self, name):
        def hook(module, args, out):
            if module.training and self._recording:
                self._activations[name] = float(out.detach().abs().max())
        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recording = self._measuring(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._recording = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._measuring(trainer):
            return
        metrics = {}
        for name, block in self._blocks.items():
            grads = [p.grad.detach().float().pow(2).sum() for p in block.parameters() if p.grad is not None]
            if grads:
                metrics[f"{tags.GRAD_NORM}/{name}"] = float(torch.stack(grads).sum().sqrt())
        squares = [p.grad.detach().float().pow(2).sum() for p in pl_module.parameters() if p.grad is not None]
        if squares:
            metrics[tags.GRAD_NORM] = float(torch.stack(squares).sum().sqrt())
        metrics.update({f"{tags.ACT_MAX}/{k}": v for k, v in self._activations.items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
