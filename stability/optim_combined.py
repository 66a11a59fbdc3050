"""One optimizer object made of several (Muon for matrices, AdamW for the rest), as Lightning's
automatic optimisation and LR schedulers expect a single optimizer."""
from __future__ import annotations

from collections.abc import Callable

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps each inner optimizer in turn; ``param_groups`` are theirs (shared dicts), so a
    scheduler that sets ``lr`` on them reaches every inner optimizer. ``before_update`` runs after
    the closure (forward and backward) and before the inner steps."""

    def __init__(self, optimizers: list[torch.optim.Optimizer],
                 before_update: Callable[[], None] | None = None) -> None:
        self.optimizers = optimizers
        self.before_update = before_update
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.before_update is not None:
            self.before_update()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for opt, state in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(state)
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]
