"""The timm and Lightning internals this project relies on. When a new release changes one, these
tests fail and name it (pyproject.toml also caps both at the versions tested)."""
import inspect

import lightning
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from packaging.version import Version
from timm.layers import Attention
from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn


def vit() -> VisionTransformer:
    return VisionTransformer(img_size=8, patch_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2)


def swin_block() -> SwinTransformerBlock:
    return SwinTransformerBlock(dim=16, input_resolution=(4, 4), num_heads=2, window_size=2)


@pytest.mark.parametrize("name, reason", [
    ("qkv", "the fused q|k|v projection every stabilizer and measurement reads (models/view.py)"),
    ("proj", "the output projection W_O"),
    ("num_heads", "per-head slicing of qkv"),
    ("fused_attn", "switching to the explicit path that materialises the probabilities"),
    ("scale", "the logit scale of the streamed JaSMin row statistics"),
    ("attn_drop", "the pre-hook that records the attention probabilities (capture_attention)"),
    ("q_norm", "the forward hook that records queries (capture_queries_keys)"),
    ("k_norm", "the forward hook that records keys (capture_queries_keys)"),
])
def test_timm_attention_internals(name, reason):
    attention = vit().blocks[0].attn
    assert isinstance(attention, Attention)
    assert hasattr(attention, name), f"timm Attention has no '{name}' any more: {reason}"


def test_timm_attention_passes_the_probabilities_through_attn_drop():
    attention = vit().blocks[0].attn
    attention.fused_attn = False
    seen = []
    attention.attn_drop.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    attention(torch.randn(2, 17, 16))
    assert seen and torch.allclose(seen[0].sum(-1), torch.ones(2, 2, 17)), \
        "timm Attention no longer feeds softmax probabilities to attn_drop (capture_attention relies on it)"


def test_timm_attention_forward_signature_takes_attn_mask():
    parameters = inspect.signature(Attention.forward).parameters
    assert "attn_mask" in parameters, "timm Attention.forward lost attn_mask (KernelAttention mirrors it)"


@pytest.mark.parametrize("name", ["norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2"])
def test_timm_vit_block_internals(name):
    assert hasattr(Block(dim=16, num_heads=2), name), f"timm ViT Block has no '{name}' (residual_sites, bounds)"


@pytest.mark.parametrize("name", ["patch_embed", "pos_embed", "cls_token", "num_prefix_tokens", "no_embed_class",
                                  "norm", "fc_norm", "head", "blocks"])
def test_timm_vision_transformer_internals(name):
    assert hasattr(vit(), name), f"timm VisionTransformer has no '{name}' (certified bounds, embeddings)"


def test_timm_patch_embedding_is_a_conv_with_a_norm():
    embed = vit().patch_embed
    assert isinstance(embed.proj, nn.Conv2d) and hasattr(embed, "norm"), "timm PatchEmbed changed (proj / norm)"


@pytest.mark.parametrize("name", ["_attn", "norm1", "norm2", "mlp", "drop_path1", "drop_path2"])
def test_timm_swin_block_internals(name):
    assert hasattr(swin_block(), name), \
        f"timm SwinTransformerBlock has no '{name}' (ConvexResidualBlock calls the private _attn for its windows)"


@pytest.mark.parametrize("name", ["relative_position_bias_table", "relative_position_index", "window_area", "qkv",
                                  "proj", "fused_attn", "attn_drop"])
def test_timm_window_attention_internals(name):
    attention = swin_block().attn
    assert isinstance(attention, WindowAttention)
    assert hasattr(attention, name), f"timm WindowAttention has no '{name}' (KernelWindowAttention takes it over)"


@pytest.mark.parametrize("name", ["parse_arguments", "instantiate_trainer", "_run_subcommand"])
def test_lightning_cli_internals(name):
    assert hasattr(LightningCLI, name), f"LightningCLI has no '{name}' (stability.cli overrides or calls it)"


def test_lightning_cli_reads_checkpoint_hyperparameters_only_where_stability_switches_it_off():
    """Lightning 2.5.5 added ``_parse_ckpt_path``, which lets a checkpoint's hyperparameters override the command line;
    stability.cli replaces it with a no-op (its own ``parse_arguments`` reads the checkpoint first). Before 2.5.5 the
    method does not exist and there is nothing to switch off; from 2.5.5 on it must keep its name."""
    if Version(lightning.__version__) >= Version("2.5.5"):
        assert hasattr(LightningCLI, "_parse_ckpt_path"), \
            "LightningCLI renamed _parse_ckpt_path: stability.cli no longer switches off its checkpoint override"
    else:
        assert not hasattr(LightningCLI, "_parse_ckpt_path")


def test_lightning_cli_keeps_subcommand_parsers_and_calls_after_hooks():
    source = inspect.getsource(LightningCLI)
    assert "self._subcommand_parsers" in source, "LightningCLI no longer keeps _subcommand_parsers (stability.cli)"
    assert 'f"after_{subcommand}"' in inspect.getsource(LightningCLI._run_subcommand), \
        "LightningCLI no longer calls after_<subcommand> hooks (stability.cli's after_fit runs --test_after_fit)"
