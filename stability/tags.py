"""TensorBoard tag names: the one place the module, the callbacks and ``stability report`` take
them from.

Scalars logged with ``on_step`` / ``on_epoch`` get Lightning's ``_step`` / ``_epoch`` suffixes
(:func:`per_step`, :func:`per_epoch`). Measurement groups are prefixed ``test_`` at test time
(:func:`group`), so fit-time and test-time values sit side by side in TensorBoard.
"""
from __future__ import annotations

from typing import Literal

Stage = Literal["fit", "test"]

TRAIN_LOSS = "train/loss"
TRAIN_ACC = "train/acc"
TRAIN_LR = "train/lr"
TIME_TRAIN_EPOCH = "time/train_epoch_s"   # seconds of the training steps of an epoch (opt-in timing)
COST_STEP_GFLOPS = "cost/step_gflops"     # matrix GFLOPs of one training step (callbacks/cost.py)
COST_TRAIN_TFLOPS = "cost/train_tflops"   # matrix TFLOPs of the training steps so far
COST_GPU_TRAIN_S = "cost/gpu_train_s"     # the training steps so far, in seconds predicted on a reference GPU
BY_GFLOP = "by_gflop"                     # validation metrics again, with the step axis in GFLOPs of training

HP_VAL_ACC = "hp/val_acc"
HP_VAL_LOSS = "hp/val_loss"
HP_DIVERGED_AT_STEP = "hp/diverged_at_step"
DIVERGED_AT_STEP = "stability/diverged_at_step"
LOSS_SPIKES = "stability/loss_spikes"
GRAD_NORM = "stability/grad_norm"
ACT_MAX = "stability/act_max"
ATTN_LOGIT_MAX = "stability/attn_logit_max"   # per layer: the largest softmax input (attention-logit growth)
ATTN_ENTROPY = "stability/attn_entropy"       # per layer: the mean entropy of the attention rows (entropy collapse)
LOG_Z = "stability/log_z"                     # the mean log Σ exp(logits) of the output (output-logit divergence)

LIPSCHITZ = "lipschitz"
ROBUST = "robust"
CERTIFIED = "certified"
ATTENTION = "attention"
WEIGHTS = "weights"


def by_gflop(tag: str) -> str:
    """``by_gflop/<tag>``: a validation metric logged again with the training GFLOPs spent as its step."""
    return f"{BY_GFLOP}/{tag}"


def stage_metric(stage: str, metric: str) -> str:
    """``val/acc``, ``test/loss``, …"""
    return f"{stage}/{metric}"


def loss(term: str) -> str:
    """``loss/task`` or ``loss/<stabilizer>``: each term of the training objective."""
    return f"loss/{term}"


TASK_LOSS = loss("task")


def per_step(tag: str) -> str:
    return f"{tag}_step"


def per_epoch(tag: str) -> str:
    return f"{tag}_epoch"


def stabilizer_signal(stabilizer: str, signal: str) -> str:
    """``stability/<stabilizer>/<signal>``: what a stabilizer reports of itself during training."""
    return f"stability/{stabilizer}/{signal}"


def group(name: str, stage: Stage = "fit") -> str:
    """A measurement group's prefix: ``lipschitz`` during fit, ``test_lipschitz`` at test."""
    return f"test_{name}" if stage == "test" else name


def measurement(name: str, stat: str, stage: Stage = "fit") -> str:
    """e.g. ``measurement(LIPSCHITZ, "local_mean", "test")`` → ``test_lipschitz/local_mean``."""
    return f"{group(name, stage)}/{stat}"
