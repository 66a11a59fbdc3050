"""Divergence detection: a non-finite loss, or a task loss above ``divergence_factor`` × its
running value or × its value at the start, stops the run cleanly and records where and why (a
result, not a crash); losses above ``spike_factor`` × the running value are counted as spikes."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch

from .. import tags
from ..nn.precision import at_least_float32


@dataclass
class DivergenceDetector:
    """Running loss (exponential average with ``beta``), spike count, divergence verdict.

    The reference is max(running loss, ``min_reference``), so that a loss near zero late in
    training does not turn ordinary noise into "spikes". A loss above ``spike_factor`` ×
    reference counts as a spike; a non-finite loss or one above ``divergence_factor`` ×
    reference is divergence. So is a loss above ``divergence_factor`` × the ``initial`` one (the
    first loss, at initialisation: log K for a K-class cross-entropy), so that a loss that exploded
    during the first steps, which the running value took in, or one that climbs slowly enough for
    the running value to follow it, is still caught. The first ``warmup_steps`` losses only feed
    the running value."""

    spike_factor: float = 3.0
    divergence_factor: float = 100.0
    beta: float = 0.9
    warmup_steps: int = 5
    min_reference: float = 0.1
    running: float | None = None
    initial: float | None = None
    steps: int = 0
    spikes: int = 0
    diverged_at_step: int | None = None
    reason: str = ""
    history: list = field(default_factory=list, repr=False)

    def update(self, loss: float, step: int) -> bool:
        """Feed one loss; True when the run has diverged."""
        self.steps += 1
        if not math.isfinite(loss):
            self.diverged_at_step, self.reason = step, f"non-finite loss ({loss})"
            return True
        if self.initial is None:
            self.initial = loss
        if self.running is not None and self.steps > self.warmup_steps:
            reference = max(self.running, self.min_reference)
            for name, value in (("running", reference), ("initial", max(self.initial, self.min_reference))):
                if loss > self.divergence_factor * value:
                    self.diverged_at_step = step
                    self.reason = f"loss {loss:.4g} > {self.divergence_factor:g} × {name} loss {value:.4g}"
                    return True
            if loss > self.spike_factor * reference:
                self.spikes += 1
        self.running = loss if self.running is None else self.beta * self.running + (1 - self.beta) * loss
        return False


class DivergenceMonitor(L.Callback):
    """Watches the training objective every step; stops a diverged run and writes ``diverged.json``
    and ``hp/diverged_at_step`` into its run directory.

    The ratio test watches the task loss the module reports (``task_loss`` in the step output: the
    objective actually optimised, which a stabilizer may have replaced, before additive
    regularisers, which can make the total negative); a non-finite total is divergence all the same.

    Every step's losses stay on the device; every ``check_every_n_steps`` steps (by default the trainer's
    ``log_every_n_steps``, when Lightning reads its logs anyway) and at the end of each epoch they are read
    back at once — averaged over the processes under DDP, so that all of them judge the same numbers and
    stop together — and fed to the detector step by step. The step and reason of a divergence are exact;
    the run stops at the check that finds it, at most ``check_every_n_steps − 1`` steps later.

    Args:
        spike_factor, divergence_factor: see :class:`DivergenceDetector`.
        check_every_n_steps: steps between reads (None: the trainer's ``log_every_n_steps``).
    """

    def __init__(self, spike_factor: float = 3.0, divergence_factor: float = 100.0,
                 check_every_n_steps: int | None = None) -> None:
        if spike_factor <= 1 or divergence_factor <= spike_factor:
            raise ValueError(f"need 1 < spike_factor < divergence_factor; got {spike_factor}, {divergence_factor}")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1 or None (the trainer's log_every_n_steps), got "
                             f"{check_every_n_steps}")
        self.detector = DivergenceDetector(spike_factor, divergence_factor)
        self.check_every_n_steps = check_every_n_steps
        self._step = 0
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, [task loss, total]) not yet judged

    @property
    def diverged(self) -> bool:
        return self.detector.diverged_at_step is not None

    def state_dict(self) -> dict:
        """The running loss and spike count travel with checkpoints, so a resumed run judges as before."""
        d = self.detector
        return {"running": d.running, "initial": d.initial, "steps": d.steps, "spikes": d.spikes}

    def load_state_dict(self, state_dict: dict) -> None:
        self.detector.running = state_dict["running"]
        self.detector.initial = state_dict.get("initial")  # absent from checkpoints written before it existed
        self.detector.steps, self.detector.spikes = state_dict["steps"], state_dict["spikes"]

    def _every(self, trainer) -> int:
        return self.check_every_n_steps or max(1, trainer.log_every_n_steps or 1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step  # the step this batch's loss belongs to

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(outputs, dict) or outputs.get("loss") is None:
            return
        total = outputs["loss"].detach()
        task = outputs.get("task_loss", total).detach()
        self._pending.append((self._step, torch.stack([at_least_float32(task), at_least_float32(total)])))
        if (self._step + 1) % self._every(trainer) == 0:
            self._judge(trainer)
            pl_module.log(tags.LOSS_SPIKES, float(self.detector.spikes), on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._judge(trainer)  # the epoch's last steps, before validation and the checkpoint

    def _judge(self, trainer) -> None:
        """Read the pending losses (one host sync) and run the detector over them in step order."""
        if not self._pending or self.diverged:
            self._pending = []
            return
        steps = [step for step, _ in self._pending]
        losses = torch.stack([pair for _, pair in self._pending])  # (steps, 2): task loss, total
        self._pending = []
        if trainer.world_size > 1:  # every process decides on the same (mean) losses, so all stop together
            losses = trainer.strategy.reduce(losses, reduce_op="mean")
        for step, (task, total) in zip(steps, losses.tolist()):
            if self.detector.update(total if not math.isfinite(total) else task, step):
                trainer.should_stop = True
                self._record_divergence(trainer)
                return

    def _record_divergence(self, trainer) -> None:
        step, reason = self.detector.diverged_at_step, self.detector.reason
        for logger in trainer.loggers:
            logger.log_metrics({tags.DIVERGED_AT_STEP: step, tags.HP_DIVERGED_AT_STEP: step}, step=step)
            logger.save()
        if trainer.log_dir and trainer.is_global_zero:
            Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(trainer.log_dir) / "diverged.json").write_text(
                json.dumps({"diverged_at_step": step, "reason": reason}) + "\n")
