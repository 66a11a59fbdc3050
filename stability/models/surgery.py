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

from .adapters import ConvexResidualBlock, KernelAttention, KernelWindowAttention
from .cswin import CrossShapedAttention
from .view import attention_sites, residual_sites

LinearChoice = Literal["all", "attention", "mlp", "hidden"]
LINEAR_CHOICES = ("all", "attention", "mlp", "hidden")


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``root.<name>`` (a dotted path) to ``new``."""
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def replace_attention_kernel(backbone: nn.Module, name: str, module: nn.Module, kernel: nn.Module) -> None:
    """Make attention module ``name`` compute its heads with ``kernel`` (ViT, Swin or CSwin)."""
    if isinstance(module, CrossShapedAttention):
        module.kernel = kernel
    elif isinstance(module, WindowAttention):
        replace_submodule(backbone, name, KernelWindowAttention(module, kernel))
    elif isinstance(module, TimmAttention):
        replace_submodule(backbone, name, KernelAttention(module, kernel))
    else:
        raise ValueError(f"no replacement attention kernel for {type(module).__name__} "
                         f"(supported: timm Attention, timm WindowAttention, CrossShapedAttention)")


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


def use_convex_residuals(backbone: nn.Module) -> int:
    """Wrap every transformer block in :class:`ConvexResidualBlock` with a = 1/(2N), N blocks
    (Newhouse et al. 2025); returns N."""
    names = [site.name.rpartition(".")[0] for site in residual_sites(backbone)][::2]
    for name in names:
        replace_submodule(backbone, name, ConvexResidualBlock(backbone.get_submodule(name), 1.0 / (2 * len(names))))
    return len(names)


def is_head(name: str) -> bool:
    """True for the classifier head's modules (a ``head`` in the dotted name)."""
    return "head" in name.split(".")


def linear_layers(network: nn.Module, which: LinearChoice = "all") -> list[nn.Linear]:
    """The Linear layers ``which`` selects: ``all``; ``attention`` (qkv and output projections);
    ``mlp`` (the MLPs' layers); ``hidden`` (every Linear but the classifier head)."""
    if which == "all":
        return [m for m in network.modules() if isinstance(m, nn.Linear)]
    if which == "hidden":
        return [m for name, m in network.named_modules() if isinstance(m, nn.Linear) and not is_head(name)]
    if which == "attention":
        return [lin for site in attention_sites(network) for lin in (site.qkv, site.proj)]
    if which == "mlp":
        return [m for name, mod in network.named_modules() if name.endswith("mlp")
                for m in mod.modules() if isinstance(m, nn.Linear)]
    raise ValueError(f"layers must be one of {LINEAR_CHOICES}, got {which!r}")
