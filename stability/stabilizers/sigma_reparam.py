"""σReparam (Zhai et al. 2023, "Stabilizing Transformer Training by Preventing Attention Entropy Collapse", Eq. 3;
docs/methods.md#σreparam):

    Ŵ = (γ / σ₁(W)) · W,

for every Linear layer (and every convolution, as its C_out × C_in·k·k matrix), with γ a learned scalar per layer.
As in the reference code (apple/ml-sigma-reparam, ``SNLinear``):

* γ is initialised to σ₁(W) at initialisation (by SVD), so Ŵ = W at step 0;
* σ₁ comes from one power-iteration step per training forward, v = normalise(W u), u ← normalise(Wᵀ v),
  σ = vᵀ W u with the gradient through W only; u is a buffer (saved in checkpoints), initialised to W's top right
  singular vector and updated only in training mode;
* the power iteration runs in float32 with autocast off (the reference's ``FP32SpectralNormedWeight``).
* in a forward of the network, the weights of one shape take their power step together (one batched product per
  shape, :mod:`~stability.nn.grouped_parametrization`): the same arithmetic, a weight's launches no longer per layer.

Ŵ's spectral norm is γ, learned: the reparametrisation does not cap anything, it decouples the update of the
spectral norm from the update of the direction, which keeps the attention entropy from collapsing (their Theorem 3.1
bounds the entropy below by a function of σ(W_Q)σ(W_K)). The reference also re-initialises every weight from a
truncated normal (std 0.02): the backbones' Linear layers already are; convolutions keep their own initialisation.
Its demo removes every normalisation layer as well ("transformer purity"): ``remove_norms: true``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..models import norm_sites
from ..nn.grouped_parametrization import GroupedParametrization, GroupedWeights, batched_matvec, bilinear
from ..nn.precision import at_least_float32, autocast_off
from .base import Stabilizer, register_stabilizer


class SigmaReparametrization(GroupedParametrization):
    """The parametrisation W ↦ (γ/σ₁(W))·W of one weight (``torch.nn.utils.parametrize``); the weights of one shape
    are computed together in a network's forward (:mod:`~stability.nn.grouped_parametrization`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        with torch.no_grad():
            _, s, vh = torch.linalg.svd(at_least_float32(weight.detach().flatten(1)), full_matrices=False)
        self.register_buffer("u", vh[0].clone())
        self.register_buffer("sigma", s[:1].clone())  # the last estimate of σ₁(W), for reading
        self.gamma = nn.Parameter(s[:1].clone())

    def single(self, weight: torch.Tensor) -> torch.Tensor:
        with autocast_off(weight.device.type):
            matrix = weight.flatten(1).to(torch.promote_types(weight.dtype, torch.float32))  # float32, or float64
            with torch.no_grad():
                v = F.normalize(matrix @ self.u.to(matrix.dtype), dim=0)
                u = F.normalize(matrix.T @ v, dim=0)
                if self.training:
                    self.u.copy_(u)
            sigma = v @ matrix @ u
            if self.training:
                self.sigma.copy_(sigma.detach().reshape(1))
        return weight * (self.gamma / sigma).to(weight.dtype)

    @classmethod
    def grouped(cls, members, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`single` for G weights of one shape at once: ``weights`` (G, …) → (G, …)."""
        with autocast_off(weights.device.type):
            matrices = weights.flatten(2).to(torch.promote_types(weights.dtype, torch.float32))  # (G, m, n)
            with torch.no_grad():  # matrix–vector products in IEEE float32, as each weight's own
                u = torch.stack([m.u for m in members]).to(matrices.dtype)
                v = F.normalize(batched_matvec(matrices, u), dim=-1)
                u = F.normalize(batched_matvec(matrices.transpose(1, 2), v), dim=-1)
            sigma = bilinear(v, matrices, u)
            if members[0].training:
                torch._foreach_copy_([m.u for m in members], list(u.unbind(0)))
                torch._foreach_copy_([m.sigma for m in members], list(sigma.detach().unsqueeze(-1).unbind(0)))
            gamma = torch.cat([m.gamma for m in members])
        scale = (gamma / sigma).to(weights.dtype)
        return weights * scale.view(-1, *([1] * (weights.dim() - 1)))


@register_stabilizer
class SigmaReparam(Stabilizer):
    """``--stabilizer sigma_reparam``.

    Args:
        convolutions: reparametrise convolutions too (the reference does: ``SNConv2d``).
        remove_norms: replace every LayerNorm by the identity (the reference's demo, "transformer purity").
    """

    name = "sigma_reparam"
    summary = "Ŵ = (γ/σ₁(W))·W for every Linear (and conv) layer, γ learned, σ₁ by one power step per forward"
    source = "Zhai et al. 2023"
    conflicts = {"muon": "Muon orthogonalises and caps the raw W, which σReparam then rescales to γ·W/σ₁(W)",
                 "spectral_norm": "both set σ₁ of the same weights (σReparam to a learned γ)"}

    def __init__(self, convolutions: bool = True, remove_norms: bool = False) -> None:
        self.convolutions, self.remove_norms = convolutions, remove_norms
        self._parametrizations: list[SigmaReparametrization] = []
        self._grouped: GroupedWeights | None = None

    def prepare(self, network: nn.Module) -> None:
        kinds = (nn.Linear, nn.Conv2d) if self.convolutions else (nn.Linear,)
        holders = []
        for name, module in network.named_modules():
            if isinstance(module, kinds):
                if parametrize.is_parametrized(module, "weight"):
                    raise ValueError(f"sigma_reparam: {name}.weight is parametrised already (by another stabilizer)")
                parametrize.register_parametrization(module, "weight", SigmaReparametrization(module.weight))
                self._parametrizations.append(module.parametrizations.weight[0])
                holders.append(module.parametrizations.weight)
        self._grouped = GroupedWeights(network, holders)
        if self.remove_norms:
            for site in norm_sites(network.backbone):
                site.replace(nn.Identity())

    def signals(self) -> dict[str, torch.Tensor]:
        """γ (= ‖Ŵ‖₂) of the largest layer, and σ₁ of the raw weights, largest."""
        if not self._parametrizations:
            return {}
        return {"gamma_max": torch.stack([p.gamma.detach().abs().reshape(()) for p in self._parametrizations]).max(),
                "sigma_max": torch.stack([p.sigma.reshape(()) for p in self._parametrizations]).max()}
