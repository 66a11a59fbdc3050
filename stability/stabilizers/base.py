"""The stabilizer interface: the hooks the training module calls, and nothing else.

A stabilizer never reaches into the training loop. :class:`~stability.classifier.ImageClassifier`
calls, for each selected stabilizer, in the order given:

1. ``prepare(network)`` once, when the module is built (before a checkpoint is loaded, so
   that a changed architecture — CenterNorm, cosine attention, weighted residuals — has
   the matching state dict), to swap modules or re-initialise weights; stabilizers with
   ``prepare_order = 0`` (those that swap modules) go first, constraints (2) last; then
   ``after_prepare(network)``, once each, for a change that needs the final architecture (LipsFormer folds its
   residual scales into the Linear layers that write their branches);
2. ``task_loss(step, default)`` on every training forward pass, to replace the task loss (the
   objective actually optimised, e.g. a margin loss): ``default(logits)`` is the module's
   cross-entropy; at most one selected stabilizer may return one (None: keep the default);
3. ``loss(step)`` on every training forward pass, returning a term added to the task
   loss (logged as ``loss/<name>``) or None; ``needs_attention_probs = True`` makes the
   module record the attention probabilities for it (the fused path stays on otherwise);
4. ``build_optimizer(network, default)`` once, to supply an optimizer instead of the
   default one (at most one selected stabilizer may do so); ``default(named_parameters)``
   builds the module's default optimizer, with its settings, over the parameters given;
5. ``after_optimizer_step(network, global_step)`` after every optimizer step (the step's index), to
   project weights;
   ``constrained_parameters(network)`` names the parameters it keeps norm-bounded that way — a
   stabilizer with ``wants_constrained_network`` makes the run list every parameter no one does;
6. ``step_bounds()`` for the a-priori size of each step of the parameters its optimizer steps;
   ``signals()`` for values worth watching during training (a cap's excess, a soft cap's α), logged every
   ``log_every_n_steps`` as ``stability/<name>/<key>`` and read only then (no host sync per step);
7. ``lipschitz_bound(network)`` for a certified global Lipschitz upper bound (a number or a
   :class:`~stability.lipschitz.certified.Bound`), where the method has one (None otherwise —
   never a made-up number); ``labelled_bounds(network)`` for other bounds worth logging beside it
   that certify nothing in pixel space (e.g. a paper's own bound, in its own norms).

A new method is one file in this package: a subclass with ``name``, ``summary`` and ``source``,
decorated with :func:`register_stabilizer`. The package imports every module in it, so the
method is then selectable, documented in the generated table and trained by the tests on every
backbone.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch
from torch import nn

REGISTRY: dict[str, type[Stabilizer]] = {}
S = TypeVar("S", bound="type[Stabilizer]")


def register_stabilizer(cls: S) -> S:
    """Class decorator: make ``cls`` selectable as ``--stabilizer <cls.name>``.

    Registration happens where the class is defined (as timm's ``@register_model``); the CLI, the
    checkpoint restore, the docs table and the training tests all iterate :data:`REGISTRY`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"stabilizer name {cls.name!r} is taken by {REGISTRY[cls.name].__qualname__}")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class ForwardStep:
    """What one training forward pass produced, handed to :meth:`Stabilizer.loss`."""

    network: nn.Module
    inputs: torch.Tensor  # (B, C, H, W) in [0, 1]
    logits: torch.Tensor  # (B, num_classes)
    targets: torch.Tensor  # (B,) class indices or (B, num_classes) soft labels
    attention_probs: list[torch.Tensor] = field(default_factory=list)  # each (B', H, N, N)
    queries_keys: list[tuple] = field(default_factory=list)  # each (q, k, scale), q and k (B, H, N, d)
    global_step: int = 0
    total_steps: int = 0  # the run's optimizer steps (0: unknown, outside a trainer)

    @property
    def progress(self) -> float | None:
        """The fraction of training done before this step (None where the run's length is unknown)."""
        return self.global_step / self.total_steps if self.total_steps > 0 else None

    def soft_targets(self) -> torch.Tensor:
        """The targets as (B, num_classes) label distributions (class indices become one-hot), in the logits'
        accumulation dtype (float32, or float64 for a float64 network)."""
        dtype = torch.promote_types(self.logits.dtype, torch.float32)
        if self.targets.ndim == 2:
            return self.targets.to(dtype)
        return nn.functional.one_hot(self.targets, self.logits.shape[-1]).to(dtype)


