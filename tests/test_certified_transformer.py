"""The certified transformer's parts: unit L2 attention (Kim et al.'s bound divided out) and the token-mixing control
are 1-Lipschitz at unit weight norms, by their bounds and by exact Jacobians; the whole network's pixel bound is above
its exact Jacobian norm at points of the pixel box with weights sharpened to the cap, and at most the product of the
patch embedding's, the head's and the normalisation's factors — every block ≤ 1, by construction."""
import math

import pytest
import torch
from timm.layers import Attention

from stability.classifier import ImageClassifier
from stability.lipschitz import jacobian_norm
from stability.lipschitz.certified import certified_bound
from stability.lipschitz.transformer_bounds import NotALipschitzTransformer, paper_bound, pixel_bound
from stability.nn import constraints
from stability.nn.l2_attention import L2MultiHeadAttention, lambert_factor, unit_divisor
from stability.nn.token_mixing import TokenMixing
from stability.stabilizers.muon import constrained_matrices


def exact_norm(layer, x: torch.Tensor) -> float:
    n, dim = x.shape
    jac = torch.autograd.functional.jacobian(lambda t: layer(t[None])[0], x)
    return float(torch.linalg.matrix_norm(jac.reshape(n * dim, n * dim), ord=2))


def orthogonal_(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(max(weight.shape), max(weight.shape), generator=gen, dtype=torch.float64))
    with torch.no_grad():
        weight.copy_(q[: weight.shape[0], : weight.shape[1]])
    return weight


def unit_l2_layer(dim=8, heads=2, seed=0) -> L2MultiHeadAttention:
    torch.manual_seed(seed)
    layer = L2MultiHeadAttention(Attention(dim, num_heads=heads, qkv_bias=False), unit=True).double().eval()
    layer.proj.register_parameter("bias", None)
    gen = torch.Generator().manual_seed(seed)
    for linear in (layer.qkv.q, layer.qkv.v, layer.proj):
        orthogonal_(linear.weight, gen)  # every σ₁ = 1: the hard cap's worst case
    return layer


def test_unit_l2_attention_is_l2_attention_over_its_unit_norm_bound():
    layer = unit_l2_layer()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    layer.unit = False
    plain = layer(x)
    layer.unit = True
    torch.testing.assert_close(layer(x) * unit_divisor(5, 2, 4), plain)
    assert unit_divisor(5, 2, 4) == pytest.approx(math.sqrt(5 * 2 / 4) * lambert_factor(5), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_unit_l2_attention_is_1_lipschitz_at_unit_weight_norms(seed):
    """Exact Jacobian norms ≤ 1 at random points of every size, and where gradient ascent looks for the steepest."""
    layer = unit_l2_layer(seed=seed)
    layer.fused_attn = False
    gen = torch.Generator().manual_seed(seed)
    for tokens, size in ((3, 0.3), (6, 1.0), (9, 4.0), (12, 10.0)):
        x = torch.randn(tokens, 8, generator=gen, dtype=torch.float64) * size
        assert exact_norm(layer, x) <= 1.0
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64).requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=0.05)
    for _ in range(25):
        n, dim = x.shape
        jac = torch.autograd.functional.jacobian(lambda t: layer(t[None])[0], x, create_graph=True)
        steepness = torch.linalg.matrix_norm(jac.reshape(n * dim, n * dim), ord=2)
        optimizer.zero_grad()
        (-steepness).backward()
        optimizer.step()
    assert float(steepness) <= 1.0


def test_token_mixing_is_the_kronecker_product_and_its_norm_the_product_of_norms():
    gen = torch.Generator().manual_seed(0)
    layer = TokenMixing(6, 5).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    expected = layer.mix.weight @ x @ layer.v.weight.T @ layer.proj.weight.T
    torch.testing.assert_close(layer(x[None])[0], expected)
    sigma = lambda w: float(torch.linalg.matrix_norm(w.detach(), ord=2))  # noqa: E731
    exact = exact_norm(layer, x)
    assert exact == pytest.approx(sigma(layer.mix.weight) * sigma(layer.proj.weight @ layer.v.weight), rel=1e-9)
    assert exact <= sigma(layer.mix.weight) * sigma(layer.v.weight) * sigma(layer.proj.weight)
    with pytest.raises(ValueError, match="built for 5 tokens, got 4"):
        layer(x[None, :4])


VIT = dict(embed_dim=16, depth=2, num_heads=2)


