"""Backbones (ViT, Swin from timm; CSwin ours), the registry, the uniform view of their parts and
the surgery stabilizers perform on them."""
from .adapters import ConvexResidualBlock, KernelAttention, KernelWindowAttention, PatchLinear, SplitQKV
from .cswin import CSWinTransformer
from .network import Network
from .registry import BUILDERS, PRESETS, build_backbone
from .surgery import (
    LINEAR_CHOICES,
    ROLES,
    dot_product_kernels,
    linear_layers,
    linear_patch_embedding,
    linear_role,
    remove_biases,
    replace_activations,
    replace_attention_kernel,
    replace_attention_kernels,
    replace_submodule,
    split_qkv,
    use_convex_residuals,
    without_dropout,
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
    observe_attention_logits,
    patch_embed,
    residual_sites,
    supports_query_key_capture,
    vit_tokens,
)

__all__ = [
    "AttentionSite", "BUILDERS", "CSWinTransformer", "ConvexResidualBlock", "KernelAttention",
    "KernelWindowAttention", "LINEAR_CHOICES", "Network", "NormSite", "PRESETS", "PatchLinear", "ROLES",
    "ResidualSite", "SplitQKV", "attention_sites", "build_backbone", "capture_attention",
    "capture_queries_keys", "dot_product_kernels", "explicit_attention", "linear_layers",
    "linear_patch_embedding", "linear_role", "norm_sites", "observe_attention_logits", "patch_embed",
    "remove_biases", "replace_activations", "replace_attention_kernel", "replace_attention_kernels",
    "replace_submodule", "residual_sites", "split_qkv", "supports_query_key_capture", "use_convex_residuals",
    "vit_tokens", "without_dropout",
]