class Stabilizer:
    """Base class: every hook does nothing. Subclasses set ``name`` and override what they need."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line: what it does (the docs table)
    source: ClassVar[str] = ""  # where it comes from (paper, year)
    needs: ClassVar[tuple[str, ...]] = ()  # stabilizers it only works beside (e.g. a certified bound's)
    backbones: ClassVar[tuple[str, ...]] = ("vit", "swin", "cswin")  # where it applies
    # prepare() runs in this order (stable within a level): 0 for stabilizers that swap modules,
    # so that the others (which attach buffers or parametrisations) see the final architecture.
    prepare_order: ClassVar[int] = 1
    needs_attention_probs: bool = False  # a class or an instance attribute
    needs_queries_keys: bool = False  # (q, k, scale) of every attention call, fused path kept (ViT)
    wants_constrained_network: bool = False  # the run lists the parameters no stabilizer constrains
    conflicts: ClassVar[dict[str, str]] = {}  # stabilizers it cannot be combined with, and why (either side may say)
    takes_label_smoothing: ClassVar[bool] = True  # False: its task loss has no label-smoothed form (refused by name)
    compiles_whole_term: ClassVar[bool] = False  # True: compile_terms() puts all of loss() into one compiled graph

    def prepare(self, network: nn.Module) -> None:
        """Change the network before training (swap layers, re-initialise weights)."""

    def after_prepare(self, network: nn.Module) -> None:
        """Called once after every selected stabilizer's ``prepare``: a change that needs the final architecture."""

    def compile_refusal(self) -> str | None:
        """Why the network cannot train compiled (``--model.compile true``) beside this stabilizer, or None."""
        if self.needs_attention_probs or self.needs_queries_keys:
            return ("it reads the attention maps (or the queries and keys) of every training step through forward "
                    "hooks, which a compiled graph does not call")
        return None

    def compile_terms(self) -> None:
        """The network trains compiled (``--model.compile true``): compile this stabilizer's per-step work too where
        it can be (default: nothing to compile)."""

    def task_loss(self, step: ForwardStep, default: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """The objective to optimise instead of ``default(step.logits)`` (the module's cross-entropy), or None."""
        return None

    def loss(self, step: ForwardStep) -> torch.Tensor | None:
        """A scalar term added to the task loss, or None."""
        return None

    def build_optimizer(self, network: nn.Module,
                        default: Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer],
                        ) -> torch.optim.Optimizer | None:
        """Return an optimizer to use instead of ``default(network.named_parameters())``, or None."""
        return None

    def on_device(self, device: torch.device) -> None:
        """Called before the first training forward pass on ``device`` (and again if it changes)."""

    def after_optimizer_step(self, network: nn.Module, global_step: int = 0) -> None:
        """Project weights after each optimizer step (``global_step``: the index of the step just taken)."""

    def on_load_checkpoint(self, checkpoint: dict, network: nn.Module) -> None:
        """Bring a checkpoint saved by an older version of this stabilizer to the current layout, in place, before
        Lightning restores it (or raise a ValueError saying in one line why it cannot resume)."""

    def step_bounds(self) -> dict[int, float]:
        """id(parameter) → an a-priori bound on the Frobenius norm of its change in one optimizer step, for the
        parameters this stabilizer's optimizer steps (Muon's), where the step is known in size (empty by default).
        Cross-device comparisons check each side's step against it (stability/testing/parity.py)."""
        return {}

    def signals(self) -> dict[str, float | torch.Tensor]:
        """Scalars to log every ``log_every_n_steps`` steps (read only then: device tensors stay on the device)."""
        return {}

    def constrained_parameters(self, network: nn.Module) -> list[nn.Parameter]:
        """The parameters whose norm this stabilizer bounds after every step, or whose layers it keeps 1-Lipschitz for
        every value (AOL)."""
        return []

    def lipschitz_bound(self, network: nn.Module):
        """A certified global ℓ2 Lipschitz upper bound of pixels → logits (a float or a
        :class:`~stability.lipschitz.certified.Bound`), or None where none exists."""
        return None

    def labelled_bounds(self, network: nn.Module) -> dict[str, float]:
        """Other bounds to log beside the certified one, ``{name: value}`` (they certify nothing)."""
        return {}

    def hparams(self) -> dict:
        """The options of this stabilizer, for logging (``vars(self)`` of plain values by default)."""
        return {k: v for k, v in vars(self).items()
                if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"
