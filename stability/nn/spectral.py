"""Spectral norms and the weight operations built on them.

σ₁(W) is the largest singular value. The RMS→RMS norm of a (d_out × d_in) matrix is
‖W‖_RMS = sqrt(d_in / d_out) · σ₁(W) (Newhouse et al. 2025; docs/methods.md#muon-and-weight-constraints).

Two kinds of σ₁ live here. :func:`spectral_norms` is exact (an eigensolver, float64): for
measurements and occasional checks. :class:`SubspaceIteration` is the per-step kind: a persistent
orthonormal block of vectors per matrix, kept as a buffer of the module that owns the matrix (so it
moves with it, is saved in checkpoints and resumes), one batched float32 step per shape, matmuls only,
no host sync. Its estimate lies below σ₁ and, warm-started from the last step's block, within ~1e-5 of
it in training (measured, see the class). :func:`power_iteration` is the one-vector estimator
Specformer's paper prescribes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .precision import float32_math, ieee_float32


def power_iteration(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                    iterations: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` steps of v ← Wᵀu/‖·‖, u ← Wv/‖·‖ on (batched) matrices (..., m, n).

    u: (..., m), v: (..., n). Returns the new (u, v); no gradient flows through them.
    """
    with torch.no_grad():
        for _ in range(iterations):
            v = F.normalize(torch.einsum("...mn,...m->...n", weight, u), dim=-1)
            u = F.normalize(torch.einsum("...mn,...n->...m", weight, v), dim=-1)
    return u, v


