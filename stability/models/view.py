"""A uniform view of a backbone's parts, the seams stabilizers and measurements use.

All three backbones (timm's ViT and Swin, our CSwin) follow the same conventions, which
this module relies on and tests check:

* an attention module has a fused ``qkv`` Linear (D → 3·H·d, rows ordered q | k | v, head by
  head inside each), an output ``proj`` Linear, ``num_heads``, ``head_dim``, a boolean
  ``fused_attn`` and an ``attn_drop`` Dropout that receives the attention probabilities
  P = softmax(logits) whenever ``fused_attn`` is False;
* a transformer block applies its residual branches through ``drop_path1`` (attention) and
  ``drop_path2`` (MLP), right before the addition ``x + drop_path(branch(x))``;
* the patch embedding is ``backbone.patch_embed``.

The fused (flash / SDPA) path stays on unless a caller asks for the probabilities with
:func:`capture_attention`, which switches it off only for the duration of the ``with``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

QKV_PARTS = ("q", "k", "v")


def is_attention(module: nn.Module) -> bool:
    """True for modules that follow the attention convention above."""
    from .adapters import SplitQKV

    return (
        isinstance(getattr(module, "qkv", None), (nn.Linear, SplitQKV))
        and isinstance(getattr(module, "proj", None), nn.Linear)
        and isinstance(getattr(module, "attn_drop", None), nn.Dropout)
        and hasattr(module, "num_heads")
        and hasattr(module, "fused_attn")
    )


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a backbone."""

    name: str
    module: nn.Module

    @property
    def num_heads(self) -> int:
        return int(self.module.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.module.qkv.out_features // (3 * self.num_heads))

    @property
    def qkv(self) -> nn.Linear:
        return self.module.qkv

    @property
    def proj(self) -> nn.Linear:
        return self.module.proj

    def head_rows(self, part: str, head: int) -> slice:
        """Rows of the fused qkv weight that make ``part`` ('q', 'k' or 'v') of ``head``."""
        if part not in QKV_PARTS:
            raise ValueError(f"part must be one of {QKV_PARTS}, got {part!r}")
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head must be in [0, {self.num_heads}), got {head}")
        width = self.num_heads * self.head_dim
        start = QKV_PARTS.index(part) * width + head * self.head_dim
        return slice(start, start + self.head_dim)

    def head_weight(self, part: str, head: int) -> torch.Tensor:
        """W_part^head, shape (head_dim, D): a view into qkv.weight, so gradients flow."""
        return self.qkv.weight[self.head_rows(part, head)]


@dataclass(frozen=True)
class ResidualSite:
    """A residual branch ``x + block.<attr>(branch(x))``; ``attr`` is drop_path1 or drop_path2."""

    name: str
    block: nn.Module
    attr: str

    @property
    def kind(self) -> str:
        return "attention" if self.attr == "drop_path1" else "mlp"

    @property
    def dim(self) -> int:
        norm = getattr(self.block, "norm1" if self.attr == "drop_path1" else "norm2")
        return int(norm.normalized_shape[0]) if hasattr(norm, "normalized_shape") else int(norm.dim)

    def scale_branch(self, scale: nn.Module) -> None:
        """Put ``scale`` on the branch output, before DropPath: x + DropPath(scale(f(x)))."""
        setattr(self.block, self.attr, nn.Sequential(scale, getattr(self.block, self.attr)))

    def output_linear(self) -> nn.Linear | None:
        """The Linear layer that writes the branch's output f(x), where every operation after it up to
        ``block.<attr>`` acts on each token's channels one by one (dropout, LayerScale, Swin's window reversal and
        shift): the attention's ``proj`` or the MLP's ``fc2``, for the blocks, attention modules and MLPs whose
        forward is known here (timm's ViT ``Block`` and ``SwinTransformerBlock``, CSwin's block; timm's
        ``Attention`` and ``WindowAttention``, CSwin's, the kernel adapters; timm's ``Mlp``). None for any other
        (a post-norm block normalises after the Linear, another MLP may end otherwise) and for a Linear that is
        no longer a plain ``nn.Linear`` (parametrised, or changed by a stabilizer)."""
        from timm.layers import Attention, Mlp
        from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention
        from timm.models.vision_transformer import Block

        from .adapters import KernelAttention, KernelWindowAttention
        from .cswin import CrossShapedAttention, CSWinBlock

        if type(self.block) not in (Block, SwinTransformerBlock, CSWinBlock):
            return None
        if self.kind == "attention":
            branch, known, last = self.block.attn, (Attention, WindowAttention, KernelAttention,
                                                    KernelWindowAttention, CrossShapedAttention), "proj"
        else:
            branch, known, last = self.block.mlp, (Mlp,), "fc2"
        linear = getattr(branch, last, None) if type(branch) in known else None
        return linear if type(linear) is nn.Linear else None


@dataclass(frozen=True)
class NormSite:
    """A normalisation layer ``parent.<attr>``, so that it can be swapped for another."""

    name: str
    parent: nn.Module
    attr: str

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.attr)

    def replace(self, new: nn.Module) -> None:
        setattr(self.parent, self.attr, new)


