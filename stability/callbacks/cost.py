"""What training costs, in units that mean the same on every machine: the matrix FLOPs of a training step and, from
the CPU model of a GPU step (:mod:`stability.testing.gpu_model`), its predicted time on a reference GPU — beside the
wall-clock ``time/train_epoch_s`` (:class:`~stability.callbacks.timing.EpochTimer`), which depends on the machine
and on whoever else was running.

One training step is counted once per run (its second step, or its first where an epoch has one): its matrix FLOPs
(forward, backward, the stabilizers' own work and the optimizer's: elementwise work is not counted) on the code path
the run's device takes, and, for the GPU prediction, the same step on a GPU's code path (the run's own step on a
GPU; on a CPU a copy of the model stepped once on the CPU as a GPU would step it). Every epoch end logs the
cumulative costs, ``cost/train_tflops`` and ``cost/gpu_train_s`` (steps so far × the step's cost; the last, smaller
batch of an epoch counts as a full one), and the validation metrics again against the FLOPs spent, under
``by_gflop/<tag>`` with the step axis in GFLOP: TensorBoard then draws a run's curves against its cost.
"""
from __future__ import annotations

import inspect

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .. import tags
from ..testing.gpu_model import FITTED, KernelCounter, StepCounts, count, cuda_path

COST_AXIS_GROUPS = ("val/", f"{tags.ROBUST}/", f"{tags.CERTIFIED}/", f"{tags.LIPSCHITZ}/")


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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._count_this_batch(trainer, batch_idx):
            self._counted_batch = batch
            self._counter = KernelCounter()
            self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        counts, self._counter = self._counter.counts, None
        world = trainer.world_size
        self.step_flops = counts.total_flops() * world
        if self.gpu_model != "none":
            on_gpu = counts if pl_module.device.type == "cuda" else self._gpu_path_counts(trainer, pl_module)
            self.gpu_step_s = FITTED[self.gpu_model].seconds(on_gpu) if on_gpu is not None else None
        self._counted_batch = None
        if trainer.is_global_zero:
            gpu = "" if self.gpu_step_s is None else f"; {1000 * self.gpu_step_s:.2f} ms predicted on an " \
                                                       f"{self.gpu_model.upper()}"
            rank_zero_info(f"cost: {self.step_flops / 1e9:.3g} GFLOP of matrix products a training step{gpu}")

    def _gpu_path_counts(self, trainer, pl_module) -> StepCounts | None:
        """The counted step again on a GPU's code path: a copy of the model, stepped on the CPU as a GPU steps it."""
        from ..classifier import ImageClassifier

        images, labels = self._counted_batch
        precision = "bf16" if "bf16" in str(trainer.precision) else "fp32"
        accepted = inspect.signature(ImageClassifier.__init__).parameters  # not LightningCLI's own entries
        options = {k: v for k, v in pl_module.hparams.items() if k in accepted and k != "self"}
        copy = ImageClassifier(**{**options, "compile": False}).to(pl_module.device)
        copy.load_state_dict(pl_module.state_dict())
        copy.train()
        with cuda_path(copy):
            optimizer = copy.build_optimizer()

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    _, terms = copy.losses(images, labels)
                    loss = sum(term for name, term in terms.items() if name != "cross_entropy")
                loss.backward()
                optimizer.step()
                copy.after_optimizer_step(1)

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
            for tag, value in trainer.callback_metrics.items():
                if tag.startswith(COST_AXIS_GROUPS) and value.numel() == 1:
                    logger.experiment.add_scalar(tags.by_gflop(tag), float(value), global_step=axis)


__all__ = ["CostMeter"]
