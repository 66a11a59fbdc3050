"""``stability``: LightningCLI with run directories, stabilizers by name, and digits by default.

    stability fit                                   # micro ViT on digits, baseline
    stability fit --stabilizer none --model.lr 3e-3 --trainer.max_epochs 5 --seed_everything 1
    stability fit --config configs/vit_digits.yaml
    stability test --ckpt_path runs/digits/vit/none/version_0/checkpoints/last.ckpt

Stabilizers: ``--stabilizer NAME`` (several: ``a,b`` or a YAML list) selects them; each
stabilizer's options form a group of their own, ``--NAME.option value`` (``NAME:`` in YAML),
so switching stabilizer never carries another one's options along; options set for a
stabilizer that is not selected are an error.
"""
from __future__ import annotations

import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from . import exit_codes
from .callbacks import (
    CostMeter,
    DivergenceMonitor,
    EpochTimer,
    LipschitzMonitor,
    RobustnessMonitor,
    TensorBoardLayout,
    TestResults,
    TrainingStability,
)
from .classifier import ImageClassifier
from .data import ImageDataModule
from .nn.precision import allow_tf32_training
from .stabilizers import REGISTRY, stabilizer_names

DEFAULT_DATA = "stability.data.Digits"
LINKED_FROM_DATA = ("num_classes", "in_chans", "image_size", "mean", "std")
# devices: 1 — Lightning's "auto" takes every GPU of a node and starts DDP; more than one is asked for explicitly.
TRAINER_DEFAULTS = {"max_epochs": 30, "log_every_n_steps": 10, "devices": 1}


def _option_groups() -> dict[str, type]:
    """Registered stabilizers that take options: each gets a parser group of its own."""
    return {name: cls for name, cls in REGISTRY.items() if _parameters(cls)}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self" and p.kind in named}


def _defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in _parameters(cls).items() if p.default is not inspect.Parameter.empty}


def selected_options(names: str | list[str], *groups: Namespace) -> dict[str, dict[str, Any]]:
    """Options of the selected stabilizers, from their groups; a changed option of an
    unselected stabilizer is an error (it would otherwise be silently ignored)."""
    selected = stabilizer_names(names)
    options = {}
    for (name, cls), group in zip(_option_groups().items(), groups):
        values = dict(vars(group)) if group is not None else {}
        if name in selected:
            options[name] = values
        else:
            changed = {k: v for k, v in values.items() if _defaults(cls).get(k, v) != v}
            if changed:
                raise ValueError(f"options {changed} set for stabilizer {name!r}, which is not selected "
                                 f"(--stabilizer {','.join(selected)}); add it to --stabilizer or drop them")
    return options


def checkpoint_defaults(ckpt_path: str) -> dict[str, Any]:
    """Parser defaults (dotted keys) that rebuild the model, stabilizers and data of a checkpoint."""
    import torch

    ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
    model = {k: v for k, v in ckpt.get("hyper_parameters", {}).items() if not k.startswith("_")}
    defaults: dict[str, Any] = {}
    if model:
        defaults["stabilizer"] = model.pop("stabilizer", "none")
        for name, options in (model.pop("stabilizer_options", None) or {}).items():
            defaults.update({f"{name}.{k}": v for k, v in options.items()})
        for key in LINKED_FROM_DATA:
            model.pop(key, None)
        defaults.update({f"model.{k}": v for k, v in model.items()})
    data = dict(ckpt.get("datamodule_hyper_parameters", {}))
    if "_class_path" in data:
        class_path = data.pop("_class_path")
        init_args = {k: v for k, v in data.items() if not k.startswith("_")}
        defaults["data"] = {"class_path": class_path, "init_args": init_args}
    return defaults


def argument_value(argv: list[str], option: str) -> str | None:
    """The value of ``--option X`` or ``--option=X`` in ``argv`` (the last one given), else None."""
    found = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key == option:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def checkpoint_data_class(argv: list[str]) -> str | None:
    """The data class stored in the checkpoint ``--ckpt_path`` names (None: no readable checkpoint, or none stored)."""
    path = argument_value(argv, "--ckpt_path")
    if not path or not Path(path).is_file():
        return None
    import torch

    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    return ckpt.get("datamodule_hyper_parameters", {}).get("_class_path")


