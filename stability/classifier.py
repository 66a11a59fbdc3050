"""The LightningModule: a backbone, its stabilizers, the steps and the optimizer, nothing else
(logging layouts and HParams: :class:`~stability.callbacks.TensorBoardLayout`)."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, get_args

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from . import tags
from .metrics import TopClassShare, warn_constant_classifier
from .models import Network, build_backbone, capture_attention, capture_queries_keys
from .models.view import QueryKeyNetwork
from .nn.precision import accumulation_dtype, at_least_float32
from .optim import OptimizerName, SchedulerName, lr_factor, make_optimizer, param_groups
from .stabilizers import ForwardStep, Stabilizer, build_stabilizers, stabilizer_names

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES = get_args(CompileMode)
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes whose CUDA kernels torch.compile captures as graphs
CROSS_ENTROPY = "cross_entropy"  # logged beside a replaced task loss, not optimised


def _union_over_processes(names: list[str]) -> list[str]:
    """The sorted union of every process's ``names`` (this process's own where there is one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return names
    gathered: list[list[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, names)
    return sorted({name for part in gathered for name in part or []})


class ImageClassifier(L.LightningModule):
    """Image classification with a ViT / Swin / CSwin backbone and pluggable stabilizers.

    Args:
        backbone: ``vit``, ``swin`` or ``cswin``.
        size: preset of the backbone (``micro``, ``tiny``, ``small``).
        backbone_options: overrides of the preset, e.g. ``{"embed_dim": 32, "depth": 2}``.
        stabilizer: one name, a list, or ``"a,b"``; ``none`` is the baseline.
        stabilizer_options: ``{name: {option: value}}`` for the selected stabilizers.
        num_classes, in_chans, image_size, mean, std: facts of the data (the CLI links
            them from the data module).
        optimizer, lr, weight_decay, momentum, betas: the default optimizer (weight decay
            on weights of ndim ≥ 2 only).
        scheduler: ``cosine``, ``linear`` or ``exponential`` (decay to ``min_lr_ratio`` · lr, from the fraction
            ``decay_start`` of training on) or ``constant``, per step.
        warmup_epochs: linear warmup length in epochs (fractions allowed); 0 turns it off.
        label_smoothing: of the cross-entropy task loss.
        compile: train the network compiled by ``torch.compile`` (Lightning's advice: the network, not the module
            that logs). Checkpoints keep the plain network's keys. A step whose forward a callback observes through
            hooks (the training-stability signals, on logging steps) runs eagerly; a stabilizer that needs hooks on
            every step is refused, with the reason.
        compile_mode: torch.compile's ``mode``: ``default``; ``reduce-overhead`` (on CUDA the compiled forward and
            backward are captured as CUDA graphs and replayed, one launch in place of one per kernel: a small model's
            step is host time; elsewhere as ``default``); ``max-autotune`` (kernel autotuning, with CUDA graphs);
            ``max-autotune-no-cudagraphs``.
    """

    def __init__(
        self,
        backbone: str = "vit",
        size: str = "micro",
        backbone_options: dict[str, Any] | None = None,
        stabilizer: str | list[str] = "none",
        stabilizer_options: dict[str, dict[str, Any]] | None = None,
        num_classes: int = 10,
        in_chans: int = 1,
        image_size: int = 8,
        mean: Sequence[float] = (0.3053,),
        std: Sequence[float] = (0.3760,),
        optimizer: OptimizerName = "adamw",
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        scheduler: SchedulerName = "cosine",
        warmup_epochs: float = 0.0,
        min_lr_ratio: float = 0.0,
        decay_start: float = 0.0,
        label_smoothing: float = 0.0,
        compile: bool = False,
        compile_mode: CompileMode = "default",
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {list(COMPILE_MODES)}, got {compile_mode!r}")
        if compile_mode != "default" and not compile:
            raise ValueError(f"compile_mode {compile_mode!r} needs --model.compile true")
        if not 0 <= decay_start < 1:
            raise ValueError(f"decay_start is the fraction of training before the decay, in [0, 1); got {decay_start}")
        if scheduler == "exponential" and min_lr_ratio <= 0:
            raise ValueError(f"scheduler exponential decays geometrically to min_lr_ratio·lr: it needs min_lr_ratio "
                             f"> 0, got {min_lr_ratio}")
        mean, std, betas = list(mean), list(std), list(betas)  # plain YAML in hparams.yaml
        self.save_hyperparameters(logger=False)
        self.stabilizer_names = stabilizer_names(stabilizer)
        self.stabilizers = build_stabilizers(self.stabilizer_names, stabilizer_options)
        for stab in self.stabilizers:
            if label_smoothing and not stab.takes_label_smoothing:
                raise ValueError(f"stabilizer {stab.name!r} replaces the task loss with one that has no label-smoothed "
                                 f"form; set --model.label_smoothing 0 (got {label_smoothing})")
            if backbone not in stab.backbones:
                raise ValueError(f"stabilizer {stab.name!r} applies to the backbones {list(stab.backbones)}, not "
                                 f"{backbone!r}")
        net = build_backbone(backbone, size, img_size=image_size, in_chans=in_chans, num_classes=num_classes,
                             **(backbone_options or {}))
        self.network = Network(net, mean, std, image_size)
        for stab in sorted(self.stabilizers, key=lambda s: s.prepare_order):
            stab.prepare(self.network)
        for stab in self.stabilizers:
            stab.after_prepare(self.network)
        self.eager_forward = False  # set by callbacks that hook into a step's forward
        if compile:
            refused = [(s.name, reason) for s in self.stabilizers if (reason := s.compile_refusal())]
            if refused:
                raise ValueError("--model.compile true: " + "; ".join(f"{name} cannot train compiled: {reason}"
                                                                       for name, reason in refused))
            for stab in self.stabilizers:  # first: a stabilizer may choose its compiled path (JaSMin streams)
                stab.compile_terms()
            # a stabilizer that reads the queries and keys gets them from the compiled graph as outputs
            captures = any(s.needs_queries_keys for s in self.stabilizers)
            self.__dict__["_compiled_captures"] = captures
            # kept out of the module tree: the state dict (checkpoints) has the plain network's keys only
            self.__dict__["_compiled_network"] = torch.compile(QueryKeyNetwork(self.network) if captures
                                                               else self.network, mode=compile_mode)
        self.__dict__["_graph_steps"] = compile and compile_mode in GRAPH_MODES
        self._stabilizers_device: torch.device | None = None
        # validate_args=False: torchmetrics' argument checks read values back to the host at every update
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()  # exact means over uneven DDP shards
        self.val_top_class = TopClassShare(num_classes)  # a constant classifier is named, not left unnoticed
        self._said_collapsed = False

    def _training_network(self, images: torch.Tensor) -> torch.nn.Module:
        """The compiled network where there is one and no callback observes this step's forward, else the network.
        The compiled graph takes any batch size above 1 (the batch dimension is marked dynamic before the first
        compile), so an epoch's smaller last batch does not compile it a second time (a batch of one, which torch
        specialises, does)."""
        compiled = self.__dict__.get("_compiled_network")
        if compiled is None or self.eager_forward:
            return self.network
        torch._dynamo.maybe_mark_dynamic(images, 0)
        if self.__dict__.get("_graph_steps"):  # a new step: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return compiled

    @property
    def run_name(self) -> str:
        """``<backbone>/<stabilizers>``: the model's part of the run directory."""
        return f"{self.hparams.backbone}/{'+'.join(self.stabilizer_names)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    # ----------------------------------------------------------------- steps
    def losses(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits and the loss terms of one training forward pass: ``{"task": ..., <stabilizer>: ...}``.

        ``task`` is the objective actually optimised: the cross-entropy, or what a stabilizer's
        ``task_loss`` replaces it with (then the plain cross-entropy is reported as ``cross_entropy``,
        and is not added to the total)."""
        backbone = self.network.backbone
        if images.device != self._stabilizers_device:
            for stab in self.stabilizers:
                stab.on_device(images.device)
            self._stabilizers_device = images.device
        needs_probs = any(s.needs_attention_probs for s in self.stabilizers)
        needs_queries_keys = any(s.needs_queries_keys for s in self.stabilizers)
        network = self._training_network(images)
        if network is not self.network and self.__dict__.get("_compiled_captures"):
            logits, queries_keys = network(images)  # the compiled graph returns them: no hooks added per step
            probs = []
        else:
            probs_ctx = capture_attention(backbone) if needs_probs else contextlib.nullcontext([])
            qk_ctx = capture_queries_keys(backbone) if needs_queries_keys else contextlib.nullcontext([])
            with probs_ctx as probs, qk_ctx as queries_keys:
                logits = network(images)
        step = ForwardStep(self.network, images, logits, targets, probs, queries_keys, self.global_step,
                           self.__dict__.get("_total_steps", 0))
        replaced = [(s.name, loss) for s in self.stabilizers
                    if (loss := s.task_loss(step, self.cross_entropy(targets))) is not None]
        if len(replaced) > 1:
            raise ValueError(f"stabilizers {[n for n, _ in replaced]} each replace the task loss; combine at most one")
        terms = {"task": replaced[0][1] if replaced else self.cross_entropy(targets)(logits)}
        for stab in self.stabilizers:
            term = stab.loss(step)
            if term is not None:
                terms[stab.name] = term
        if replaced:
            terms[CROSS_ENTROPY] = self.cross_entropy(targets)(logits).detach()
        return logits, terms

    def cross_entropy(self, targets: torch.Tensor):
        """logits ↦ the module's cross-entropy against ``targets`` (labels or soft labels)."""
        return partial(F.cross_entropy, target=targets, label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """One step, with nothing read back to the host and no Lightning logging call on most steps: per-step values
        are handed to Lightning only on the steps it writes (every ``log_every_n_steps``; rank 0's), and the epoch
        means are summed on the device, weighted by the batch size, and reduced over the processes once, at the end
        of the epoch. (Each ``self.log`` costs Lightning ≈ 0.3–1.5 ms of Python, several per step: on a GPU that is a
        large share of a small model's step.)"""
        images, targets = batch
        logits, terms = self.losses(images, targets)
        task = terms["task"]
        total = sum(term for name, term in terms.items() if name != CROSS_ENTROPY)
        step_values = {tags.loss(name): term.detach() for name, term in terms.items()}
        step_values[tags.TRAIN_LOSS] = total.detach()
        self._accumulate(step_values, len(targets))
        labels = targets.argmax(dim=-1) if targets.ndim == 2 else targets
        self.train_acc.update(logits.detach(), labels)
        if self._writes_logs():  # a Python number becomes a device tensor when logged: only when it is written
            self.log(tags.per_step(tags.TRAIN_LOSS), step_values.pop(tags.TRAIN_LOSS), prog_bar=True, on_step=True,
                     on_epoch=False)
            self.log_dict({tags.per_step(tag): value for tag, value in step_values.items()}, on_step=True,
                          on_epoch=False)
            self.log(tags.TRAIN_LR, self.nominal_rate(), on_step=True, on_epoch=False)
        return {"loss": total, "task_loss": task.detach()}

    def nominal_rate(self) -> float:
        """The module's learning rate (``--model.lr``) as the schedule sets it now: the scheduler's factor times
        ``lr`` — not a parameter group's rate, which carries a stabilizer's own rate (Muon's ``lr``), its role scale
        or its shape factor. A plain number (no device read)."""
        scheduler = self.lr_schedulers()
        if scheduler is None:
            return float(self.hparams.lr)
        base = scheduler.base_lrs[-1]  # the last group is the module's own optimizer's (after any stabilizer's)
        return float(self.hparams.lr) * (scheduler.get_last_lr()[-1] / base if base else 1.0)

    def _accumulate(self, values: dict[str, torch.Tensor], count: int) -> None:
        """Σ value·count and Σ count per tag, on the device, for the epoch means."""
        sums = self.__dict__.setdefault("_epoch_sums", {})
        for tag, value in values.items():
            weighted = at_least_float32(value) * count
            if tag in sums:
                sums[tag][0].add_(weighted)
                sums[tag][1] += count
            else:
                sums[tag] = [weighted.clone(), count]

    def on_train_epoch_end(self) -> None:
        """``<tag>_epoch``: the mean over every sample of the epoch and every process (one all-reduce per tag), and
        ``train/acc``.

        Safe when the processes logged different tags (a stabilizer's term on some of them only): the tags are first
        made the union over the processes (one exchange of their names), and a process that has not seen a tag adds
        zero with zero samples to it; then one all-reduce of the stacked sums and counts serves every tag."""
        sums = self.__dict__.pop("_epoch_sums", {})
        names = _union_over_processes(sorted(sums))
        if names:
            dtype = accumulation_dtype(self.network.mean.dtype)  # float32, or float64 for a float64 network
            rows = []
            for tag in names:
                weighted, count = sums.get(tag, (None, 0))
                row = torch.zeros(2, dtype=dtype, device=self.device)
                if weighted is not None:
                    row[0], row[1] = weighted.to(dtype), count
                rows.append(row)
            totals = self.trainer.strategy.reduce(torch.stack(rows), reduce_op="sum")  # (tags, 2): Σ value·n, Σ n
            for tag, (total, samples) in zip(names, totals):
                self.log(tags.per_epoch(tag), total / samples, on_step=False, on_epoch=True,
                         prog_bar=tag == tags.TRAIN_LOSS)
        self.log(tags.TRAIN_ACC, self.train_acc.compute(), on_step=False, on_epoch=True, prog_bar=True)
        self.train_acc.reset()

    def _writes_logs(self) -> bool:
        """True on the steps at which Lightning writes per-step logs ((step + 1) % log_every_n_steps == 0)."""
        every = self.trainer.log_every_n_steps
        return bool(every) and (self.global_step + 1) % every == 0

    def _evaluate(self, batch, stage: str, accuracy: MulticlassAccuracy, loss: MeanMetric) -> torch.Tensor:
        images, labels = batch
        logits = self.network(images)
        loss.update(F.cross_entropy(logits, labels), weight=len(labels))
        accuracy.update(logits, labels)
        self.log(tags.stage_metric(stage, "loss"), loss, prog_bar=True)
        self.log(tags.stage_metric(stage, "acc"), accuracy, prog_bar=True)
        return logits

    def validation_step(self, batch, batch_idx: int) -> None:
        logits = self._evaluate(batch, "val", self.val_acc, self.val_loss)
        self.val_top_class.update(logits, batch[1])

    def on_validation_epoch_end(self) -> None:
        """``val/top_class_share``, and a :class:`~stability.metrics.ConstantClassifierWarning` the first time the
        network predicts one class for ≥ 95% of the validation points (a loss can shrink every margin into a constant
        classifier without diverging)."""
        share = self.val_top_class.compute()  # every process's counts (summed under DDP)
        with self.val_top_class.sync_context():  # the same verdict on every process
            collapsed, what = self.val_top_class.collapsed()
        self.log(tags.stage_metric("val", "top_class_share"), share)
        self.val_top_class.reset()
        if collapsed and not self._said_collapsed and not self.trainer.sanity_checking and self.trainer.is_global_zero:
            self._said_collapsed = True
            replacing = [s.name for s in self.stabilizers if type(s).task_loss is not Stabilizer.task_loss]
            cause = (f"its training objective comes from {', '.join(replacing)}: a radius out of the model's reach "
                     f"shrinks every margin (lower eps, or ramp it)") if replacing else ""
            warn_constant_classifier(what, cause)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc, self.test_loss)

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Class probabilities (B, num_classes) of the images of a batch."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.network(images).softmax(dim=-1)

    # --------------------------------------------------------- optimization
    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer: one a stabilizer supplies (at most one may), else the default."""
        hp = self.hparams
        trainer = self.__dict__.get("_trainer")  # None outside a trainer (parity, tests)
        precision = str(trainer.precision) if trainer is not None else None

        def default(named_parameters):
            return make_optimizer(param_groups(named_parameters, hp.weight_decay), hp.optimizer, hp.lr,
                                  hp.momentum, hp.betas, precision)

        supplied = [(s.name, opt) for s in self.stabilizers
                    if (opt := s.build_optimizer(self.network, default)) is not None]
        if len(supplied) > 1:
            raise ValueError(f"stabilizers {[n for n, _ in supplied]} each supply an optimizer; combine at most one")
        self.report_unconstrained_parameters()
        return supplied[0][1] if supplied else default(self.network.named_parameters())

    def unconstrained_parameters(self) -> list[str]:
        """Trainable parameters that no selected stabilizer keeps norm-bounded after every step."""
        constrained = {id(p) for s in self.stabilizers for p in s.constrained_parameters(self.network)}
        return [name for name, p in self.network.named_parameters() if p.requires_grad and id(p) not in constrained]

    def report_unconstrained_parameters(self) -> None:
        """Where a stabilizer wants the whole network constrained, say which parameters are not."""
        wanting = [s.name for s in self.stabilizers if s.wants_constrained_network]
        if not wanting:
            return
        free = self.unconstrained_parameters()
        if free:
            rank_zero_warn(f"{', '.join(wanting)}: {len(free)} parameter(s) are trained without a norm constraint, "
                           f"so the Lipschitz bound is not enforced on them: {', '.join(free)}")
        else:
            rank_zero_info(f"{', '.join(wanting)}: every trained parameter is norm-constrained after each step")

    def configure_optimizers(self):
        hp = self.hparams
        if self.__dict__.get("_graph_steps") and self.trainer.accumulate_grad_batches > 1:
            raise ValueError(f"--model.compile_mode {hp.compile_mode} captures CUDA graphs, whose memory the next step "
                             f"reuses: the gradients that --trainer.accumulate_grad_batches "
                             f"{self.trainer.accumulate_grad_batches} keeps between steps would be overwritten; use "
                             f"--model.compile_mode default or no accumulation")
        optimizer = self.build_optimizer()
        total = int(self.trainer.estimated_stepping_batches)
        self.__dict__["_total_steps"] = total  # the run's length, for schedules a stabilizer follows (ForwardStep)
        epochs = max(1, self.trainer.max_epochs or 1)
        warmup = round(hp.warmup_epochs * total / epochs)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_factor, total_steps=total, warmup_steps=warmup, schedule=hp.scheduler,
                               min_ratio=hp.min_lr_ratio, decay_start=hp.get("decay_start", 0.0)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Before Lightning restores the optimizer and schedulers: each stabilizer brings an older layout of its state
        to the current one (Muon's groups, split by shape factor since; Stabilizer.on_load_checkpoint). Only when
        fitting: test, validate and predict read the weights alone."""
        trainer = self.__dict__.get("_trainer")
        if trainer is not None and trainer.state.fn != "fit":
            return
        for stab in self.stabilizers:
            stab.on_load_checkpoint(checkpoint, self.network)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure)
        self.after_optimizer_step()

    def after_optimizer_step(self, global_step: int | None = None) -> None:
        """The stabilizers' projections after a step (constraints, spectral caps); ``global_step`` is the
        index of the step just taken (default: the trainer's)."""
        step = self.global_step if global_step is None else global_step
        for stab in self.stabilizers:
            stab.after_optimizer_step(self.network, global_step=step)