def attention_sites(backbone: nn.Module) -> list[AttentionSite]:
    """All attention modules, in forward order."""
    return [AttentionSite(name, m) for name, m in backbone.named_modules() if is_attention(m)]


def residual_sites(backbone: nn.Module) -> list[ResidualSite]:
    """Both residual branches (attention, MLP) of every transformer block, in forward order."""
    sites = []
    for name, m in backbone.named_modules():
        if hasattr(m, "drop_path1") and hasattr(m, "drop_path2") and hasattr(m, "attn"):
            sites += [ResidualSite(f"{name}.{a}", m, a) for a in ("drop_path1", "drop_path2")]
    return sites


def norm_sites(backbone: nn.Module, types: tuple[type, ...] = (nn.LayerNorm,)) -> list[NormSite]:
    """Every normalisation layer of the given types (LayerNorm by default)."""
    sites = []
    for parent_name, parent in backbone.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, types):
                sites.append(NormSite(f"{parent_name}.{attr}".lstrip("."), parent, attr))
    return sites


def patch_embed(backbone: nn.Module) -> nn.Module:
    """The patch embedding (image → tokens) of a backbone."""
    if not hasattr(backbone, "patch_embed"):
        raise AttributeError(f"{type(backbone).__name__} has no patch_embed")
    return backbone.patch_embed


def vit_tokens(backbone: nn.Module) -> int:
    """N, the tokens a ViT's blocks see: its patches and its prefix (class, register) tokens."""
    return backbone.patch_embed.num_patches + backbone.num_prefix_tokens


@contextlib.contextmanager
def explicit_attention(backbone: nn.Module) -> Iterator[None]:
    """Switch every attention module to its explicit (non-fused) path inside the block.

    The function computed is the same; the explicit path materialises the probabilities and
    can be differentiated twice, which the fused SDPA kernels cannot."""
    saved = [(site.module, site.module.fused_attn) for site in attention_sites(backbone)]
    try:
        for module, _ in saved:
            module.fused_attn = False
        yield
    finally:
        for module, fused in saved:
            module.fused_attn = fused


