"""Projected gradient descent (Madry et al. 2018), ℓ∞ and ℓ2, step for step as torchattacks' ``PGD`` and ``PGDL2``
— with the random start drawn from a seeded CPU generator and moved to the images' device.

torchattacks draws its start from the device's own generator (``torch.empty_like(x).uniform_()``), so a CPU and a GPU
seeded alike attack from different points and cannot be compared. Drawn here on the CPU, the start is the same on every
device; on the CPU it is also torchattacks' own (its global generator, seeded with the same seed, gives the same
draws), so both give the same adversarial images bit for bit there (tests/test_robustness.py).

ℓ∞: x₀ = clip(x + U(−ε, ε)), x_{t+1} = clip(x + Π_ε(x_t + α·sign ∇ℓ(x_t) − x)), Π_ε clamping each pixel to [−ε, ε].
ℓ2: x₀ = clip(x + r·ε·g/‖g‖) with g ~ N(0, I), r ~ U(0, 1); x_{t+1} = clip(x + Π_ε(x_t + α·∇ℓ/‖∇ℓ‖ − x)), Π_ε scaling
δ to ‖δ‖₂ ≤ ε. ℓ is the mean cross-entropy; clip keeps pixels in [0, 1].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("Linf", "L2")
EPS_FOR_DIVISION = 1e-10  # torchattacks' PGDL2 default


def random_start(images: torch.Tensor, norm: str, eps: float, seed: int) -> torch.Tensor:
    """The start x₀ of PGD, drawn on the CPU in float32 from ``seed`` (the same on every device and in every dtype: a
    generator draws other numbers in float64), on the images' device and in their dtype."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = images.shape
    if norm == "Linf":
        noise = torch.empty(shape, dtype=torch.float32, device="cpu").uniform_(-eps, eps, generator=gen)
        return torch.clamp(images + noise.to(images), min=0, max=1).detach()
    delta = torch.empty(shape, dtype=torch.float32, device="cpu").normal_(generator=gen)
    n = delta.view(shape[0], -1).norm(p=2, dim=1).view(shape[0], 1, 1, 1)
    r = torch.zeros_like(n).uniform_(0, 1, generator=gen)
    delta *= r / n * eps
    return torch.clamp(images + delta.to(images), min=0, max=1).detach()


class PGD:
    """``PGD(model, norm, eps, alpha, steps, random_start=True, seed=0)(images, labels)`` → adversarial images.

    Arguments:
        model: images in [0, 1] → logits (called as is: the caller sets eval mode).
        norm: ``Linf`` or ``L2``.
        eps: the budget; alpha: the step size; steps: the number of steps.
        random_start: start at :func:`random_start` (else at the images).
        seed: the start's seed.

    Shape: images (B, C, H, W) in [0, 1], labels (B,); returns (B, C, H, W) in [0, 1].
    """

    def __init__(self, model: nn.Module, norm: str, eps: float, alpha: float, steps: int, random_start: bool = True,
                 seed: int = 0) -> None:
        if norm not in NORMS:
            raise ValueError(f"PGD: norm must be one of {NORMS}, got {norm!r}")
        self.model, self.norm, self.eps, self.alpha, self.steps = model, norm, eps, alpha, steps
        self.random_start, self.seed = random_start, seed

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        images, labels = images.clone().detach(), labels.clone().detach()
        adv = random_start(images, self.norm, self.eps, self.seed) if self.random_start else images.clone()
        b = len(images)
        for _ in range(self.steps):
            adv.requires_grad = True
            cost = F.cross_entropy(self.model(adv), labels)
            grad = torch.autograd.grad(cost, adv, retain_graph=False, create_graph=False)[0]
            if self.norm == "Linf":
                adv = adv.detach() + self.alpha * grad.sign()
                delta = torch.clamp(adv - images, min=-self.eps, max=self.eps)
            else:
                grad_norms = torch.norm(grad.view(b, -1), p=2, dim=1) + EPS_FOR_DIVISION
                adv = adv.detach() + self.alpha * (grad / grad_norms.view(b, 1, 1, 1))
                delta = adv - images
                factor = torch.min(self.eps / torch.norm(delta.view(b, -1), p=2, dim=1),
                                   torch.ones(b, dtype=delta.dtype, device=delta.device))
                delta = delta * factor.view(-1, 1, 1, 1)
            adv = torch.clamp(images + delta, min=0, max=1).detach()
        return adv
