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
same). A third loop is the reference the target is set against: the hand-written step captured whole as a CUDA
graph, with the data on the device (:func:`time_captured`). Target: `stability fit` ≥ 90% of the captured loop's
images/s.
"""
from __future__ import annotations

import pickle
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from common import CUT, ROOT, arguments, markdown, write

from stability.cli import StabilityCLI
from stability.data.base import augment

NAMES = {"fit": "stability fit", "hand": "the hand-written loop", "captured": "the captured loop"}


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


def time_hand_written(cli: StabilityCLI, warmup: int, steps: int, device: torch.device,
                      precision: str) -> tuple[float, torch.nn.Module]:
    """The same network (rebuilt from the same seed), the module's optimizer and schedule, autocast as the precision
    says. Returns the timed seconds and the trained network."""
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
    return time.perf_counter() - started, network


def captured_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """The module's AdamW rebuilt so that a CUDA graph can hold its step: the same parameter groups and settings,
    each group's learning rate a tensor on the device (filled from the schedule before each replay), and on CUDA
    ``fused=True, capturable=True`` (its step counters on the device, no host sync)."""
    if type(optimizer) is not torch.optim.AdamW:
        raise ValueError(f"the captured loop rebuilds AdamW; this config trains with {type(optimizer).__name__}")
    cuda = device.type == "cuda"
    return torch.optim.AdamW(captured_groups(optimizer, device), fused=True if cuda else None, capturable=cuda,
                             foreach=False if not cuda else None)


def captured_groups(optimizer: torch.optim.Optimizer, device: torch.device) -> list[dict]:
    """The optimizer's parameter groups with their settings (weight decay, betas, ε), each learning rate a tensor on
    ``device``, and without the implementation keys a group would keep over the constructor's (``capturable``,
    ``fused``, ``foreach``, ``differentiable``: a group's ``capturable=False`` makes capture fail)."""
    dropped = ("lr", "initial_lr", "capturable", "fused", "foreach", "differentiable")
    return [{**{k: v for k, v in g.items() if k not in dropped}, "lr": torch.tensor(float(g["lr"]), device=device)}
            for g in optimizer.param_groups]


def time_captured(cli: StabilityCLI, warmup: int, steps: int, device: torch.device,
                  precision: str) -> tuple[float, torch.nn.Module]:
    """The hand-written loop with its step captured whole: the network rebuilt from the same seed, its batches drawn
    on the device (the data module's resident data set; an epoch's smaller last batch skipped), augmented eagerly
    and copied into static buffers, then forward, backward and AdamW's step (:func:`captured_optimizer`) replayed as
    one CUDA graph (``torch.cuda.graph``, captured after three steps on a side stream; autocast without its weight
    cache, as capture needs). The learning rates follow the module's schedule, written into their tensors before
    each replay. On the CPU the same step on the same buffers runs eagerly: the path the graph holds, checked.
    Returns the timed seconds and the trained network."""
    L.seed_everything(cli.config.get("seed_everything") or 0)
    hparams = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}
    module = type(cli.model)(**hparams).to(device).train()
    network = module.network
    optimizer, schedule = hand_written_optimizer(cli, module)
    optimizer = captured_optimizer(optimizer, device)
    data = cli.datamodule
    data.setup("fit")
    loader = data.train_dataloader()
    bf16 = precision.startswith("bf16")
    first_images, first_labels = next(iter(loader))
    images, labels = (torch.zeros_like(t, device=device) for t in (first_images, first_labels))

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            loss = torch.nn.functional.cross_entropy(network(images), labels)
        loss.backward()
        optimizer.step()
        return loss

    def learning_rates(index: int) -> None:
        for group, base, factor in zip(optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas):
            group["lr"].fill_(base * factor(index))

    def batches():
        while True:
            for batch_images, batch_labels in loader:
                if len(batch_labels) == len(labels):
                    yield batch_images.to(device, non_blocking=True), batch_labels.to(device, non_blocking=True)

    stream, done = batches(), 0

    def feed() -> None:
        batch_images, batch_labels = next(stream)
        images.copy_(augment(batch_images, data.random_crop, data.horizontal_flip))
        labels.copy_(batch_labels)
        learning_rates(done)

    replay = step
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside the graph: optimizer state, cuBLAS workspaces, autotuning
                feed()
                optimizer.zero_grad(set_to_none=True)
                step()
                done += 1
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients from its own pool
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
        warmup = max(warmup, done)  # the clock starts after the steps taken outside the graph
    started = 0.0
    while done < warmup + steps:
        if done == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
        feed()
        if device.type != "cuda":
            optimizer.zero_grad(set_to_none=True)
        replay()
        done += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, network


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
        loops = {"fit": lambda: time_stability_fit(cli, args.warmup, args.steps),
                 "hand": lambda: time_hand_written(cli, args.warmup, args.steps, device, precision)[0],
                 "captured": lambda: time_captured(cli, args.warmup, args.steps, device, precision)[0]}
        seconds = {}
        for name, timed in loops.items():
            try:
                seconds[name] = timed()
            except (KeyboardInterrupt, SystemExit) as cut:  # cut at a time limit (Lightning exits on SIGINT)
                if isinstance(cut, SystemExit) and not (name == "fit" and cli.trainer.interrupted):
                    raise
                later = [NAMES[n] for n in loops if n not in seconds and n != name]
                CUT.append(f"interrupted while timing {NAMES[name]}"
                           + (f"; not timed: {', '.join(later)}" if later else ""))
                break
            if seconds[name] <= 0:  # the loop ended before its last timed step (e.g. a too short data set)
                raise SystemExit(f"{NAMES[name]} ended before step {args.warmup + args.steps}: lower --steps or "
                                 f"--warmup")
    if not seconds:
        raise SystemExit("loop_overhead: interrupted before any loop was timed; nothing written")
    captured = "captured as one CUDA graph" if device.type == "cuda" else "its static-buffer step, eager on the CPU"
    labels = {"hand": "hand-written loop (AdamW" + (", fused" if device.type == "cuda" else "") + ")",
              "captured": f"hand-written loop, {captured}", "fit": "stability fit (default callbacks)"}
    def share(of: str, name: str) -> str:
        return f"{seconds[of] / seconds[name]:.2f}" if of in seconds else "—"
    rows = [[labels[name], 1000 * seconds[name] / args.steps, batch * args.steps / seconds[name], share("hand", name),
             share("captured", name)] for name in ("hand", "captured", "fit") if name in seconds]
    summary = "; ".join(f"stability fit reaches {100 * seconds[n] / seconds['fit']:.0f}% of the {what} images/s"
                        for n, what in (("hand", "hand-written loop's"), ("captured", "captured loop's"))
                        if "fit" in seconds and n in seconds) or "stability fit was not timed against a loop"
    body = (f"`{args.config}`, batch {batch}, {precision}, {args.steps} steps after {args.warmup}; "
            f"{summary} (target ≥ 90% of the captured loop).\n\n"
            + markdown(["loop", "ms / step", "images / s", "share of the hand-written loop",
                        "share of the captured loop"], rows))
    write("loop_overhead", args, device, "Training-loop overhead", body)
    if CUT:
        raise SystemExit(130)  # the table holds what finished; the exit status says it was cut


if __name__ == "__main__":
    main()
