"""Training-stability signals every ``log_every_n_steps`` steps: the global gradient norm and one
per transformer block (``stability/grad_norm[/<block>]``), the largest |activation| at the output of
each block (``stability/act_max/<block>``), the signals of Wortsman et al. 2023 ("Small-scale proxies for
large-scale Transformer training instabilities") — the largest attention logit per layer
(``stability/attn_logit_max/<layer>``: attention-logit growth), the mean attention entropy per layer
(``stability/attn_entropy/<layer>``: entropy collapse, Zhai et al. 2023) and the output's mean log Z
(``stability/log_z``: output-logit divergence) —, and what each selected stabilizer reports of itself
(``stability/<stabilizer>/<signal>``: a cap's excess, the soft cap's α, a margin's bound). Divergence is
:class:`~stability.callbacks.divergence.DivergenceMonitor`'s job. The attention signals are those of the
training forward itself (its logits, observed through :func:`~stability.models.observe_attention_logits`).

Nothing is read back to the host here: the values are device tensors, computed only on the steps that
log them (gradient norms with one fused kernel over all parameters), and Lightning reads them when it
writes the logs."""
from __future__ import annotations

import contextlib

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .. import tags
from ..models import observe_attention_logits, residual_sites
from ..nn.precision import at_least_float32


class TrainingStability(L.Callback):
    """Args: log_every_n_steps (0: never; the steps are those at which Lightning writes its logs when it
    equals the trainer's ``log_every_n_steps``)."""

    def __init__(self, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be >= 0 (0: never), got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self._activations: dict[str, torch.Tensor] = {}
        self._handles: list = []
        self._blocks: dict = {}
        self._recording = False
        self._attention: dict[str, list[torch.Tensor]] = {}  # layer → [max logit, entropy sum, calls]
        self._log_z: torch.Tensor | None = None
        self._observing = contextlib.ExitStack()
        self._said_unobserved = False

    def _measuring(self, trainer) -> bool:
        return self.log_every_n_steps > 0 and (trainer.global_step + 1) % self.log_every_n_steps == 0

    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.log_every_n_steps:
            return
        self._blocks = {site.name.rpartition(".")[0]: site.block
                        for site in residual_sites(pl_module.network.backbone)}
        self._handles = [block.register_forward_hook(self._record(name)) for name, block in self._blocks.items()]

    def _record(self, name):
        def hook(module, args, out):
            if module.training and self._recording:
                self._activations[name] = out.detach().abs().amax()
        return hook

    def _observe(self, layer: str, logits: torch.Tensor) -> None:
        logits = at_least_float32(logits)
        entropy = torch.special.entr(logits.softmax(dim=-1)).sum(dim=-1).mean()
        top = logits.amax()
        if layer in self._attention:
            seen = self._attention[layer]
            self._attention[layer] = [torch.maximum(seen[0], top), seen[1] + entropy, seen[2] + 1]
        else:
            self._attention[layer] = [top, entropy, 1]

    def _record_log_z(self, module, args, logits) -> None:
        if module.training and self._recording:
            self._log_z = torch.logsumexp(at_least_float32(logits.detach()), dim=-1).mean()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recording = self._measuring(trainer)
        self._activations, self._attention, self._log_z = {}, {}, None
        if self._recording:
            network = pl_module.network
            pl_module.eager_forward = True  # the hooks below run in the plain network's forward, not a compiled one
            self._observing.callback(setattr, pl_module, "eager_forward", False)
            unobserved = self._observing.enter_context(observe_attention_logits(network.backbone, self._observe))
            handle = network.register_forward_hook(self._record_log_z)
            self._observing.callback(handle.remove)
            if unobserved and not self._said_unobserved:
                rank_zero_info(f"training stability: the attention logits of {', '.join(unobserved)} cannot be "
                               f"observed; no {tags.ATTN_LOGIT_MAX} / {tags.ATTN_ENTROPY} for them")
                self._said_unobserved = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._recording = False
        self._observing.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._observing.close()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._measuring(trainer):
            return
        metrics: dict[str, torch.Tensor | float] = {}
        norms = {id(p): n for p, n in _gradient_norms(pl_module.parameters())}
        for name, block in self._blocks.items():
            squares = [norms[id(p)].square() for p in block.parameters() if id(p) in norms]
            if squares:
                metrics[f"{tags.GRAD_NORM}/{name}"] = torch.stack(squares).sum().sqrt()
        if norms:
            metrics[tags.GRAD_NORM] = torch.stack([n.square() for n in norms.values()]).sum().sqrt()
        metrics.update({f"{tags.ACT_MAX}/{k}": v for k, v in self._activations.items()})
        for layer, (top, entropy_sum, calls) in self._attention.items():
            metrics[f"{tags.ATTN_LOGIT_MAX}/{layer}"] = top
            metrics[f"{tags.ATTN_ENTROPY}/{layer}"] = entropy_sum / calls
        if self._log_z is not None:
            metrics[tags.LOG_Z] = self._log_z
        for stab in pl_module.stabilizers:
            metrics.update({tags.stabilizer_signal(stab.name, k): v for k, v in stab.signals().items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._observing.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _gradient_norms(parameters) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, ‖grad‖₂ in at least float32) for every parameter with a gradient, one fused call per dtype and
    device."""
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad:
        return []
    norms = torch._foreach_norm([at_least_float32(p.grad.detach()) for p in with_grad])
    return list(zip(with_grad, norms))
