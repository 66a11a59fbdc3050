"""Training throughput of `stability fit` against a hand-written loop on the same network, batch, precision and data,
in one process: what the suite's loop (Lightning, its callbacks, logging, the data module's loader) costs.

    python benchmarks/loop_overhead.py                              # configs/vit_cifar10.yaml's model (ViT-Ti, 32×32)
    python benchmarks/loop_overhead.py --device cuda                # on a GPU (bf16-mixed, as the config trains)
    python benchmarks/loop_overhead.py --config configs/vit_digits.yaml --steps 100

`stability fit` is built exactly as the command builds it (StabilityCLI: the config, the default callbacks, the data
module and its loader) and timed over ``--steps`` training steps after ``--warmup``; the hand-written loop trains a
fresh copy of the same network (same seed) with the optimizer and learning-rate schedule the module builds
(``torch.optim.AdamW``, fused on CUDA, on its parameter groups; its LambdaLR, stepped every step) and the same
precision, on batches from the same data module's loader and augmentation — no callbacks, no logging. CIFAR data
that is not on disk is replaced by random images in the official pickle format (the loader and its costs are the
same). Target: `stability fit` ≥ 90% of the hand-written loop's images/s.
"""
from __future__ import annotations

import pickle
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from common import ROOT, arguments, markdown, write

from stability.cli import StabilityCLI
from stability.data.base import augment


class StepClock(L.Callback):
    """Wall-clock seconds between the start of step ``warmup`` and the start of step ``warmup + steps`` (the device
    synchronised at both), then stops the fit."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.started = self.seconds = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in (self.warmup, self.warmup + self.steps):
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            if step == self.warmup:
                self.started = time.perf_counter()
            else:
                self.seconds = time.perf_counter() - self.started
                trainer.should_stop = True


def fake_cifar(root: Path, per_file: int) -> None:
    """Random images in the CIFAR-10 python pickle format under ``root/cifar-10-batches-py``."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {b"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_file).tolist()}
        (folder / name).write_bytes(pickle.dumps(entry))


def build(config: str, device: str, data_root: str, run_dir: str, overrides: list[str]) -> StabilityCLI:
    """`stability fit` as the command builds it (its logger, checkpoints and callbacks), without validation, whose
    epoch-end work is not a training step."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    args = ["--config", config, "--trainer.accelerator", accelerator, "--trainer.devices", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--run_dir", run_dir,
            *overrides]
    if "cifar" in config:
        args += ["--data.root", data_root]
    return StabilityCLI(args=args, run=False)


def time_stability_fit(cli: StabilityCLI, warmup: int, steps: int) -> float:
    clock = StepClock(warmup, steps)
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, cli.datamodule)
    return clock.seconds


def hand_written_optimizer(cli: StabilityCLI, module: L.LightningModule):
    """The optimizer and learning-rate schedule `stability fit` trains with, built by the module for a fresh copy of
    its network: AdamW (fused on CUDA) on its parameter groups (no decay on biases, norms and tokens) and the same
    LambdaLR (warmup, then the configured decay over the run's steps) — stepped by hand below, every step."""
    module.trainer = cli.trainer  # the run's length and precision, as the fit saw them
    configured = module.configure_optimizers()
    return configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def time_hand_written(cli: StabilityCLI, warmup: int, steps: int, device: torch.device, precision: str) -> float:
    """The same network (rebuilt from the same seed), the module's optimizer and schedule, autocast as the precision
    says."""
    L.seed_everything(cli.config.get("seed_everything") or 0)
    hparams = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}
    module = type(cli.model)(**hparams).to(device).train()
    network = module.network
    optimizer, schedule = hand_written_optimizer(cli, module)
    data = cli.datamodule
    data.setup("fit")
    loader = data.train_dataloader()
    bf16 = precision.startswith("bf16")
    started, step = 0.0, 0
    while step < warmup + steps:
        for images, labels in loader:
            if step == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
            if step == warmup + steps:
                break
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            images = augment(images, data.random_crop, data.horizontal_flip)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = torch.nn.functional.cross_entropy(network(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/vit_cifar10.yaml")
    p.add_argument("--steps", type=int, default=100, help="timed training steps")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing starts")
    p.add_argument("--precision", default=None, help="default: the config's (bf16-mixed for CIFAR) on CUDA, 32-true "
                                                     "on the CPU")
    args = p.parse_args()
    if args.quick:
        args.config, args.steps, args.warmup = "configs/vit_digits.yaml", 4, 2
    device = torch.device(args.device)
    precision = args.precision or ("bf16-mixed" if device.type == "cuda" else "32-true")
    overrides = ["--trainer.precision", precision, "--trainer.max_steps", str(args.warmup + args.steps + 1)]
    if args.quick:
        overrides += ["--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"]
    with tempfile.TemporaryDirectory() as tmp:
        data_root = str(ROOT / "data")
        if "cifar" in args.config and not (ROOT / "data" / "cifar-10-batches-py").is_dir():
            fake_cifar(Path(tmp), per_file=2048)
            data_root = tmp
        cli = build(str(ROOT / args.config), args.device, data_root, str(Path(tmp) / "run"), overrides)
        batch = cli.datamodule.batch_size
        fit_seconds = time_stability_fit(cli, args.warmup, args.steps)
        hand_seconds = time_hand_written(cli, args.warmup, args.steps, device, precision)
    rows = [["hand-written loop (AdamW" + (", fused" if device.type == "cuda" else "") + ")",
             1000 * hand_seconds / args.steps, batch * args.steps / hand_seconds, "1.00"],
            ["stability fit (default callbacks)", 1000 * fit_seconds / args.steps, batch * args.steps / fit_seconds,
             f"{hand_seconds / fit_seconds:.2f}"]]
    share = hand_seconds / fit_seconds
    body = (f"`{args.config}`, batch {batch}, {precision}, {args.steps} steps after {args.warmup}; "
            f"stability fit reaches {100 * share:.0f}% of the hand-written loop's images/s (target ≥ 90%).\n\n"
            + markdown(["loop", "ms / step", "images / s", "share of the hand-written loop"], rows))
    write("loop_overhead", args, device, "Training-loop overhead", body)


if __name__ == "__main__":
    main()
