"""Backbones (ViT, Swin from timm; CSwin ours), the registry, the uniform view of their parts and
the surgery stabilizers perform on them."""
from .adapters import ConvexResidualBlock, KernelAttention, KernelWindowAttention
from .cswin import CSWinTransformer
from .network import Network
from .registry import BUILDERS, PRESETS, build_backbone
from .surgery import (
    LINEAR_CHOICES,
    linear_layers,
    replace_activations,
    replace_attention_kernel,
    replace_attention_kernels,
    replace_submodule,
    use_convex_residuals,
)
from .view import (
    AttentionSite,
    NormSite,
    ResidualSite,
    attention_sites,
    capture_attention,
    capture_queries_keys,
    explicit_attention,
    norm_sites,
    patch_embed,
    residual_sites,
    supports_query_key_capture,
)

__all__ = [
    "AttentionSite", "BUILDERS", "CSWinTransformer", "ConvexResidualBlock", "KernelAttention",
    "KernelWindowAttention", "LINEAR_CHOICES", "Network", "NormSite", "PRESETS", "ResidualSite", "attention_sites",
    "build_backbone", "capture_attention", "capture_queries_keys", "explicit_attention", "linear_layers",
    "norm_sites", "patch_embed", "replace_activations", "replace_attention_kernel", "replace_attention_kernels",
    "replace_submodule", "residual_sites", "supports_query_key_capture", "use_convex_residuals",
]