def sigma_from_vectors(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """σ ≈ uᵀ W v (differentiable in W, with u, v held constant), shape (...)."""
    return torch.einsum("...m,...mn,...n->...", u, weight, v)


def spectral_norm(weight: torch.Tensor) -> torch.Tensor:
    """Exact σ₁ of (batched) matrices, by SVD."""
    return torch.linalg.matrix_norm(weight, ord=2)


def spectral_norms(weights: list[torch.Tensor], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Exact σ₁ of each matrix, (len(weights),) in ``dtype``: σ₁² is the largest eigenvalue of the
    smaller Gram matrix W Wᵀ or Wᵀ W (symmetric eigensolver — cheaper than an SVD), one batched call
    per shape. On a GPU the eigensolver synchronises with the host: for measurements, not per step."""
    out = torch.empty(len(weights), dtype=dtype, device=weights[0].device if weights else "cpu")
    with ieee_float32():
        for indices, stacked in grouped_by_shape(weights):
            w = stacked.detach().to(dtype)
            gram = w @ w.mT if w.shape[-2] <= w.shape[-1] else w.mT @ w
            out[indices] = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
    return out


def grouped_by_shape(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """[(indices, stacked tensors)] for each distinct shape, in first-seen order."""
    return [(indices, torch.stack([tensors[i] for i in indices])) for indices in shape_groups(tensors)]


@dataclass
class TopSingular:
    """The matrices of one shape after a :class:`SubspaceIteration` step: ``weight`` (G, m, n) a float32
    copy, ``sigma`` (G,) = ‖W v‖ ≤ σ₁ the estimate, ``u`` (G, m) and ``v`` (G, n) its unit vectors."""

    indices: list[int]
    weight: torch.Tensor
    sigma: torch.Tensor | None
    u: torch.Tensor | None
    v: torch.Tensor | None


class SubspaceIteration:
    """Persistent block power iteration with Rayleigh–Ritz, the per-step estimate of σ₁ and its vectors.

    Each matrix keeps an orthonormal basis V (n × b, b = min(``block``, m, n)) as the buffer ``<prefix>_basis``
    of a module ``homes[i] = (module, prefix)`` — registered here from a seeded generator, so it moves with
    the module, is saved in checkpoints and a run is reproducible. A :meth:`step` computes, for all matrices of
    one shape at once, V ← orth(WᵀW V) (``iterations`` times; Cholesky QR, matmuls and a b × b triangular solve, the
    Cholesky QR of every shape with the same n × b basis in one batch)
    and then the top Ritz pair of WᵀW on span V: x the top eigenvector of T = (WV)ᵀ(WV) by repeated squaring,
    v = Vx/‖Vx‖, σ = ‖Wv‖, u = Wv/σ. σ ≤ σ₁ always (it is ‖Wv‖ for a unit v).

    Why a block: a weight trained with Adam at a large learning rate changes its top singular direction
    every step among nearly equal singular values, which a single persistent vector follows too slowly
    (measured on digits, micro ViT, AdamW lr 1e-2, σ_max = 1: one vector, one step — the stored weight
    exceeded the cap by up to 24% and 4% in the median; a block of 8 — by at most 6e-6).

    Float32 with autocast and TF32 off; no value leaves the device."""

    def __init__(self, homes: list[tuple[nn.Module, str]], shapes: list[tuple[int, int]], block: int = 8,
                 seed: int = 0) -> None:
        if len(homes) != len(shapes):
            raise ValueError(f"one home per matrix: {len(homes)} homes for {len(shapes)} shapes")
        self.homes = list(homes)
        self.compiled = False  # :meth:`compile`: every later step one compiled graph
        self._compiled_step = None
        generator = torch.Generator().manual_seed(seed)
        for (module, prefix), (m, n) in zip(self.homes, shapes):
            if hasattr(module, f"{prefix}_basis"):
                continue
            like = next(module.parameters(), None)
            gaussian = torch.randn(n, max(1, min(block, m, n)), generator=generator, dtype=torch.float64, device="cpu")
            basis = torch.linalg.qr(gaussian)[0].float()
            module.register_buffer(f"{prefix}_basis", basis if like is None else basis.to(like.device))

    @classmethod
    def of_weights(cls, modules: list[nn.Module], prefix: str, block: int = 8, seed: int = 0) -> SubspaceIteration:
        """One for the ``weight`` of each module, its basis kept on that module."""
        return cls([(m, prefix) for m in modules], [tuple(m.weight.shape) for m in modules], block, seed)

    def basis(self, index: int) -> torch.Tensor:
        module, prefix = self.homes[index]
        return getattr(module, f"{prefix}_basis")

    def compile(self) -> None:
        """Run every later :meth:`step` as one compiled graph (``--model.compile``), called inside the float32
        context (which sets torch's matmul precision, something a graph cannot do). Every instance shares the one
        compiled function, an entry per configuration (shapes, dtype, device, iterations): its limit is raised as
        :class:`~stability.robustness.fixed_batch.FixedBatch` raises it."""
        self.compiled = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled_step": None}  # a compiled function does not pickle

    @torch.no_grad()
    def step(self, matrices: list[torch.Tensor], iterations: int = 1) -> list[TopSingular]:
        """``iterations`` subspace steps on ``matrices`` (their current values, in the order given at
        construction), then the top Ritz pair; one :class:`TopSingular` per shape. The Ritz step's small
        eigenproblems (b × b, the same b for every matrix at least ``block`` wide) are solved for all shapes at once:
        a model's dozen shapes take one set of launches, not a dozen. Compiled (:meth:`compile`), one graph, between
        the eager stacks (:meth:`stacked`) and the bases' write-back (:meth:`write_back`)."""
        matrices = [w.detach() for w in matrices]
        groups = shape_groups(matrices)
        run = subspace_step
        if getattr(self, "compiled", False):  # (an object pickled before compiling existed has no flag)
            if getattr(self, "_compiled_step", None) is None:
                self._compiled_step = torch.compile(subspace_step, fullgraph=True, dynamic=False)
            run = self._compiled_step
        with float32_math(matrices[0].device.type):
            results = run(*self.stacked(matrices, groups), max(1, iterations))
            self.write_back(groups, results)
        return [TopSingular(indices, *result[:4]) for indices, result in zip(groups, results)]

    def stacked(self, matrices: list[torch.Tensor], groups: list[list[int]]) -> tuple[list[torch.Tensor], ...]:
        """Each group's matrices and bases stacked, (G, m, n) and (G, n, b): outside the compiled graph, one launch
        a stack on a GPU (up to 128 inputs), where the graph would copy each member on its own (Inductor's
        concatenation of more than 8 inputs is a copy kernel an input)."""
        return ([torch.stack([matrices[i] for i in indices]) for indices in groups],
                [torch.stack([self.basis(i) for i in indices]) for indices in groups])

    def write_back(self, groups: list[list[int]], results: list[tuple[torch.Tensor, ...]]) -> None:
        """The new bases into their buffers, one multi-tensor copy a group (outside the graph, as :meth:`stacked`)."""
        for indices, result in zip(groups, results):
            torch._foreach_copy_([self.basis(i) for i in indices], list(result[4].unbind(0)))


def shape_groups(tensors: list[torch.Tensor], tags: list | None = None) -> list[list[int]]:
    """The indices of the tensors of each (shape, dtype, device) — and tag, where ``tags`` gives each tensor one —,
    in first-seen order."""
    tags = [None] * len(tensors) if tags is None else tags
    groups: dict[tuple, list[int]] = {}
    for i, (t, tag) in enumerate(zip(tensors, tags)):
        groups.setdefault((tuple(t.shape), t.dtype, t.device, tag), []).append(i)
    return list(groups.values())


def subspace_step(stacks: list[torch.Tensor], bases: list[torch.Tensor],
                  iterations: int) -> list[tuple[torch.Tensor, ...]]:
    """:meth:`SubspaceIteration.step`'s work on plain tensors (inside :func:`~.precision.float32_math`): for each
    stack of same-shape matrices (G, m, n) and their bases (G, n, b), ``iterations`` orthonormalised products, then
    the top Ritz pair; (W as a float32-at-least stack, σ, u, v, the new bases in the old bases' dtype) per stack."""
    ws = [stacked.to(torch.promote_types(stacked.dtype, torch.float32)) for stacked in stacks]  # (G, m, n) each
    current = [old.to(w.dtype) for w, old in zip(ws, bases)]  # (G, n, b) each
    for _ in range(iterations):
        current = _batched(_orthonormal, [w.mT @ (w @ basis) for w, basis in zip(ws, current)], current)
    pending = [(w, basis, w @ basis, old.dtype) for w, basis, old in zip(ws, current, bases)]  # images (G, m, b)
    tops = _batched(_top_eigenvector, [images.mT @ images for _, _, images, _ in pending])  # each (G, b)
    results = []
    for (w, basis, images, dtype), x in zip(pending, tops):
        v, wv = (basis @ x.unsqueeze(-1)).squeeze(-1), (images @ x.unsqueeze(-1)).squeeze(-1)
        v_norm = v.norm(dim=-1).clamp_min(torch.finfo(w.dtype).tiny)
        sigma = wv.norm(dim=-1) / v_norm
        u = wv / (sigma * v_norm).clamp_min(torch.finfo(w.dtype).tiny).unsqueeze(-1)
        results.append((w, sigma, u, v / v_norm.unsqueeze(-1), basis.to(dtype)))
    return results


RECOMPILE_LIMIT = 64  # dynamo's cache entries per code object, at least, once a SubspaceIteration compiles


def _batched(solve: Callable[..., torch.Tensor], stacks: list[torch.Tensor],
             *alongside: list[torch.Tensor]) -> list[torch.Tensor]:
    """``solve`` of every (G_i, …) stack of ``stacks`` (with the i-th stack of each list in ``alongside``), the
    stacks of one trailing shape, dtype and device concatenated into one batch: every matrix of n columns whatever
    its rows, for :func:`_orthonormal` (W_Q^h of 64 rows, W_O of 384, fc1 of 1,536 on ViT-S: one factorisation, not
    three), and every b × b Gram matrix for :func:`_top_eigenvector`. ``solve`` treats each matrix on its own, so
    batching changes nothing but the number of launches."""
    by_kind: dict[tuple, list[int]] = {}
    for i, stack in enumerate(stacks):
        by_kind.setdefault((*stack.shape[1:], stack.dtype, stack.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(stacks)
    for members in by_kind.values():
        if len(members) == 1:
            out[members[0]] = solve(stacks[members[0]], *(other[members[0]] for other in alongside))
            continue
        solved = solve(torch.cat([stacks[i] for i in members]),
                       *(torch.cat([other[i] for i in members]) for other in alongside))
        for i, part in zip(members, solved.split([stacks[i].shape[0] for i in members])):
            out[i] = part
    return out


FLOAT32_EPS = torch.finfo(torch.float32).eps


def _orthonormal(z: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of z (G, n, b) by shifted Cholesky QR: z·L⁻ᵀ with LLᵀ = zᵀz + δI.

    The shift δ = 64·b·u·tr(zᵀz), u float32's unit roundoff whatever z's dtype (so that a float64 run computes the
    same function as a float32 one, its reference), keeps the condition number of zᵀz + δI under 1/(64·b·u), where
    the factorisation cannot break down in float32, even when z is rank-deficient (a weight of
    rank 2 after one Adam step from zero: with a shift of 1e-6 of the mean eigenvalue, float32's Cholesky failed
    and the basis became NaN). The result is a contraction, never longer than orthonormal (its Gram matrix is
    I − δL⁻¹L⁻ᵀ), so a Ritz value from it stays ≤ σ₁² (v is normalised afterwards); the shrinking reaches the
    directions whose eigenvalue of zᵀz is not far above δ ≈ 5e-4·λ₁ (b = 8, float32: those with σ ≲ 0.15·σ₁ in the
    iterate), not the top one. A zero z (a zero-initialised matrix), or a factorisation that fails all the same,
    keeps ``previous`` (the estimate stays a lower bound, one step staler). No host sync (``cholesky_ex``, triangular
    solve) (Fukaya et al. 2020, shifted CholeskyQR)."""
    gram = z.mT @ z  # (G, b, b)
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)  # (G,)
    size = gram.shape[-1]
    shift = (64 * size * FLOAT32_EPS * trace + torch.finfo(z.dtype).tiny)[:, None, None]  # float32's, in every dtype
    lower, info = torch.linalg.cholesky_ex(gram + shift * torch.eye(size, dtype=z.dtype, device=z.device))
    basis = torch.linalg.solve_triangular(lower, z.mT, upper=False).mT
    usable = (trace > 0) & (info == 0) & torch.isfinite(basis).flatten(1).all(-1)
    return torch.where(usable[:, None, None], basis, previous)


def _top_eigenvector(t: torch.Tensor, squarings: int = 10) -> torch.Tensor:
    """The top eigenvector of symmetric PSD matrices t (G, b, b), unit length: the column of largest norm of
    t^(2^squarings) (normalised as it goes), which is ≈ c·x xᵀ for the top eigenvector x."""
    p = t
    for _ in range(squarings):
        p = p / p.flatten(-2).norm(dim=-1).clamp_min(torch.finfo(t.dtype).tiny)[:, None, None]
        p = p @ p
    column = p.norm(dim=-2).argmax(-1)  # (G,)
    x = torch.gather(p, -1, column[:, None, None].expand(-1, p.shape[-2], 1)).squeeze(-1)
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny)


def top_singular_value(weight: torch.Tensor, squarings: int = 10) -> torch.Tensor:
    """σ₁ of a matrix (m, n) estimated from below without leaving the device: √(xᵀGx) for x the top eigenvector of
    the smaller Gram matrix G by repeated squaring (no eigensolver, no host sync); differentiable in the weight
    through G with x held constant. For a small matrix, e.g. a classifier head, every training step."""
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))
    g = w @ w.mT if w.shape[0] <= w.shape[1] else w.mT @ w
    x = _top_eigenvector(g.detach()[None], squarings)[0]
    return (x @ g @ x).clamp_min(0).sqrt()


def rms_scale(weight: torch.Tensor) -> float:
    """sqrt(d_in / d_out): multiply σ₁ by it for the RMS→RMS norm."""
    return (weight.shape[-1] / weight.shape[-2]) ** 0.5


def conv_operator_norm(conv: torch.nn.Conv2d, input_shape: tuple[int, ...], iterations: int = 50,
                       seed: int = 0) -> float:
    """σ₁ of the linear map x ↦ conv(x) (bias excluded) on inputs of ``input_shape`` (C, H, W),
    by power iteration on JᵀJ with vector–Jacobian products. Not σ₁ of the reshaped kernel."""
    weight = conv.weight.detach()

    def apply(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)

    x = torch.randn(1, *input_shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(weight)
    x = x / x.norm()
    with torch.enable_grad():
        for _ in range(iterations):
            x.requires_grad_(True)
            y = apply(x)
            (grad,) = torch.autograd.grad(y, x, grad_outputs=y)  # JᵀJx
            x = (grad / grad.norm()).detach()
    with torch.no_grad():
        return float(apply(x).norm())


@torch.no_grad()
def spectral_init_(module: torch.nn.Module, conv_input_shapes: dict[torch.nn.Module, tuple] | None = None,
                   zero_conv_bias: bool = True) -> None:
    """LipsFormer's spectral initialisation: Xavier-normal, then divide by σ₁ so that σ₁ = 1.

    Linear weights use σ₁ of the matrix; conv kernels σ₁ of the kernel reshaped to
    (out, in·kh·kw) as the reference code does, or, for convs in ``conv_input_shapes``, the true
    operator norm on inputs of that shape. Linear biases are zeroed; conv biases too unless
    ``zero_conv_bias`` is False (the reference code leaves them at their default initialisation)."""
    conv_input_shapes = conv_input_shapes or {}
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            torch.nn.init.xavier_normal_(m.weight)
            if m.bias is not None and (isinstance(m, torch.nn.Linear) or zero_conv_bias):
                torch.nn.init.zeros_(m.bias)
            if isinstance(m, torch.nn.Conv2d) and m in conv_input_shapes:
                sigma = conv_operator_norm(m, conv_input_shapes[m])
            else:
                sigma = float(spectral_norm(m.weight.reshape(m.weight.shape[0], -1)))
            m.weight.div_(sigma)
