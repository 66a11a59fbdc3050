"""torch.optim.Muon with the matrices of one shape orthogonalised together.

torch.optim.Muon (2.9–2.11) steps one matrix at a time: per matrix a momentum update, the Frobenius normalisation and
five Newton–Schulz iterations (three matrix products each), the decay and the update — about 23 kernel launches a
matrix, 1,700 a step on ViT-S, where the model's own step is under 700. :class:`ShapeBatchedMuon` computes the same
update with every matrix of one shape stacked: the momentum as one ``_foreach`` operation per parameter group, each
Newton–Schulz product as one batched product per shape on the wide side (``bmm``/``baddbmm``; a tall matrix joins the
wide ones of its transposed shape, so ViT's fc1 and fc2 share one batch), the decay and the update one ``_foreach``
operation per group and learning rate. Its state (``momentum_buffer`` per matrix), parameter groups and options are
torch.optim.Muon's, so checkpoints move between the two. (One difference: with bfloat16 weights and no Nesterov,
torch's Newton–Schulz divides the momentum buffer itself in place — ``grad.bfloat16()`` is the buffer — where this
class leaves the buffer as its momentum update made it.)

The Newton–Schulz iteration is torch's (Keller Jordan's quintic on X/‖X‖_F, on the wide side, in bfloat16):
X ← aX + (bA + cA²)X with A = XXᵀ. Batched products add the same terms in bfloat16 as the single ones, so on one
device the two agree to bfloat16 rounding (tests/test_optim_muon.py holds them to it, and a planted error — another
polynomial, a missing transpose, a skipped normalisation — outside it).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def newton_schulz_stack(stack: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """torch.optim.Muon's orthogonalisation of each matrix of ``stack`` (G, A, B), batched: in bfloat16, on the wide
    side, each matrix divided by its own Frobenius norm (at least ``eps``), then ``steps`` quintic iterations."""
    a, b, c = coefficients
    x = stack.bfloat16()
    tall = stack.shape[-2] > stack.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


orthogonalise = newton_schulz_stack  # what the optimizer calls (stability/testing/parity.py swaps in float32)


def multiply_in_place(tensors: list[Tensor], factors: float | list[float]) -> None:
    """tensors[i] ← factor·tensors[i], one factor for all or one each: a multi-tensor multiply (one launch) on float32
    and float64 tensors; on bf16 / fp16 ones each tensor's own ``mul_``, because a multi-tensor multiply rounds the
    factor to their dtype (0.998 → 0.996 in bf16 on the CPU) where ``mul_`` keeps it exact."""
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        torch._foreach_mul_(tensors, factors)
        return
    for t, factor in zip(tensors, factors if isinstance(factors, list) else [factors] * len(tensors)):
        t.mul_(factor)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape`` (A, B): ``original`` (the default)
    lr·√max(1, A/B), ``match_rms_adamw`` 0.2·lr·√max(A, B)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: ShapeBatchedMuon supports 'original' and 'match_rms_adamw'")


class ShapeBatchedMuon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, state and update), its matrices of one shape orthogonalised as one batch."""

    def __init__(self, params, *args, **options) -> None:
        super().__init__(params, *args, **options)
        for group in self.param_groups:
            adjusted_lr(1.0, group["adjust_lr_fn"], (1, 1))  # an adjustment this class lacks: refused at once

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []  # (group, its matrices, their momentum-corrected updates)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse or torch.is_complex(p) for p in params):
                raise RuntimeError("ShapeBatchedMuon: sparse gradients and complex parameters are not supported")
            grads = [p.grad for p in params]
            for p in params:  # torch.optim.Muon's state: a momentum buffer per matrix, zeros at first
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buffers = [self.state[p]["momentum_buffer"] for p in params]
            momentum = group["momentum"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)  # B ← μB + (1 − μ)g, as torch's buf.lerp_
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            stepped.append((group, params, list(updates)))
        orthogonal = self._orthogonalised(stepped)
        for (group, params, _), updates in zip(stepped, orthogonal):
            lr = float(group["lr"])
            if group["weight_decay"]:
                multiply_in_place(params, 1 - lr * group["weight_decay"])
            by_rate: dict[float, list[int]] = {}
            for i, p in enumerate(params):
                by_rate.setdefault(adjusted_lr(lr, group["adjust_lr_fn"], p.shape), []).append(i)
            for rate, members in by_rate.items():
                torch._foreach_add_([params[i] for i in members], [updates[i] for i in members], alpha=-rate)
        return loss

    @staticmethod
    def _orthogonalised(stepped) -> list[list[Tensor]]:
        """Each group's updates orthogonalised, every matrix of one shape (and iteration settings) across all groups
        in one batch, a tall matrix beside the wide ones of its transposed shape (torch's Newton–Schulz transposes
        it to the wide side first: ViT's fc1 and fc2 share a batch)."""
        batches: dict[tuple, list[tuple[int, int]]] = {}
        for g, (group, _, updates) in enumerate(stepped):
            settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
            for i, u in enumerate(updates):
                wide = tuple(u.shape) if u.shape[-2] <= u.shape[-1] else tuple(u.shape[::-1])
                batches.setdefault((wide, u.dtype, u.device, settings), []).append((g, i))
        out = [[None] * len(updates) for _, _, updates in stepped]
        for (_, dtype, _, (coefficients, steps, eps)), members in batches.items():
            tall = [stepped[g][2][i].shape[-2] > stepped[g][2][i].shape[-1] for g, i in members]
            members = [m for m, t in zip(members, tall) if not t] + [m for m, t in zip(members, tall) if t]
            wide = len(tall) - sum(tall)
            stack = torch.stack([stepped[g][2][i].mT if k >= wide else stepped[g][2][i] for k, (g, i) in
                                 enumerate(members)])
            orthogonal = orthogonalise(stack, coefficients, steps, eps)
            # in the weights' dtype and layout (bf16 → float32 is exact; the update adds in float32 either way), so
            # that the update's _foreach_add_ takes CUDA's fused path: it needs one dtype and one layout in its lists
            parts = [orthogonal[:wide].to(dtype=dtype, memory_format=torch.contiguous_format),
                     orthogonal[wide:].mT.to(dtype=dtype, memory_format=torch.contiguous_format)]
            matrices = [m for part in parts if len(part) for m in part.unbind(0)]
            for (g, i), matrix in zip(members, matrices):
                out[g][i] = matrix
        return out


__all__ = ["ShapeBatchedMuon", "adjusted_lr", "multiply_in_place", "newton_schulz_stack", "orthogonalise"]