def requested_data_class(argv: list[str]) -> str | None:
    """The data class named by ``--data X`` or by ``data: class_path`` in a ``--config`` file (last wins)."""
    found = None
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if key in ("--config", "-c") and Path(value).is_file():
            loaded = yaml.safe_load(Path(value).read_text()) or {}
            for section in (loaded, *(v for v in loaded.values() if isinstance(v, dict))):
                data = section.get("data") if isinstance(section, dict) else None
                if isinstance(data, dict) and data.get("class_path"):
                    found = data["class_path"]
                    break
        elif key == "--data" and value and not value.lstrip().startswith("{"):
            found = value
    if found is not None and "." not in found:
        found = f"stability.data.{found}"
    return found


# Lightning's warning when a checkpoint holds the state of callbacks the trainer lacks, where the only ones missing are
# the ModelCheckpoint(s) that test / validate / predict leave out on purpose
ONLY_MODEL_CHECKPOINT_MISSING = (
    r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided during "
    r"`Trainer` instantiation\. Please add the following callbacks: \[(\"ModelCheckpoint\{[^\"]*\}\"(, )?)+\]\.$")


class BestCheckpoint(ModelCheckpoint):
    """Keeps ``best.ckpt``: the weights at the validation with the best ``tag`` (ties: the earliest).

    The measurements (``certified/``, ``robust/``, ``lipschitz/``, …) log on the first process only, and only at the
    epochs of their cadence (``every_n_epochs``): rank 0's value decides on every process (broadcast, so the
    processes save together), and a validation without the tag is passed over, as is a diverged run's. A tag that
    no validation logs leaves no best.ckpt, and the fit says so at its end."""

    def __init__(self, tag: str, mode: str) -> None:
        super().__init__(monitor=tag, mode=mode, filename="best", auto_insert_metric_name=False, save_top_k=1,
                         save_last=False)

    def _save_topk_checkpoint(self, trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        value = monitor_candidates.get(self.monitor)
        value = trainer.strategy.broadcast(None if value is None else float(value), src=0)
        if value is None or value != value:  # not measured at this validation; NaN: diverged
            return
        super()._save_topk_checkpoint(trainer, {**monitor_candidates, self.monitor: torch.tensor(value)})

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.best_model_path:
            rank_zero_warn(f"--best_checkpoint {self.monitor}: no validation logged it, so there is no best.ckpt; "
                           f"the tags a validation logs are in TensorBoard (val/, certified/, robust/, lipschitz/, …)")


class StabilityCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        super().__init__(
            ImageClassifier,
            ImageDataModule,
            subclass_mode_data=True,
            seed_everything_default=0,
            trainer_defaults={**TRAINER_DEFAULTS, "callbacks": [ModelCheckpoint(save_last=True), TensorBoardLayout(),
                                                                  TestResults()]},
            auto_configure_optimizers=False,  # the module builds its optimizer (stabilizers may supply one)
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"default_env": False},
            args=args,
            run=run,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--runs_dir", type=str, default="runs",
                            help="root of the run directories <runs_dir>/<data>/<backbone>/<stabilizers>/version_N")
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="write this run exactly here (events, config.yaml, checkpoints/) instead of "
                                 "<runs_dir>/.../version_N; sweeps use it")
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="after fit, run the test set with the test-time measurements on the final "
                                 "weights (skipped for a diverged run)")
        parser.add_argument("--best_checkpoint", type=str | None, default=None,
                            help="fit: also keep checkpoints/best.ckpt, the epoch with the best value of this "
                                 "validation tag (e.g. certified/acc_L2_1.58, val/acc), beside last.ckpt")
        parser.add_argument("--best_checkpoint_mode", type=Literal["max", "min"], default="max",
                            help="whether the best value of --best_checkpoint is its largest (accuracies) or its "
                                 "smallest (losses)")
        parser.add_argument("--stabilizer", type=str | list[str], default="none",
                            help=f"stabilizer name(s), comma-separated or a list; valid: {sorted(REGISTRY)}")
        groups = _option_groups()
        for name, cls in groups.items():
            parser.add_class_arguments(cls, name, instantiate=False, help=f"options of --stabilizer {name}")
        parser.link_arguments("stabilizer", "model.stabilizer", compute_fn=stabilizer_names)
        parser.link_arguments(("stabilizer", *groups), "model.stabilizer_options", compute_fn=selected_options)
        for key in LINKED_FROM_DATA:
            as_list = list if key in ("mean", "std") else None  # plain YAML lists in hparams, not tuples
            parser.link_arguments(f"data.{key}", f"model.{key}", compute_fn=as_list, apply_on="instantiate")
        parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})
        parser.add_lightning_class_args(DivergenceMonitor, "divergence")
        parser.add_lightning_class_args(TrainingStability, "stability")
        parser.add_lightning_class_args(EpochTimer, "timing")
        parser.add_lightning_class_args(CostMeter, "cost")
        parser.add_lightning_class_args(LipschitzMonitor, "lipschitz")
        parser.add_lightning_class_args(RobustnessMonitor, "robustness")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse with two changes of defaults:

        * the data class asked for (``--data X`` or ``data: class_path`` in a ``--config``), else the one stored in
          the ``--ckpt_path`` checkpoint, is made the default before parsing, so that its own defaults apply and
          its options parse (``stability test --ckpt_path X --data.root DIR`` without restating ``--data MNIST``) —
          jsonargparse otherwise parses them against the default class (Digits has no ``root``) and carries the
          options the classes share (e.g. Digits' ``random_crop: 0`` into CIFAR10) over from it, in the run and in
          ``--print_config`` alike;
        * with ``--ckpt_path``, parse again with the checkpoint's model, stabilizer and data settings
          as defaults, so the network is rebuilt as trained and command-line overrides still win.
        """
        if not isinstance(args, (dict, Namespace)):
            argv = sys.argv[1:] if args is None else list(args)
            data_class = requested_data_class(argv) or checkpoint_data_class(argv)
            if data_class is not None:
                for subparser in list(getattr(self, "_subcommand_parsers", {}).values()) or [parser]:
                    subparser.set_defaults({"data": {"class_path": data_class}})
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = subcommand and self.config[subcommand].get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).is_file() or isinstance(args, (dict, Namespace)):
            return
        self._subcommand_parsers[subcommand].set_defaults(checkpoint_defaults(ckpt_path))
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments` instead (Lightning's version lets the checkpoint override the CLI)."""

    def instantiate_trainer(self, **kwargs: Any):
        """Default logger: TensorBoard under <runs_dir>/<data>/<backbone>/<stabilizers>/version_N
        (``--trainer.default_root_dir`` moves the root when ``--runs_dir`` is left at its default), or
        exactly in ``--run_dir``.

        ``fit --ckpt_path last`` resumes the run's last checkpoint in its own directory: the run
        directory's with ``--run_dir``, else the newest version_N that has one. Resuming writes into
        the same events, dropping what was logged after the checkpoint (TensorBoard's purge step)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        uses_cuda = config.trainer.get("accelerator") in ("auto", "gpu", "cuda", None) and torch.cuda.is_available()
        if uses_cuda:
            allow_tf32_training()
        given = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        showing = config.trainer.get("enable_progress_bar") is not False
        if showing and not any(isinstance(c, ProgressBar) for c in given):
            # the bar reads the logged values back to the host whenever it redraws: as often as the logs are written
            every = max(1, config.trainer.get("log_every_n_steps") or 1)
            kwargs["callbacks"] = [*given, TQDMProgressBar(refresh_rate=every)]
        if config.trainer.get("logger") is None and "logger" not in kwargs:
            root = config.runs_dir
            default_root = config.trainer.get("default_root_dir")
            if default_root and root != "runs" and Path(default_root) != Path(root):
                raise ValueError(f"--trainer.default_root_dir {default_root} and --runs_dir {root} both set where runs "
                                 f"go; give one of them")
            if root == "runs" and default_root:
                root = default_root
            name, version = ("", "") if config.get("run_dir") else (
                f"{self.datamodule.name}/{self.model.run_name}", None)
            save_dir = config.run_dir or root
            extra = {}
            if self.subcommand == "fit" and config.get("ckpt_path"):
                checkpoint, version = self._resume_point(config.ckpt_path, Path(save_dir) / name, version)
                self.config_init[self.subcommand]["ckpt_path"] = str(checkpoint)
                extra["purge_step"] = checkpoint_step(checkpoint)
            kwargs["logger"] = TensorBoardLogger(save_dir=save_dir, name=name, version=version,
                                                 default_hp_metric=False, **extra)
        if self.subcommand == "fit" and config.get("best_checkpoint"):
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or given), BestCheckpoint(config.best_checkpoint,
                                                                                       config.best_checkpoint_mode)]
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand not in (None, "fit"):
            # test / validate / predict save no checkpoint: without the callback, restoring the checkpoint's own
            # callback state no longer warns that its directory "has changed" (noise to a user who only measures);
            # Lightning's request to provide it again is left out in _run_subcommand
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        if subcommand == "fit":
            return super()._run_subcommand(subcommand)
        with warnings.catch_warnings():  # for this subcommand only, and only when ModelCheckpoint is all it names
            warnings.filterwarnings("ignore", message=ONLY_MODEL_CHECKPOINT_MISSING)
            return super()._run_subcommand(subcommand)

    @staticmethod
    def _resume_point(ckpt_path: str, runs: Path, version: str | None) -> tuple[Path, str | None]:
        """(checkpoint file, logger version) that ``--ckpt_path`` (a file, or ``last``) resumes."""
        if ckpt_path != "last":
            checkpoint = Path(ckpt_path)
            run = checkpoint.resolve().parent.parent
            if version is None and checkpoint.parent.name == "checkpoints" and run.parent == runs.resolve():
                version = checkpoint.parent.parent.name  # a version_N of this model: continue it
        elif version == "":  # --run_dir
            checkpoint = runs / "checkpoints" / "last.ckpt"
        else:
            found = sorted(runs.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
            if not found:
                raise FileNotFoundError(f"--ckpt_path last: no version_*/checkpoints/last.ckpt under {runs}")
            checkpoint, version = found[-1], found[-1].parent.parent.name
        if not checkpoint.is_file():
            raise FileNotFoundError(f"--ckpt_path: checkpoint {checkpoint} not found")
        return checkpoint, version

    def after_fit(self) -> None:
        """``--test_after_fit``: test the final weights in the same run (same events file)."""
        if not self.config.fit.get("test_after_fit"):
            return
        if diverged(self.trainer) is not None:
            return
        self.trainer.test(self.model, datamodule=self.datamodule)


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint was saved at."""
    import torch

    return int(torch.load(path, weights_only=True, map_location="cpu").get("global_step", 0))


def diverged(trainer):
    """The divergence detector of a run that diverged, else None."""
    monitor = next((c for c in trainer.callbacks if isinstance(c, DivergenceMonitor)), None)
    return monitor.detector if monitor is not None and monitor.diverged else None


def release_process_group() -> None:
    """Tear the distributed process group down while the interpreter is fully alive, once every process has finished
    its subcommand. Lightning leaves it to the process's exit, where gloo's worker threads can still hold tensors
    whose release needs the interpreter being torn down: the process aborts ("terminate called without an active
    exception", status −6: a finished DDP run read as a crash). torch asks for ``destroy_process_group`` before exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in ("sweep", "report"):  # our own subcommands, beside Lightning's
        import importlib

        raise SystemExit(importlib.import_module(f"stability.{argv[0]}").main(argv[1:]))
    try:
        cli = StabilityCLI(args=args)
    except SIGTERMException:  # Lightning stops at the next step and exits with SystemExit(None): status 0, as if done
        print("stability: stopped by SIGTERM before the run ended; logs and checkpoints so far are kept (rerun with "
              "--ckpt_path last to resume)", file=sys.stderr)
        raise SystemExit(exit_codes.INTERRUPTED) from None
    except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        if os.environ.get("STABILITY_TRACEBACK"):
            raise
        print(f"stability: error: {err}\n(set STABILITY_TRACEBACK=1 to see where it was raised)", file=sys.stderr)
        raise SystemExit(exit_codes.BAD_INPUT) from None
    release_process_group()  # every process got here: its subcommand returned (errors above leave it to the exit)
    detector = diverged(cli.trainer)
    if detector is not None:
        print(f"stability: run diverged at step {detector.diverged_at_step}: {detector.reason}; "
              f"logs and checkpoints so far are kept in {cli.trainer.log_dir}", file=sys.stderr)
        raise SystemExit(exit_codes.DIVERGED)


if __name__ == "__main__":
    main()
