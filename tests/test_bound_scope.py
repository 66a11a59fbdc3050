"""A bound only for the networks it describes: the ViT options a certified bound does not account for (attention
pooling, a LayerNorm before the blocks) are refused by name; the ones it can account for (a norm before the blocks
under LipsFormer, register tokens, positions not embedded with the class token) count — each token-size claim tested
against the tokens the network actually makes."""
import math

import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz.certified import certified_bound
from stability.lipschitz.transformer_bounds import _largest_patch, _parts, _size_vector, _token_size, exact_sigma

TINY = dict(embed_dim=16, depth=1, num_heads=2)


def module(stabilizer="lipschitz_transformer", **options):
    torch.manual_seed(0)
    return ImageClassifier(backbone_options={**TINY, **options}, stabilizer=stabilizer)


@pytest.mark.parametrize("options", [{}, {"no_embed_class": True}, {"reg_tokens": 2},
                                     {"reg_tokens": 2, "no_embed_class": True},
                                     {"class_token": False, "global_pool": "avg"}])
def test_the_token_size_bounds_every_token_the_network_embeds(options):
    """With large positions, class and register tokens (so that a row left out of the claim shows): the claimed
    largest token norm is ≥ every embedded token's norm on images of the pixel box."""
    network = module(**options).network.double()
    backbone = network.backbone
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the first position row, the class and the register tokens each larger than the rest
        for name, scale in (("pos_embed", 40.0), ("cls_token", 10.0), ("reg_token", 100.0)):
            t = getattr(backbone, name, None)
            if t is not None:
                rows = torch.ones(t.shape[1], 1, dtype=t.dtype)
                rows[0] = scale
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * rows)
    _, embed, _ = _parts(network)
    spread = exact_sigma(embed.weight.reshape(embed.weight.shape[0], -1)) * _largest_patch(network, backbone)
    centre = _size_vector(embed.bias, embed.weight.shape[0], False, spread)  # the tokens of a zero patch
    claimed = _token_size(backbone, spread, centre, False, lambda t: t.norm(dim=-1))
    images = torch.rand(64, 1, 8, 8, generator=gen, dtype=torch.float64).round()  # corners of the box, mostly
    with torch.no_grad():
        tokens = backbone._pos_embed(backbone.patch_embed((images - network.mean) / network.std))
    assert float(tokens.norm(dim=-1).max()) <= float(claimed) * (1 + 1e-12)


def test_attention_pooling_is_refused_by_both_bounds():
    for stabilizer in ("lipschitz_transformer", "lipsformer"):
        bound, reason = certified_bound(module(stabilizer, global_pool="map").network)
        assert bound is None and "attention pooling" in reason, (stabilizer, reason)


def test_a_layernorm_before_the_blocks_is_refused_and_centernorm_there_counts():
    plain = module("none", pre_norm=True).network
    bound, reason = certified_bound(plain)
    assert bound is None
    network = module("lipsformer", pre_norm=True).network
    with_pre = certified_bound(network)[0]
    factor = network.backbone.norm_pre.lipschitz()
    network.backbone.norm_pre = torch.nn.Identity()
    without = certified_bound(network)[0]
    assert factor > 1 and with_pre.value == pytest.approx(without.value * factor, rel=1e-12)
    # the Lipschitz transformer replaces every LayerNorm, the one before the blocks too: a bound exists
    assert certified_bound(module(pre_norm=True).network)[0] is not None
    assert math.isfinite(with_pre.value)


def test_last_layer_normalisation_certifies_with_its_unit_rows():
    """The head's effective weight has unit rows, and the bound composed from it holds: whole and per class pair, at
    least the exact Jacobian's (float64, random weights of every other matrix)."""
    torch.manual_seed(0)
    options = {"lipschitz_transformer": {"attention": "l2_unit", "activation": "maxmin", "pooling": "flatten",
                                         "last_layer_norm": True, "zero_init": False}}
    network = ImageClassifier(backbone_options={**TINY, "num_heads": 1}, stabilizer="lipschitz_transformer",
                              stabilizer_options=options).network.double()
    with torch.no_grad():
        network.backbone.head.weight.mul_(torch.linspace(0.1, 5, 10, dtype=torch.float64)[:, None])  # rows of any size
    bound, reason = certified_bound(network)
    assert bound is not None, reason
    torch.testing.assert_close(bound.head_weight.norm(dim=1), torch.ones(10, dtype=torch.float64))
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    jacobian = torch.func.jacrev(network)(x).reshape(10, -1)
    assert float(torch.linalg.matrix_norm(jacobian, ord=2)) <= bound.value
    for i in range(10):
        for j in range(i + 1, 10):
            pair = float(torch.linalg.vector_norm(jacobian[i] - jacobian[j]))
            assert pair <= bound.features * float(torch.linalg.vector_norm(bound.head_weight[i] - bound.head_weight[j]))
