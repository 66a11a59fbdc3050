"""Model surgery: the changes stabilizers make to a backbone, in one place.

Replacing a submodule, an attention kernel, the activations or the residual form of every block,
and choosing the Linear layers a method acts on. Stabilizers call these; they never import each
other's helpers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from timm.layers import Attention as TimmAttention
from timm.models.swin_transformer import WindowAttention
from torch import nn

from ..nn.dot_attention import DotProductKernel
from .adapters import ConvexResidualBlock, KernelAttention, KernelWindowAttention, PatchLinear, SplitQKV
from .cswin import CrossShapedAttention
from .view import attention_sites, residual_sites

LinearChoice = Literal["all", "attention", "mlp", "hidden"]
LINEAR_CHOICES = ("all", "attention", "mlp", "hidden")
ROLES = ("embed", "qkv", "proj", "mlp", "head", "other")


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``root.<name>`` (a dotted path) to ``new``."""
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def replace_attention_kernel(backbone: nn.Module, name: str, module: nn.Module, kernel: nn.Module) -> None:
    """Make attention module ``name`` compute its heads with ``kernel`` (ViT, Swin or CSwin)."""
    current = getattr(module, "kernel", None)
    if current is not None:
        raise ValueError(f"attention {name!r} already computes its heads with {type(current).__name__} "
                         f"(another stabilizer replaced them); a second replacement would undo the first")
    if isinstance(module, CrossShapedAttention):
        module.kernel = kernel
    elif isinstance(module, WindowAttention):
        replace_submodule(backbone, name, KernelWindowAttention(module, kernel))
    elif isinstance(module, TimmAttention):
        replace_submodule(backbone, name, KernelAttention(module, kernel))
    else:
        raise ValueError(f"no replacement attention kernel for {type(module).__name__} "
                         f"(supported: timm Attention, timm WindowAttention, CrossShapedAttention)")


def dot_product_kernels(backbone: nn.Module, who: str) -> list[DotProductKernel]:
    """The :class:`~stability.nn.dot_attention.DotProductKernel` of every attention module, installed where the
    module still computes its own dot-product attention (the same function: scale, bias and mask kept; timm's
    ``q_norm`` / ``k_norm`` carried over), so that several stabilizers (``who``, for errors) can change one kernel.
    A module already holding another kernel (cosine, Lipschitz) is a conflict, named in the error."""
    kernels = []
    for site in attention_sites(backbone):
        module = site.module
        kernel = getattr(module, "kernel", None)
        if kernel is None:
            if isinstance(module, TimmAttention):
                for part in ("norm", "gate"):
                    if not isinstance(getattr(module, part, None), (nn.Identity, type(None))):
                        raise ValueError(f"{who}: attention {site.name!r} has a {part} layer the kernel would drop")
                kernel = DotProductKernel(module.scale, module.q_norm, module.k_norm)
            elif isinstance(module, (WindowAttention, CrossShapedAttention)):
                kernel = DotProductKernel(module.scale)
            else:
                raise ValueError(f"{who}: attention {site.name!r} is a {type(module).__name__}, not a dot-product "
                                 f"attention it can change (supported: timm Attention, WindowAttention, CSwin)")
            replace_attention_kernel(backbone, site.name, module, kernel)
        elif not isinstance(kernel, DotProductKernel):
            raise ValueError(f"{who}: attention {site.name!r} computes its heads with {type(kernel).__name__} "
                             f"(set by another stabilizer), not a dot product; {who} applies to dot-product attention")
        kernels.append(kernel)
    return kernels


def replace_attention_kernels(backbone: nn.Module, make_kernel: Callable[[nn.Module], nn.Module]) -> None:
    """Every attention module computes its heads with ``make_kernel(module)``."""
    for site in attention_sites(backbone):
        replace_attention_kernel(backbone, site.name, site.module, make_kernel(site.module))


def replace_activations(backbone: nn.Module, kind: type[nn.Module], make: Callable[[], nn.Module]) -> int:
    """Replace every ``act`` attribute of type ``kind`` (the MLPs' activations); returns how many."""
    count = 0
    for module in backbone.modules():
        if isinstance(getattr(module, "act", None), kind):
            module.act = make()
            count += 1
    return count


