"""The Lipschitz transformer of Newhouse et al. 2025, "Training Transformers with Enforced Lipschitz
Constants" (docs/methods.md#lipschitz-transformer): the architecture for which a finite global bound
exists, its initialisation, its two bounds, and the constraints on what the weight constraints of
``muon`` do not cover.

* no LayerNorm (Identity); convex residuals x ← (1 − a)x + a·f(x), a = residual_scale/(2N) for N blocks;
  attention (1/3)·W_O·softmax(s·QKᵀ/d)·V (1/d, not 1/√d); GELU/1.1289 (1-Lipschitz); DropPath bypassed;
  or, with ``attention: l2``, L2 self-attention with tied queries and keys (Kim et al. 2021,
  :mod:`stability.nn.l2_attention`), globally Lipschitz (ViT); ``l2_unit``: the same divided by its Theorem 3.2
  bound at unit weight norms, 1-Lipschitz under the hard cap at σ_max = 1 (the certified transformer); ``mixing``:
  no attention, a learned N × N token-mixing matrix between W_V and W_O (:mod:`stability.nn.token_mixing`, the
  certified transformer's control), 1-Lipschitz under the same cap;
* every matrix a Linear that ``muon --muon.layers all`` constrains: the patch embedding as the linear
  map patch → token (non-overlapping patches), Q, K and V apart, W_O, the MLP and the head;
* biases off (``biases``); positional embedding and class token kept at per-token RMS ≤ ``token_rms``
  after every step (the reference bounds its embedding columns the same way);
* the reference's initialisation: every matrix orthogonal with RMS→RMS norm 1 (``orthogonal_init``),
  W_O, the MLP output and the head zero (``zero_init``);
* ``logit_scale`` c: the logits are c·W_head·h, the reference code's ``final_scale`` (32–512 in its CIFAR-10
  sweeps). With every layer at RMS→RMS norm ≤ 1 the logits stay of the size of the input, and with ‖z‖₂ ≤ r
  and K classes the cross-entropy cannot go below log(1 + (K − 1)·e^(−r√(K/(K−1)))) (1.84 at r = 0.5 for 10
  classes): c lifts that floor. It is part of the model, so both bounds include it; the certified radius,
  margin/(√2·L), does not change with it (margin and L both scale by c).

The run lists every parameter left without a norm constraint (a bias when ``biases: true``; every
matrix when ``muon`` is not selected). Bounds: the certified pixel-space bound on [0, 1]ⁿ
(``lipschitz/certified_log10``) and the paper's own composition in per-token RMS norms
(``lipschitz/paper_bound_log10``, for comparison with its figures), both from the measured weights
(:mod:`stability.lipschitz.transformer_bounds`).
"""
from __future__ import annotations

from typing import Literal

import torch
from timm.layers import Attention as TimmAttention
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..lipschitz.certified import Bound, certified_bound
from ..lipschitz.transformer_bounds import NotALipschitzTransformer, paper_bound
from ..models import (
    KernelAttention,
    KernelWindowAttention,
    attention_sites,
    linear_patch_embedding,
    linear_role,
    norm_sites,
    remove_biases,
    replace_activations,
    replace_attention_kernels,
    replace_submodule,
    split_qkv,
    use_convex_residuals,
    vit_tokens,
)
from ..nn.aol import AOLConv2d, AOLLinear
from ..nn.constraints import orthogonal_rms_
from ..nn.folded_scale import fold_input_scale
from ..nn.l2_attention import L2MultiHeadAttention
from ..nn.lipschitz_blocks import (
    FlattenLinear,
    LipschitzDotKernel,
    MaxMin,
    NormalizedFlattenLinear,
    NormalizedLinear,
    ScaledGELU,
)
from ..nn.token_mixing import TokenMixing
from .base import Stabilizer, register_stabilizer

TOKEN_PARAMETERS = ("pos_embed", "cls_token", "reg_token")
ATTENTIONS = ("dot", "l2", "l2_unit", "mixing")
ACTIVATIONS = {"gelu": ScaledGELU, "relu": nn.ReLU, "maxmin": MaxMin}  # each 1-Lipschitz: the bounds take 1


