"""Optimizers and learning-rate schedules of the training module."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

LR_SHAPE_FACTOR = "lr_shape_factor"  # a parameter group's lr over its nominal lr (Muon's √(fan_out/fan_in) correction)

OptimizerName = Literal["adamw", "adam", "sgd"]
SchedulerName = Literal["cosine", "linear", "exponential", "constant"]


def param_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and kernels (ndim ≥ 2) only; none on biases, norms, tokens."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or "pos_embed" in name or "cls_token" in name or "relative_position" in name
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def nominal_lr(group: dict) -> float:
    """A parameter group's learning rate without the shape correction stored under ``LR_SHAPE_FACTOR``."""
    return group["lr"] / group.get(LR_SHAPE_FACTOR, 1.0)


def fused_allowed(params: list[torch.Tensor], precision: str | None = None) -> bool:
    """Use the fused Adam/AdamW kernels: every parameter a floating CUDA tensor, and not under ``16-mixed``.

    With fp16 mixed precision Lightning's GradScaler does not unscale a fused optimizer's gradients before
    ``on_before_optimizer_step`` (the fused kernel unscales inside its own step): the gradient norms read there would
    carry the loss scale (≈ 65536×) and ``gradient_clip_val`` raises. bf16 has no scaler and is unaffected."""
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params) and precision not in (
        "16-mixed", "16")


def make_optimizer(groups: list[dict], name: OptimizerName, lr: float, momentum: float,
                   betas: tuple[float, float], precision: str | None = None) -> torch.optim.Optimizer:
    # on CUDA, the fused kernels: one launch for all parameters (a hand-written loop's choice; the same update)
    params = [p for g in groups for p in g["params"]]
    fused = fused_allowed(params, precision) or None
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    raise ValueError(f"unknown optimizer {name!r}; choose one of adamw, adam, sgd")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: SchedulerName, min_ratio: float,
              decay_start: float = 0.0) -> float:
    """Multiplier of the base learning rate at ``step``: linear warmup from 0 over ``warmup_steps`` (none when 0), then
    constant, or a cosine, linear or exponential (geometric) decay to ``min_ratio`` at ``total_steps``, which begins
    after the warmup and after the fraction ``decay_start`` of training (GloRo's ``decay_after_half_to_…``: exponential
    from half of training)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    begin = max(warmup_steps, round(decay_start * total_steps))
    if step < begin:
        return 1.0
    progress = min(1.0, (step - begin) / max(1, total_steps - begin))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if schedule == "exponential":
        if min_ratio <= 0:
            raise ValueError(f"an exponential decay needs min_lr_ratio > 0, got {min_ratio}")
        return min_ratio ** progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
