"""What training costs, in units that mean the same on every machine: the matrix FLOPs of a training step and, from
the CPU model of a GPU step (:mod:`stability.testing.gpu_model`), its predicted time on a reference GPU — beside the
wall-clock ``time/train_epoch_s`` (:class:`~stability.callbacks.timing.EpochTimer`), which depends on the machine
and on whoever else was running.

One training step is counted once per run (its second step, or its first where an epoch has one): its matrix FLOPs
(forward, backward, the stabilizers' own work and the optimizer's: elementwise work is not counted), and, for the
GPU prediction, its launches, bytes and FLOPs by precision on a GPU's code path. On the CPU the run's own step is
counted (eager), and a copy of the model is stepped once more as a GPU would step it; on a GPU, or compiled, a copy
is counted (a compiled kernel — FlexAttention, Inductor's — never reaches the counter), on a GPU's code path. The
copies leave the global random streams as they were: the run trains as it would without the count. Every epoch end
logs the cumulative costs, ``cost/train_tflops`` and ``cost/gpu_train_s`` (steps so far × the step's cost; the last,
smaller batch of an epoch counts as a full one), and the validation metrics measured that epoch again against the
FLOPs spent, under ``by_gflop/<tag>`` with the step axis in GFLOP: TensorBoard then draws a run's curves against its
cost.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .. import tags
from ..testing.gpu_model import FITTED, KernelCounter, StepCounts, count, cuda_path
from ..testing.profiling import train_step


def measured_groups(trainer) -> tuple[str, ...]:
    """The prefixes of the validation metrics measured this epoch: validation's own every epoch, a monitor's on the
    epochs it measures (its values from earlier epochs stay in ``callback_metrics`` and are not logged again)."""
    from .lipschitz_monitor import LipschitzMonitor
    from .robustness_monitor import RobustnessMonitor

    groups = ["val/"]
    for callback in trainer.callbacks:
        every = getattr(callback, "every_n_epochs", 0)
        if not every or (trainer.current_epoch + 1) % every:
            continue
        if isinstance(callback, LipschitzMonitor):
            groups.append(f"{tags.LIPSCHITZ}/")
        elif isinstance(callback, RobustnessMonitor):
            groups += [f"{tags.ROBUST}/", f"{tags.CERTIFIED}/"]
    return tuple(groups)


class CostMeter(L.Callback):
    """Args:
        enabled: count the costs (``--cost.enabled false``: off).
        gpu_model: the fitted GPU whose step time is predicted (``h200``), or ``none``.
    """

    def __init__(self, enabled: bool = True, gpu_model: str = "h200") -> None:
        if gpu_model != "none" and gpu_model not in FITTED:
            raise ValueError(f"--cost.gpu_model {gpu_model!r}: choose one of {sorted(FITTED)} or 'none'")
        self.enabled, self.gpu_model = enabled, gpu_model
        self.step_flops: float | None = None
        self.gpu_step_s: float | None = None
        self._counter: KernelCounter | None = None
        self._counted_batch = None

    def _count_this_batch(self, trainer, batch_idx: int) -> bool:
        if not self.enabled or self.step_flops is not None or self._counter is not None:
            return False
        return batch_idx == 1 or (batch_idx == 0 and trainer.num_training_batches == 1)

    @staticmethod
    def _real_step_countable(pl_module) -> bool:
        """The run's own step can be counted where it runs eagerly on the CPU; on a GPU (FlexAttention is a compiled
        kernel there) or compiled (``--model.compile true``) the compiled kernels never reach a dispatch mode, so a
        copy of the model is counted instead."""
        return pl_module.device.type == "cpu" and pl_module.__dict__.get("_compiled_network") is None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._count_this_batch(trainer, batch_idx):
            self._counted_batch = batch
            if self._real_step_countable(pl_module):
                self._counter = KernelCounter()
                self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._counted_batch is None:
            return
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            own, self._counter = self._counter.counts, None
        else:
            own = self._copy_counts(trainer, pl_module, gpu_path=pl_module.device.type == "cuda")
        batches = trainer.world_size * trainer.accumulate_grad_batches  # a counted step is one batch of a process
        self.step_flops = own.total_flops() * batches
        if self.gpu_model != "none":
            on_gpu = own if pl_module.device.type == "cuda" else self._copy_counts(trainer, pl_module, gpu_path=True)
            self.gpu_step_s = FITTED[self.gpu_model].seconds(on_gpu) * batches
        self._counted_batch = None
        if trainer.is_global_zero:
            gpu = "" if self.gpu_step_s is None else f"; {1000 * self.gpu_step_s:.2f} ms predicted on an " \
                                                       f"{self.gpu_model.upper()}"
            rank_zero_info(f"cost: {self.step_flops / 1e9:.3g} GFLOP of matrix products a training step{gpu}")

    def _copy_counts(self, trainer, pl_module, gpu_path: bool) -> StepCounts:
        """The counted step again on a copy of the model (its weights, on its device, in its dtype), stepped once to
        make the optimizer's state and counted at the second step; on a GPU's code path where ``gpu_path`` (a CPU
        steps it as a GPU would). The global random streams are left as they were: the run trains as without it."""
        from ..classifier import ImageClassifier

        images, labels = self._counted_batch
        precision = "bf16" if "bf16" in str(trainer.precision) else "fp32"
        accepted = inspect.signature(ImageClassifier.__init__).parameters  # not LightningCLI's own entries
        options = {k: v for k, v in pl_module.hparams.items() if k in accepted and k != "self"}
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            dtype = next(pl_module.parameters()).dtype
            eager = {**options, "compile": False, "compile_mode": "default"}
            copy = ImageClassifier(**eager).to(device=pl_module.device, dtype=dtype)
            copy.load_state_dict(pl_module.state_dict())
            copy.train()
            with cuda_path(copy) if gpu_path else contextlib.nullcontext():
                optimizer = copy.build_optimizer()
                step = functools.partial(train_step, copy, optimizer, images, labels, precision, 1)
                step()  # the optimizer's state exists after it
                return count(step)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.step_flops is None:
            return
        steps = trainer.global_step
        train_flops = self.step_flops * steps
        pl_module.log(tags.COST_TRAIN_TFLOPS, train_flops / 1e12, on_step=False, on_epoch=True)
        pl_module.log(tags.COST_STEP_GFLOPS, self.step_flops / 1e9, on_step=False, on_epoch=True)
        if self.gpu_step_s is not None:
            pl_module.log(tags.COST_GPU_TRAIN_S, self.gpu_step_s * steps, on_step=False, on_epoch=True)
        logger = trainer.logger
        if trainer.is_global_zero and logger is not None and hasattr(logger, "experiment") and \
                hasattr(logger.experiment, "add_scalar"):
            axis = int(round(train_flops / 1e9))
            measured = measured_groups(trainer)
            for tag, value in trainer.callback_metrics.items():
                if tag.startswith(measured) and value.numel() == 1:
                    logger.experiment.add_scalar(tags.by_gflop(tag), float(value), global_step=axis)


__all__ = ["CostMeter"]