@register_stabilizer
class LipschitzTransformer(Stabilizer):
    """``--stabilizer lipschitz_transformer`` (with ``muon`` for the weight constraints).

    Args:
        attention_scale: s in softmax(s·QKᵀ/d).
        residual_scale: the convex residual weight is a = residual_scale/(2N) (the reference's option).
        biases: keep the Linear layers' biases (they are then trained unconstrained).
        orthogonal_init: every matrix orthogonal at RMS→RMS norm 1.
        zero_init: W_O, the MLP output and the head start at zero.
        token_rms: bound on the per-token RMS of the positional embedding and class token.
        logit_scale: c in logits = c·W_head·h (the reference's ``final_scale``; counted in the bounds).
        attention: ``dot`` (the paper's), ``l2`` (L2 self-attention, tied Q = K; ViT), ``l2_unit`` (L2 attention
            over its bound at unit weight norms: 1-Lipschitz under σ₁ ≤ 1; ViT) or ``mixing`` (no attention: a learned
            token-mixing matrix, the control; ViT).
        activation: the MLPs' 1-Lipschitz activation: ``gelu`` (the paper's GELU/1.1289), ``relu`` (the
            reference code's MLPs) or ``maxmin`` (GroupSort-2, norm-preserving: Anil et al. 2019).
        pooling: ``backbone`` (the backbone's own: class token, or ``global_pool: avg``) or ``flatten`` (the head
            reads every token, :class:`~stability.nn.lipschitz_blocks.FlattenLinear`; ViT).
        last_layer_norm: the head's rows normalised to unit length (Singla et al. 2022,
            :class:`~stability.nn.lipschitz_blocks.NormalizedLinear`): each class pair's certificate constant is then
            at most 2·|c|·(features' bound), c the logit scale; initialised orthogonal, not zero (a zero row has no
            direction).
    """

    name = "lipschitz_transformer"
    summary = ("the Lipschitz-transformer architecture (no LayerNorm, convex residuals, (1/3)·softmax(s·QKᵀ/d)·V, "
               "GELU/1.1289 or ReLU / MaxMin, linear patch embedding, no biases, orthogonal init); certified pixel "
               "bound and the paper's bound")
    source = "Newhouse et al. 2025"
    prepare_order = 0
    wants_constrained_network = True
    backbones = ("vit", "swin", "cswin", "hybrid")  # the hybrid: its blocks (the AOL stem is 1-Lipschitz already)

    def __init__(self, attention_scale: float = 1.0, residual_scale: float = 1.0, biases: bool = False,
                 orthogonal_init: bool = True, zero_init: bool = True, token_rms: float = 1.0,
                 logit_scale: float = 1.0, attention: Literal["dot", "l2", "l2_unit", "mixing"] = "dot",
                 activation: Literal["gelu", "relu", "maxmin"] = "gelu",
                 pooling: Literal["backbone", "flatten"] = "backbone", last_layer_norm: bool = False) -> None:
        if attention_scale <= 0 or token_rms <= 0 or residual_scale <= 0 or logit_scale <= 0:
            raise ValueError(f"lipschitz_transformer: need attention_scale > 0, residual_scale > 0, token_rms > 0 and "
                             f"logit_scale > 0; got {attention_scale}, {residual_scale}, {token_rms}, {logit_scale}")
        self.attention_scale, self.residual_scale, self.biases = attention_scale, residual_scale, biases
        self.orthogonal_init, self.zero_init, self.token_rms = orthogonal_init, zero_init, token_rms
        if attention not in ATTENTIONS:
            raise ValueError(f"lipschitz_transformer: attention must be one of {list(ATTENTIONS)}, got {attention!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"lipschitz_transformer: activation must be one of {list(ACTIVATIONS)}, "
                             f"got {activation!r}")
        if pooling not in ("backbone", "flatten"):
            raise ValueError(f"lipschitz_transformer: pooling must be 'backbone' or 'flatten', got {pooling!r}")
        self.logit_scale, self.attention, self.activation, self.pooling = logit_scale, attention, activation, pooling
        self.last_layer_norm = last_layer_norm

    def prepare(self, network: nn.Module) -> None:
        backbone = network.backbone if hasattr(network, "backbone") else network
        for site in norm_sites(backbone):
            site.replace(nn.Identity())
        if self.attention in ("l2", "l2_unit"):
            self._use_l2_attention(backbone, unit=self.attention == "l2_unit")
        elif self.attention == "mixing":
            self._use_token_mixing(backbone)
        else:
            replace_attention_kernels(backbone, lambda attn: LipschitzDotKernel(
                attn.qkv.out_features // (3 * attn.num_heads), self.attention_scale))
        replace_activations(backbone, nn.GELU, ACTIVATIONS[self.activation])
        use_convex_residuals(backbone, self.residual_scale)
        try:
            linear_patch_embedding(backbone)
        except ValueError:  # an overlapping conv stem (CSwin): it stays a convolution, and unconstrained
            pass
        split_qkv(backbone)
        if self.pooling == "flatten":
            self._use_flatten_head(backbone)
        if self.last_layer_norm:
            head = backbone.head
            normalized = NormalizedFlattenLinear if isinstance(head, FlattenLinear) else NormalizedLinear
            backbone.head = normalized(head.in_features, head.out_features, bias=head.bias is not None)
        if not self.biases:
            remove_biases(network)
        self._initialise(backbone)
        self._bound_tokens(backbone)
        network.logit_scale = self.logit_scale

    def after_prepare(self, network: nn.Module) -> None:
        """The attention's 1/3 folded into W_O, and GELU's 1/1.1289 into the MLP's second Linear layer
        (:func:`~stability.nn.folded_scale.fold_input_scale`: W(c·h) computed as (c·W)h, the same function without a
        pass over the activation each way), where the final architecture allows it: ViT's and Swin's attention (the
        kernel's output goes straight to W_O; CSwin adds its positional term first) and timm's MLP with dropout alone
        between the activation and fc2, the Linear layer still a plain ``nn.Linear`` (not parametrised by another
        stabilizer). Elsewhere the division stays where it was."""
        backbone = network.backbone if hasattr(network, "backbone") else network
        for module in backbone.modules():
            if (type(module) in (KernelAttention, KernelWindowAttention) and type(module.kernel) is LipschitzDotKernel
                    and type(module.proj) is nn.Linear and not module.kernel.folded):
                fold_input_scale(module.proj, 1 / module.kernel.divisor)
                module.kernel.folded = True
            elif (type(module) is Mlp and type(module.act) is ScaledGELU and type(module.fc2) is nn.Linear
                  and type(module.drop1) in (nn.Dropout, nn.Identity) and type(module.norm) is nn.Identity
                  and not module.act.folded):
                fold_input_scale(module.fc2, 1 / module.act.divisor)
                module.act.folded = True

    def _vit_sites(self, backbone: nn.Module):
        sites = attention_sites(backbone)
        if not all(isinstance(site.module, (TimmAttention, KernelAttention)) for site in sites):
            raise ValueError(f"lipschitz_transformer: attention: {self.attention} is implemented for the ViT "
                             f"backbone's attention (use attention: dot on Swin and CSwin)")
        return sites

    def _use_l2_attention(self, backbone: nn.Module, unit: bool) -> None:
        replacements = []
        for site in self._vit_sites(backbone):  # all built before any is swapped in; L2 attention refuses a kernel
            try:                                 # another stabilizer set
                replacements.append((site.name, L2MultiHeadAttention(site.module, unit=unit)))
            except ValueError as err:
                raise ValueError(f"lipschitz_transformer: attention {site.name!r}: {err}") from None
        for name, module in replacements:
            replace_submodule(backbone, name, module)

    @staticmethod
    def _use_flatten_head(backbone: nn.Module) -> None:
        if not isinstance(backbone, VisionTransformer):
            raise ValueError(f"lipschitz_transformer: pooling: flatten is implemented for the ViT backbone, not "
                             f"{type(backbone).__name__}")
        tokens = vit_tokens(backbone)
        head = backbone.head
        backbone.global_pool = ""  # timm's pool() then passes the (B, N, D) tokens through
        backbone.head = FlattenLinear(tokens * head.in_features, head.out_features, bias=head.bias is not None)

    def _use_token_mixing(self, backbone: nn.Module) -> None:
        tokens = vit_tokens(backbone)
        for site in self._vit_sites(backbone):
            if getattr(site.module, "kernel", None) is not None:
                raise ValueError(f"lipschitz_transformer: attention {site.name!r} computes its heads with "
                                 f"{type(site.module.kernel).__name__} (set by another stabilizer); mixing replaces it")
            replace_submodule(backbone, site.name, TokenMixing(site.module.qkv.in_features, tokens))

    @torch.no_grad()
    def _initialise(self, backbone: nn.Module) -> None:
        for name, module in backbone.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            zero = self.zero_init and (linear_role(name) in ("proj", "head") or name.endswith("mlp.fc2"))
            zero = zero and not (self.last_layer_norm and linear_role(name) == "head")  # unit rows need a direction
            if zero:
                module.weight.zero_()
            elif self.orthogonal_init:
                orthogonal_rms_(module.weight)

    def _tokens(self, backbone: nn.Module) -> list[nn.Parameter]:
        return [p for attr in TOKEN_PARAMETERS if isinstance(p := getattr(backbone, attr, None), nn.Parameter)]

    @torch.no_grad()
    def _bound_tokens(self, backbone: nn.Module) -> None:
        """Rows of the positional embedding and the class token scaled to per-token RMS ≤ token_rms."""
        for tokens in self._tokens(backbone):
            rms = tokens.pow(2).mean(-1, keepdim=True).sqrt()
            tokens.mul_((self.token_rms / rms.clamp_min(1e-30)).clamp_max(1.0))

    def after_optimizer_step(self, network: nn.Module, global_step: int = 0) -> None:
        self._bound_tokens(network.backbone)

    def constrained_parameters(self, network: nn.Module) -> list[nn.Parameter]:
        """The tokens (bounded after every step) and the weights of AOL layers (a hybrid's stem): an AOL layer is
        1-Lipschitz for every value of its weight (Prach & Lampert 2022, Theorems 1–2), so no step can break it."""
        aol = [m.weight for m in network.modules() if isinstance(m, (AOLConv2d, AOLLinear))]
        return [*self._tokens(network.backbone), *aol]

    def lipschitz_bound(self, network: nn.Module) -> Bound | None:
        """The certified ℓ2 bound of pixels → logits on [0, 1]ⁿ (ViT; None elsewhere)."""
        return certified_bound(network)[0]

    def labelled_bounds(self, network: nn.Module) -> dict[str, float]:
        """The paper's own bound, in per-token RMS norms from the embedded tokens (ViT)."""
        try:
            return {"paper": paper_bound(network)}
        except NotALipschitzTransformer:
            return {}
