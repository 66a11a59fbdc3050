"""Training-stability signals: gradient norms (global, per block), max |activation| per block,
loss spikes, the time the training steps of an epoch took (``time/train_epoch_s``: forward,
backward and optimizer step, without data loading, validation or measurements), and divergence —
a non-finite loss or a task loss above ``divergence_factor`` × its running value stops the run
cleanly and records where and why (a result, not a crash)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from ..models import residual_sites


@dataclass
class DivergenceDetector:
    """Running loss (exponential average with ``beta``), spike count, divergence verdict.

    The reference is max(running loss, ``min_reference``), so that a loss near zero late in
    training does not turn ordinary noise into "spikes". A loss above ``spike_factor`` ×
    reference counts as a spike; a non-finite loss or one above ``divergence_factor`` ×
    reference is divergence. The first ``warmup_steps`` losses only feed the running value."""

    spike_factor: float = 3.0
    divergence_factor: float = 100.0
    beta: float = 0.9
    warmup_steps: int = 5
    min_reference: float = 0.1
    running: Optional[float] = None
    steps: int = 0
    spikes: int = 0
    diverged_at_step: Optional[int] = None
    reason: str = ""
    history: list = field(default_factory=list, repr=False)

    def update(self, loss: float, step: int) -> bool:
        """Feed one loss; True when the run has diverged."""
        self.steps += 1
        if not math.isfinite(loss):
            self.diverged_at_step, self.reason = step, f"non-finite loss ({loss})"
            return True
        if self.running is not None and self.steps > self.warmup_steps:
            reference = max(self.running, self.min_reference)
            if loss > self.divergence_factor * reference:
                self.diverged_at_step = step
                self.reason = f"loss {loss:.4g} > {self.divergence_factor:g} × running loss {reference:.4g}"
                return True
            if loss > self.spike_factor * reference:
                self.spikes += 1
        self.running = loss if self.running is None else self.beta * self.running + (1 - self.beta) * loss
        return False


class TrainingStability(L.Callback):
    """Logs ``stability/*`` every ``log_every_n_steps`` and stops a diverged run.

    Args:
        spike_factor, divergence_factor: see :class:`DivergenceDetector`.
        log_every_n_steps: how often gradient and activation norms are measured (0: never).
    """

    def __init__(self, spike_factor: float = 3.0, divergence_factor: float = 100.0,
                 log_every_n_steps: int = 10) -> None:
        if spike_factor <= 1 or divergence_factor <= spike_factor:
            raise ValueError(f"need 1 < spike_factor < divergence_factor; got {spike_factor}, {divergence_factor}")
        self.detector = DivergenceDetector(spike_factor, divergence_factor)
        self.log_every_n_steps = log_every_n_steps
        self._activations: dict[str, float] = {}
        self._handles: list = []
        self._blocks: dict = {}
        self._recording = False
        self._step = 0
        self._batch_started = 0.0
        self._epoch_seconds = 0.0

    @property
    def diverged(self) -> bool:
        return self.detector.diverged_at_step is not None

    def _measuring(self, trainer) -> bool:
        return self.log_every_n_steps > 0 and trainer.global_step % self.log_every_n_steps == 0

    def on_fit_start(self, trainer, pl_module) -> None:
        blocks = {site.name.rpartition(".")[0]: site.block for site in residual_sites(pl_module.network.backbone)}
        self._blocks = blocks
        for name, block in blocks.items():
            self._handles.append(block.register_forward_hook(self._record(name)))

    def _record(self, name):
        def hook(module, args, out):
            if module.training and self._recording:
                self._activations[name] = float(out.detach().abs().max())
        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recording = self._measuring(trainer)
        self._step = trainer.global_step  # the step this batch's loss belongs to
        self._batch_started = time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch_seconds = 0.0

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("time/train_epoch_s", self._epoch_seconds, on_step=False, on_epoch=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._measuring(trainer):
            return
        metrics = {}
        for name, block in self._blocks.items():
            grads = [p.grad.detach().float().pow(2).sum() for p in block.parameters() if p.grad is not None]
            if grads:
                metrics[f"stability/grad_norm/{name}"] = float(torch.stack(grads).sum().sqrt())
        squares = [p.grad.detach().float().pow(2).sum() for p in pl_module.parameters() if p.grad is not None]
        if squares:
            metrics["stability/grad_norm"] = float(torch.stack(squares).sum().sqrt())
        metrics.update({f"stability/act_max/{k}": v for k, v in self._activations.items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._recording = False
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._epoch_seconds += time.perf_counter() - self._batch_started
        if not isinstance(outputs, dict) or outputs.get("loss") is None:
            return
        total = float(outputs["loss"])
        # The ratio test watches the task loss (a regulariser can make the total negative);
        # a non-finite total is divergence all the same.
        loss = total if not math.isfinite(total) else float(outputs.get("task_loss", total))
        if self.detector.update(loss, self._step):
            trainer.should_stop = True
            self._record_divergence(trainer)
        pl_module.log("stability/loss_spikes", float(self.detector.spikes), on_step=True, on_epoch=False)

    def _record_divergence(self, trainer) -> None:
        step, reason = self.detector.diverged_at_step, self.detector.reason
        for logger in trainer.loggers:
            logger.log_metrics({"stability/diverged_at_step": step, "hp/diverged_at_step": step}, step=step)
            logger.save()
        if trainer.log_dir:
            Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(trainer.log_dir) / "diverged.json").write_text(
                json.dumps({"diverged_at_step": step, "reason": reason}) + "\n")

    def on_fit_end(self, trainer, pl_module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