def certified(attention: str, **options) -> ImageClassifier:
    return ImageClassifier(backbone_options=VIT, stabilizer="lipschitz_transformer,muon", lr=1e-2,
                           stabilizer_options={"lipschitz_transformer": {"attention": attention,
                                                                         "activation": "maxmin", **options},
                                               "muon": {"layers": "all", "constraint": "hard_cap"}})


def sharpened_to_the_cap(module: ImageClassifier, seed: int) -> torch.nn.Module:
    """Every matrix random and then hard-capped at RMS→RMS norm 1 (its largest singular values at the cap), the tokens
    at per-token RMS 1: the largest weights the constraints allow, in float64."""
    network = module.network.eval().double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in network.named_parameters():
            if p.ndim == 2 and "pos_embed" not in name and "cls_token" not in name:
                p.copy_(constraints.hard_cap_svd(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 3
                                                 / p.shape[1] ** 0.5, 1.0))
            else:
                rows = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(rows / rows.pow(2).mean(-1, keepdim=True).sqrt())
    return network


def box_points(count: int, seed: int) -> torch.Tensor:
    """Images of the pixel box: uniform, and corners (0/1 pixels)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.rand(count, 1, 8, 8, generator=gen, dtype=torch.float64),
                      torch.randint(0, 2, (count, 1, 8, 8), generator=gen).double()])


@pytest.mark.parametrize("attention, pooling", [("l2_unit", "backbone"), ("mixing", "backbone"), ("l2_unit", "flatten"),
                                                ("mixing", "flatten")])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_certified_transformers_bound_is_above_its_exact_jacobian_norm_and_every_block_at_most_1(attention, pooling,
                                                                                                    seed):
    network = sharpened_to_the_cap(certified(attention, pooling=pooling), seed)
    bound, reason = certified_bound(network)
    assert bound is not None, reason
    assert float(jacobian_norm(network, box_points(6, seed), method="exact").max()) <= bound.value
    backbone = network.backbone
    embed = backbone.patch_embed.proj.linear.weight
    sigma = lambda w: float(torch.linalg.matrix_norm(w.detach(), ord=2))  # noqa: E731
    by_construction = sigma(embed) / float(network.std.min()) * sigma(backbone.head.weight) * network.logit_scale
    assert bound.value <= by_construction * (1 + 1e-12)  # each block's factor ≤ 1
    _, features = pixel_bound(network)
    assert float(features) <= sigma(embed) / float(network.std.min()) * (1 + 1e-12)


def test_the_certified_transformers_matrices_are_all_constrained_and_paper_bound_refuses_them():
    module = certified("mixing")
    names = {name for name, _ in constrained_matrices(module.network, "all")}
    assert {n for n in names if ".attn." in n} == {f"backbone.blocks.{i}.block.attn.{p}.weight" for i in range(2)
                                                   for p in ("v", "mix", "proj")}
    assert not module.unconstrained_parameters()
    with pytest.raises(NotALipschitzTransformer, match="token mixing"):
        paper_bound(module.network)
    with pytest.raises(ValueError, match="attention must be one of"):
        ImageClassifier(stabilizer="lipschitz_transformer",
                        stabilizer_options={"lipschitz_transformer": {"attention": "cosine"}})


def test_the_flatten_head_reads_every_token_and_is_the_only_head():
    module = certified("mixing", pooling="flatten")
    backbone = module.network.backbone
    assert backbone.global_pool == "" and backbone.head.in_features == (backbone.patch_embed.num_patches + 1) * 16
    names = [n for n, _ in constrained_matrices(module.network, "all") if "head" in n]
    assert names == ["backbone.head.weight"]
    assert module.network(torch.rand(3, 1, 8, 8)).shape == (3, 10)
    with pytest.raises(ValueError, match="pooling must be 'backbone' or 'flatten'"):
        certified("mixing", pooling="max")


@pytest.mark.parametrize("attention", ["l2_unit", "mixing"])
def test_the_certified_transformer_trains(attention):
    module = certified(attention, pooling="flatten")
    optimizer = module.build_optimizer()
    gen = torch.Generator().manual_seed(0)
    images, labels = torch.rand(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    losses = []
    for step in range(8):
        optimizer.zero_grad()
        _, terms = module.losses(images, labels)
        terms["task"].backward()
        optimizer.step()
        module.after_optimizer_step(step)
        losses.append(float(terms["task"]))
    assert losses[-1] < losses[0]
