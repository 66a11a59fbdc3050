"""L2 self-attention with tied queries and keys (Kim et al. 2021): it computes the paper's definition, its
bound (Theorem 3.2) is above the exact Jacobian norm — at random points, at large inputs and where gradient
ascent finds the steepest point —, and the Lipschitz transformer built on it has a pixel-space bound above its
exact Jacobian norms too, trains, and is constrained once per matrix."""
import math

import pytest
import torch
from timm.layers import Attention

from stability.classifier import ImageClassifier
from stability.lipschitz import jacobian_norm
from stability.lipschitz.certified import certified_bound
from stability.lipschitz.transformer_bounds import NotALipschitzTransformer, paper_bound
from stability.nn.l2_attention import L2MultiHeadAttention, l2_attention_bound, lambert_factor, lambert_w0
from stability.stabilizers.muon import constrained_matrices


def l2_layer(dim=8, heads=2, scale=1.0, seed=0) -> L2MultiHeadAttention:
    torch.manual_seed(seed)
    layer = L2MultiHeadAttention(Attention(dim, num_heads=heads, qkv_bias=False)).double().eval()
    layer.proj.register_parameter("bias", None)  # linear maps only, as in the paper (and the Lipschitz transformer)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(scale)
    return layer


def by_definition(layer: L2MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The paper's F(X) = [P^h X A_h W_V^h]_h W_O, P^h_ij ∝ exp(−‖x_iᵀW_Q − x_jᵀW_Q‖²/√(D/H)), A_h = W_Q W_Qᵀ/√(D/H)."""
    h, d = layer.num_heads, layer.head_dim
    w_q = layer.qkv.q.weight.view(h, d, -1).transpose(1, 2)  # (H, D, d): the paper's W_Q^h
    w_v = layer.qkv.v.weight.view(h, d, -1).transpose(1, 2)
    heads = []
    for i in range(h):
        q = x @ w_q[i]
        p = torch.softmax(-torch.cdist(q, q).pow(2) / math.sqrt(d), dim=-1)
        heads.append(p @ x @ (w_q[i] @ w_q[i].T / math.sqrt(d)) @ w_v[i])
    return torch.cat(heads, -1) @ layer.proj.weight.T


def bound_of(layer: L2MultiHeadAttention, tokens: int) -> float:
    h, d = layer.num_heads, layer.head_dim
    sigma = lambda w: torch.linalg.matrix_norm(w, ord=2)  # noqa: E731
    w_q = sigma(layer.qkv.q.weight.view(h, d, -1).detach())
    w_v = sigma(layer.qkv.v.weight.view(h, d, -1).detach())
    return float(l2_attention_bound(tokens, d, w_q, w_v, sigma(layer.proj.weight.detach())))


def exact_norm(layer, x: torch.Tensor, create_graph=False) -> torch.Tensor:
    n, dim = x.shape
    jac = torch.autograd.functional.jacobian(lambda t: layer(t[None])[0], x, create_graph=create_graph)
    return torch.linalg.matrix_norm(jac.reshape(n * dim, n * dim), ord=2)


def test_lambert_w_and_the_factor():
    for x in (0.0, 0.3, 1.0, math.e, 50.0, 1e5):
        w = lambert_w0(x)
        assert w * math.exp(w) == pytest.approx(x, rel=1e-12, abs=1e-15)
    assert lambert_factor(1) == 1.0 and lambert_factor(1 + math.e ** 2) == pytest.approx(5.0)  # W₀(e) = 1
    with pytest.raises(ValueError, match="x >= 0"):
        lambert_w0(-1.0)


@pytest.mark.parametrize("fused", [True, False])
def test_it_computes_the_papers_definition_with_tied_queries_and_keys(fused):
    layer = l2_layer()
    layer.fused_attn = fused
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), torch.stack([by_definition(layer, xi) for xi in x]))
    assert layer.qkv.k is layer.qkv.q


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_its_bound_is_above_the_exact_jacobian_norm_even_where_gradient_ascent_looks(scale):
    layer = l2_layer(scale=scale, seed=1)
    layer.fused_attn = False  # double backward for the ascent
    gen = torch.Generator().manual_seed(2)
    for tokens, size in ((3, 1.0), (6, 0.1), (6, 5.0), (12, 20.0)):
        x = torch.randn(tokens, 8, generator=gen, dtype=torch.float64) * size
        assert float(exact_norm(layer, x)) <= bound_of(layer, tokens)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64).requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=0.05)
    for _ in range(60):  # look for the steepest point
        steepness = exact_norm(layer, x, create_graph=True)
        optimizer.zero_grad()
        (-steepness).backward()
        optimizer.step()
    assert float(steepness) <= bound_of(layer, 4)


VIT = dict(embed_dim=16, depth=2, num_heads=2)


def l2_transformer(**options) -> ImageClassifier:
    return ImageClassifier(backbone_options=VIT, stabilizer="lipschitz_transformer,muon", lr=1e-2,
                           stabilizer_options={"lipschitz_transformer": {"attention": "l2", **options},
                                               "muon": {"layers": "all", "constraint": "hard_cap"}})


@pytest.mark.parametrize("scale, logit_scale", [(1.0, 1.0), (3.0, 8.0)])
def test_the_l2_lipschitz_transformers_pixel_bound_is_above_its_exact_jacobian_norm(scale, logit_scale):
    torch.manual_seed(3)
    network = l2_transformer(logit_scale=logit_scale).network.eval().double()
    with torch.no_grad():  # sharpened weights, the tokens at their largest
        for p in network.parameters():
            p.copy_(torch.randn_like(p) * (scale / p.shape[1] ** 0.5 if p.ndim == 2 else 0.3))
    bound, reason = certified_bound(network)
    assert bound is not None, reason
    gen = torch.Generator().manual_seed(0)
    images = torch.cat([torch.rand(6, 1, 8, 8, generator=gen, dtype=torch.float64),
                        torch.randint(0, 2, (6, 1, 8, 8), generator=gen).double()])
    assert float(jacobian_norm(network, images, method="exact").max()) <= bound.value
    with pytest.raises(NotALipschitzTransformer, match="L2 attention"):
        paper_bound(network)


def test_the_l2_lipschitz_transformer_trains_with_each_matrix_constrained_once():
    module = l2_transformer()
    names = [name for name, _ in constrained_matrices(module.network, "all")]
    assert not [n for n in names if n.endswith("qkv.k.weight")]  # k is q
    assert sum(n.endswith("qkv.q.weight") for n in names) == VIT["depth"]
    optimizer = module.build_optimizer()
    images, labels = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))
    losses = []
    for step in range(8):
        optimizer.zero_grad()
        _, terms = module.losses(images, labels)
        terms["task"].backward()
        optimizer.step()
        module.after_optimizer_step(step)
        losses.append(float(terms["task"]))
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="attention: l2 is implemented for the ViT"):
        ImageClassifier(backbone="swin", image_size=16, stabilizer="lipschitz_transformer",
                        stabilizer_options={"lipschitz_transformer": {"attention": "l2"}},
                        backbone_options=dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2)))
