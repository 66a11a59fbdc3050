"""Backbones (ViT, Swin from timm; CSwin ours), the registry, and the uniform view of their parts."""
from .cswin import CSWinTransformer
from .network import Network
from .registry import BUILDERS, PRESETS, build_backbone
from .view import (AttentionSite, NormSite, ResidualSite, attention_sites, capture_attention, capture_queries_keys,
                   explicit_attention, norm_sites, patch_embed, residual_sites, supports_query_key_capture)

__all__ = [
    "AttentionSite", "BUILDERS", "CSWinTransformer", "Network", "NormSite", "PRESETS", "ResidualSite",
    "attention_sites", "build_backbone", "capture_attention", "capture_queries_keys", "explicit_attention",
    "supports_query_key_capture", "norm_sites", "patch_embed", "residual_sites",
]
