"""Spectral norms and the weight operations built on them.

σ₁(W) is the largest singular value. The RMS→RMS norm of a (d_out × d_in) matrix is
‖W‖_RMS = sqrt(d_in / d_out) · σ₁(W) (Newhouse et al. 2025; docs/methods.md#muon-and-weight-constraints).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def spectral_norms(weights: list[torch.Tensor]) -> torch.Tensor:
    """Exact σ₁ of each matrix, (len(weights),) float64: σ₁² is the largest eigenvalue of the
    smaller Gram matrix W Wᵀ or Wᵀ W (float64, symmetric eigensolver — cheaper than an SVD),
    one batched call per shape."""
    out = torch.empty(len(weights), dtype=torch.float64, device=weights[0].device if weights else "cpu")
    for indices, stacked in grouped_by_shape(weights):
        w = stacked.detach().double()
        gram = w @ w.mT if w.shape[-2] <= w.shape[-1] else w.mT @ w
        out[indices] = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
    return out


def grouped_by_shape(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """[(indices, stacked tensors)] for each distinct shape, in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
    return [(indices, torch.stack([tensors[i] for i in indices])) for indices in groups.values()]


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

    x = torch.randn(1, *input_shape, generator=torch.Generator().manual_seed(seed)).to(weight)
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