def use_convex_residuals(backbone: nn.Module, residual_scale: float = 1.0) -> int:
    """Wrap every transformer block in :class:`ConvexResidualBlock` with a = residual_scale/(2N) for N
    blocks (Newhouse et al. 2025; the reference's ``residual_scale``, default 1); returns N."""
    names = [site.name.rpartition(".")[0] for site in residual_sites(backbone)][::2]
    a = residual_scale / (2 * len(names))
    if not 0 < a <= 1:
        raise ValueError(f"residual_scale {residual_scale} gives a = {a:g} for {len(names)} blocks; need 0 < a <= 1 "
                         f"(residual_scale <= {2 * len(names)})")
    for name in names:
        replace_submodule(backbone, name, ConvexResidualBlock(backbone.get_submodule(name), a))
    return len(names)


def is_head(name: str) -> bool:
    """True for the classifier head's modules (a ``head`` in the dotted name)."""
    return "head" in name.split(".")


def linear_layers(network: nn.Module, which: LinearChoice = "all") -> list[nn.Linear]:
    """The Linear layers ``which`` selects: ``all``; ``attention`` (qkv — or its q, k, v — and output projections);
    ``mlp`` (the MLPs' layers); ``hidden`` (every Linear but the classifier head)."""
    if which == "all":
        return [m for m in network.modules() if isinstance(m, nn.Linear)]
    if which == "hidden":
        return [m for name, m in network.named_modules() if isinstance(m, nn.Linear) and not is_head(name)]
    if which == "attention":  # a tied key map (L2 attention: k is q) is one matrix, listed once
        found = [lin for site in attention_sites(network) for module in (site.qkv, site.proj)
                 for lin in ((module.q, module.k, module.v) if isinstance(module, SplitQKV) else (module,))]
        return list({id(lin): lin for lin in found}.values())
    if which == "mlp":
        return [m for name, mod in network.named_modules() if name.endswith("mlp")
                for m in mod.modules() if isinstance(m, nn.Linear)]
    raise ValueError(f"layers must be one of {LINEAR_CHOICES}, got {which!r}")


def split_qkv(backbone: nn.Module) -> int:
    """Hold every attention module's fused qkv Linear as three Linear layers q, k, v
    (:class:`SplitQKV`, same function); returns how many were split (already split ones are kept)."""
    count = 0
    for site in attention_sites(backbone):
        if isinstance(site.module.qkv, nn.Linear):
            site.module.qkv = SplitQKV(site.module.qkv)
            count += 1
    return count


def linear_patch_embedding(backbone: nn.Module) -> PatchLinear:
    """Make the patch embedding's convolution (``patch_embed.proj``, non-overlapping) a
    :class:`PatchLinear`, the same map held as a Linear patch → token."""
    embed = getattr(backbone, "patch_embed", None)
    conv = getattr(embed, "proj", None)
    if isinstance(conv, PatchLinear):
        return conv
    if not isinstance(conv, nn.Conv2d):
        raise ValueError(f"{type(backbone).__name__} has no patch_embed.proj convolution to make linear")
    embed.proj = PatchLinear(conv)
    return embed.proj


def remove_biases(network: nn.Module) -> int:
    """Drop the bias of every Linear layer (the reference Lipschitz transformer has none); returns how many."""
    count = 0
    for module in network.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.register_parameter("bias", None)
            count += 1
    return count


def without_dropout(module: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off (p = 0), in place: a forward pass in training mode is then the same
    function on any device and under any random state (for comparisons between devices and precisions)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if hasattr(m, "drop_prob"):  # timm's DropPath
            m.drop_prob = 0.0
    return module


def linear_role(name: str) -> str:
    """The part of the transformer a Linear layer (by dotted name) is: ``embed`` (patch embedding),
    ``qkv`` (fused or split Q, K, V), ``proj`` (attention output W_O), ``mlp``, ``head`` or ``other``."""
    parts = name.split(".")
    if "patch_embed" in parts:
        return "embed"
    if "qkv" in parts:
        return "qkv"
    if "attn" in parts and parts[-1] == "proj":
        return "proj"
    if "mlp" in parts:
        return "mlp"
    if is_head(name):
        return "head"
    return "other"