@contextlib.contextmanager
def capture_attention(backbone: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record attention probabilities during the forward passes run inside the block.

    Yields a list that fills, in forward order, with one tensor (B', H, N, N) per attention
    call: B' is the batch for ViT and batch × windows (Swin) or × stripes (CSwin). Rows sum
    to one. The fused path is switched off inside the block and restored after it.
    """
    probs: list[torch.Tensor] = []

    def record(_module, inputs):
        probs.append(inputs[0])

    handles = [site.module.attn_drop.register_forward_pre_hook(record) for site in attention_sites(backbone)]
    try:
        with explicit_attention(backbone):
            yield probs
    finally:
        for handle in handles:
            handle.remove()


def supports_query_key_capture(backbone: nn.Module) -> bool:
    """True when every attention module is timm's plain ``Attention`` (ViT): logits are exactly
    scale · q kᵀ (no relative-position bias, mask or replaced kernel), so the queries and keys
    determine the probabilities."""
    from timm.layers import Attention

    sites = attention_sites(backbone)
    return bool(sites) and all(type(site.module) is Attention for site in sites)


def _on_queries_keys(module: nn.Module, call: Callable[[nn.Module, torch.Tensor, torch.Tensor], None]) -> list:
    """Hooks on a timm ``Attention``'s ``q_norm`` and ``k_norm`` that call ``call(module, q, k)`` with each forward's
    (normed) queries and keys, (B, H, N, d); returns the hook handles."""
    pending: list[torch.Tensor] = []

    def keep_queries(_norm, _inputs, output):
        pending.append(output)

    def with_keys(_norm, _inputs, output):
        call(module, pending.pop(), output)

    return [module.q_norm.register_forward_hook(keep_queries), module.k_norm.register_forward_hook(with_keys)]


class _Capture:
    """Where the hooks of a :class:`QueryKeyNetwork` put each forward's (q, k, scale): a list during its forward,
    None otherwise (the network run on its own records nothing)."""

    def __init__(self) -> None:
        self.sink: list | None = None


class _SiteHooks:
    """The two hooks of one attention module (picklable, unlike closures: the network is pickled with them)."""

    def __init__(self, capture: _Capture, scale: float) -> None:
        self.capture, self.scale, self.pending = capture, scale, []

    def queries(self, _norm, _inputs, output) -> None:
        self.pending.append(output)

    def keys(self, _norm, _inputs, output) -> None:
        queries = self.pending.pop()
        if self.capture.sink is not None:
            self.capture.sink.append((queries, output, self.scale))


class QueryKeyNetwork(nn.Module):
    """``network(x)`` that also returns the (q, k, scale) of every attention call, in forward order, as
    :func:`capture_queries_keys` records them: ``(logits, [(q, k, scale), …])``. Its hooks stay on the network's
    ``q_norm`` and ``k_norm`` for good, so that ``torch.compile`` of this module traces them into its graph (a
    compiled graph calls the hooks it was traced with, never those added later); outside this module's forward they
    record nothing. For :func:`supports_query_key_capture` backbones (timm's plain ViT attention)."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        if not supports_query_key_capture(network.backbone):
            raise ValueError("capturing queries and keys needs timm's plain ViT attention (no relative-position "
                             "bias, window mask or replaced kernel)")
        self.network = network
        self.capture = _Capture()
        for site in attention_sites(network.backbone):
            hooks = _SiteHooks(self.capture, float(site.module.scale))
            site.module.q_norm.register_forward_hook(hooks.queries)
            site.module.k_norm.register_forward_hook(hooks.keys)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        captured: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.capture.sink = captured
        try:
            logits = self.network(x)
        finally:
            self.capture.sink = None
        return logits, captured


@contextlib.contextmanager
def capture_queries_keys(backbone: nn.Module) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """Record (q, k, scale) of every attention call inside the block, in forward order, each
    (B, H, N, d) and differentiable, without touching the fused path: the probabilities are
    softmax(scale · q kᵀ). Only for :func:`supports_query_key_capture` backbones."""
    if not supports_query_key_capture(backbone):
        raise ValueError("capturing queries and keys needs timm's plain ViT attention (no relative-position "
                         "bias, window mask or replaced kernel); use capture_attention instead")
    captured: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    handles = []
    for site in attention_sites(backbone):
        handles += _on_queries_keys(site.module, lambda module, q, k: captured.append((q, k, float(module.scale))))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def observe_attention_logits(backbone: nn.Module, observe: Callable[[str, torch.Tensor], None]) -> Iterator[list[str]]:
    """Call ``observe(site_name, logits)`` with the softmax input (B', H, N, N) of every attention call inside the
    block, detached and without gradient. Yields the names of the sites whose logits cannot be observed.

    timm's plain ViT ``Attention`` keeps its fused path: the logits are scale·q kᵀ from its (normed) q and k. A
    replacement kernel gives them through its ``logits(q, k, bias)``. Otherwise (timm's Swin ``WindowAttention``,
    CSwin without a kernel) they are the input of the module's ``softmax``, and the explicit path is switched on
    inside the block (the same function, rounded differently)."""
    from timm.layers import Attention

    handles, explicit, unobserved = [], [], []

    def from_queries_keys(name):
        def call(module, q, k):
            with torch.no_grad():
                observe(name, module.scale * (q.detach() @ k.detach().transpose(-2, -1)))
        return call

    def from_kernel(name):
        def hook(kernel, args):
            with torch.no_grad():
                q, k, _v, bias = (a.detach() if isinstance(a, torch.Tensor) else a for a in args[:4])
                observe(name, kernel.logits(q, k, bias))
        return hook

    def from_softmax(name):
        def hook(_softmax, args):
            observe(name, args[0].detach())
        return hook

    for site in attention_sites(backbone):
        module, kernel = site.module, getattr(site.module, "kernel", None)
        if type(module) is Attention:
            handles += _on_queries_keys(module, from_queries_keys(site.name))
        elif kernel is not None and hasattr(kernel, "logits"):
            handles.append(kernel.register_forward_pre_hook(from_kernel(site.name)))
        elif isinstance(getattr(module, "softmax", None), nn.Softmax):
            handles.append(module.softmax.register_forward_pre_hook(from_softmax(site.name)))
            explicit.append((module, module.fused_attn))
            module.fused_attn = False
        else:
            unobserved.append(site.name)
    try:
        yield unobserved
    finally:
        for handle in handles:
            handle.remove()
        for module, fused in explicit:
            module.fused_attn = fused
