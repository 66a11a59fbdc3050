"""Local Lipschitz estimates of a network at data points (docs/methods.md#measuring-lipschitz-constants).

* :func:`jacobian_norm` — ‖J_f(x)‖₂ of input→logits at each point.
  ``method="power"``: power iteration on JᵀJ with vector–Jacobian products only (J v is the
  derivative of the VJP Jᵀu in u, a double backward; forward-mode AD fails through SDPA). The
  fused SDPA kernels have no double backward either, so attention runs its explicit path
  (the same function) while estimating. Points of a batch are independent (no batch
  statistics), so one batched iteration estimates all of them; each iteration costs about two
  backward passes. Power iteration converges from below: the value is a lower bound of the
  true norm that tightens with ``iterations``.
  ``method="exact"``: the full K × D Jacobian from K batched VJPs (K = number of logits) and
  its exact 2-norm — exact, fused path kept, and cheap when K is small (10 classes).
  ``method="auto"``: ``exact`` where K ≤ 2 · ``iterations`` (:func:`local_method`), else ``power``. A VJP
  costs about a backward pass and a power iteration about two, through the explicit attention path; on a
  micro ViT with 10 classes the exact norm took a third of ten power iterations' time on the CPU and a
  twelfth of their kernel launches (``benchmarks/measurement_cost.py``).
* ``exclude_patch_embed`` differentiates from the patch-embedding output instead of the image,
  as the JaSMin paper's Figure 4 does.
* :func:`empirical_lower_bound` — max ‖f(x) − f(x′)‖/‖x − x′‖ found by gradient ascent on x′ in
  a small ball around x: a certified *lower* bound of the local (and global) constant.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..models import explicit_attention, patch_embed


@contextlib.contextmanager
def _from_patch_embedding(network: nn.Module, images: torch.Tensor) -> Iterator[tuple[torch.Tensor, Callable]]:
    """Yield (z0, g): z0 the patch-embedding output at ``images``, g(z) the network's logits with
    that output replaced by z."""
    state: dict[str, torch.Tensor] = {}

    def hook(module, args, out):
        if "z" in state:
            return state["z"]
        state["z0"] = out.detach()
        return out

    handle = patch_embed(network.backbone).register_forward_hook(hook)
    try:
        with torch.no_grad():
            network(images)

        def from_embedding(z: torch.Tensor) -> torch.Tensor:
            state["z"] = z
            try:
                return network(images)
            finally:
                del state["z"]

        yield state["z0"], from_embedding
    finally:
        handle.remove()


METHODS = ("power", "exact", "auto")
EXACT_LOGITS_PER_ITERATION = 2  # ``auto`` takes the exact norm up to this many logits per power iteration


def local_method(method: str, num_logits: int, iterations: int) -> str:
    """What ``method`` (``power``, ``exact`` or ``auto``) computes for a network with ``num_logits`` outputs:
    ``auto`` is ``exact`` where K ≤ 2 · iterations, else ``power`` (measured on the CPU, a VJP costs about a third
    of a power iteration: the rule errs towards power iteration)."""
    if method not in METHODS:
        raise ValueError(f"method must be 'power', 'exact' or 'auto', got {method!r}")
    if method != "auto":
        return method
    return "exact" if num_logits <= EXACT_LOGITS_PER_ITERATION * iterations else "power"


def jacobian_norm(network: nn.Module, images: torch.Tensor, iterations: int = 10, method: str = "power",
                  exclude_patch_embed: bool = False, seed: int = 0) -> torch.Tensor:
    """Spectral norm of the input→logits Jacobian at each image, shape (B,)."""
    method = local_method(method, _num_logits(network, images) if method == "auto" else 0, iterations)
    with torch.enable_grad(), contextlib.ExitStack() as stack:
        if method == "power":
            stack.enter_context(explicit_attention(network.backbone))
        if exclude_patch_embed:
            x0, function = stack.enter_context(_from_patch_embedding(network, images))
        else:
            x0, function = images, network
        x = x0.detach().clone().requires_grad_(True)
        out = function(x)  # (B, K)
        if method == "exact":
            jac = x.new_empty(x.shape[0], out.shape[1], x[0].numel())  # (B, K, D): K input-sized rows a point
            for k in range(out.shape[1]):
                jac[:, k] = torch.autograd.grad(out[:, k].sum(), x, retain_graph=True)[0].flatten(1)
            return torch.linalg.matrix_norm(jac, ord=2).detach()
        u = torch.zeros_like(out, requires_grad=True)
        (vjp,) = torch.autograd.grad(out, x, grad_outputs=u, create_graph=True)  # Jᵀu, linear in u
        gen = torch.Generator(device="cpu").manual_seed(seed)
        v = torch.randn(x.shape, generator=gen, device="cpu").to(x)  # seeded on the host, whatever the device
        for _ in range(iterations):
            v = v / _norms(v).clamp_min(1e-30).view(-1, *[1] * (v.ndim - 1))
            (jv,) = torch.autograd.grad(vjp, u, grad_outputs=v, retain_graph=True)  # J v, (B, K)
            (v,) = torch.autograd.grad(out, x, grad_outputs=jv, retain_graph=True)  # Jᵀ J v
        v = v / _norms(v).clamp_min(1e-30).view(-1, *[1] * (v.ndim - 1))
        (jv,) = torch.autograd.grad(vjp, u, grad_outputs=v)
        return _norms(jv).detach()


def jacobian_norm_one_pass(network: nn.Module, images: torch.Tensor, num_logits: int) -> torch.Tensor:
    """The exact ‖J_f(x)‖₂ of :func:`jacobian_norm` (``method="exact"``), its K rows from one forward and one
    backward pass over K copies of each point, shape (B,).

    Row b·K + k of the stacked batch is point b, and its output's gradient is the k-th unit vector, so the backward
    pass returns J_f(x_b)ᵀe_k, the k-th row of point b's Jacobian, at every row (points are independent in eval
    mode). It costs K forward passes where :func:`jacobian_norm` makes one, and keeps no graph for a second backward:
    one fixed shape, on a :class:`~stability.robustness.fixed_batch.FixedBatch` of K·B points a compiled one, which
    a GPU runs as two large kernels sequences instead of one forward and K backward passes."""
    batch = images.shape[0]
    with torch.enable_grad():
        x = images.detach().repeat_interleave(num_logits, dim=0).requires_grad_(True)  # (B·K, ...)
        out = network(x)
        if out.shape != (batch * num_logits, num_logits):
            raise ValueError(f"the network gives {tuple(out.shape[1:])} outputs a point; num_logits={num_logits}")
        units = torch.eye(num_logits, dtype=out.dtype, device=out.device).repeat(batch, 1)  # e_k at row b·K + k
        (rows,) = torch.autograd.grad(out, x, grad_outputs=units)
    jac = rows.reshape(batch, num_logits, -1)  # (B, K, D)
    return torch.linalg.matrix_norm(jac, ord=2).detach()


def _num_logits(network: nn.Module, images: torch.Tensor) -> int:
    """K, the network's outputs per point (one point's forward pass)."""
    with torch.no_grad():
        return network(images[:1]).shape[1]


def _norms(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).norm(dim=1)


def empirical_lower_bound(network: nn.Module, images: torch.Tensor, radius: float = 1e-2, steps: int = 10,
                          step_size: float = 0.25, seed: int = 0) -> torch.Tensor:
    """max over x′ in the ℓ2 ball of ``radius`` around x of ‖f(x) − f(x′)‖/‖x − x′‖, by projected
    gradient ascent on the ratio (per point, shape (B,)). Inputs are not clipped to [0, 1]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.enable_grad():
        x = images.detach()
        with torch.no_grad():
            fx = network(x)
        delta = torch.randn(x.shape, generator=gen, device="cpu").to(x)
        delta = radius * delta / _norms(delta).view(-1, *[1] * (x.ndim - 1))
        best = torch.zeros(x.shape[0], device=x.device)
        for _ in range(steps + 1):
            delta.requires_grad_(True)
            ratio = _norms(network(x + delta) - fx) / _norms(delta)
            best = torch.maximum(best, ratio.detach())
            (grad,) = torch.autograd.grad(ratio.sum(), delta)
            with torch.no_grad():
                grad = grad / _norms(grad).clamp_min(1e-30).view(-1, *[1] * (x.ndim - 1))
                delta = delta + step_size * radius * grad
                scale = (radius / _norms(delta)).clamp(max=1.0)
                delta = delta * scale.view(-1, *[1] * (x.ndim - 1))
        return best
