"""The hybrid: a ViT on the tokens of the anchor's AOL convolutions. Its stem's bound is never below the stem's exact
Jacobian norm; the certified bound of the whole network (stem × blocks × head, float64) is never below the exact
Jacobian norm, whole and per class pair, and a bound that drops a factor fails where the network attains its bound;
the tokens' size bound holds on the pixel box; the training bound matches the certified one; bad options are refused
by name."""

import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz import transformer_bounds
from stability.lipschitz.certified import certified_bound
from stability.models import Network, build_backbone
from stability.models.hybrid import AOLStem
from stability.nn.aol import AOLConv2d
from stability.nn.l2_attention import unit_divisor
from stability.stabilizers.lipschitz_transformer import LipschitzTransformer

MEAN, STD = [0.3], [0.4]


def hybrid(attention="l2_unit", seed=0, **options) -> Network:
    """The micro hybrid (8×8 images, 16 tokens + the class token) with the certified transformer's blocks, every
    parameter random (the bounds hold for every weight), in float64."""
    torch.manual_seed(seed)
    net = Network(build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10, **options), MEAN, STD)
    architecture = LipschitzTransformer(attention=attention, activation="maxmin", pooling="flatten")
    architecture.prepare(net)
    architecture.after_prepare(net)  # as a run has it: the dot attention's 1/3 taken by W_O
    net = net.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return net


def jacobian(f, x: torch.Tensor) -> torch.Tensor:
    """(outputs, inputs) of f at one image x (1, C, H, W), float64."""
    out = torch.func.jacrev(f)(x)
    return out.reshape(-1, x.numel())


def test_the_presets_make_the_tokens_their_names_say():
    for size, tokens in (("4c49", 49), ("5c16", 16), ("5c49", 49)):
        backbone = build_backbone("hybrid", size, img_size=28, in_chans=1, num_classes=10)
        assert backbone.patch_embed.num_patches == tokens and backbone.num_prefix_tokens == 1
        assert backbone(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    micro = build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10)
    # 8 channels from the stem, 16 in the blocks: a 1×1 AOL convolution between them
    assert isinstance(micro.patch_embed.layers[-1], AOLConv2d) and micro.patch_embed.layers[-1].kernel_size == (1, 1)


def test_the_stem_bound_is_above_its_exact_jacobian_norm():
    net = hybrid()
    stem: AOLStem = net.backbone.patch_embed
    bound = float(stem.lipschitz())
    assert bound == pytest.approx(1.0, abs=1e-12)  # AOL: 1 per layer up to float64 rounding
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(1, 1, 8, 8, generator=gen, dtype=torch.float64)
        exact = float(torch.linalg.matrix_norm(jacobian(stem, x).detach(), ord=2))
        assert 0.05 < exact <= bound * (1 + 1e-12)


@pytest.mark.parametrize("attention, heads", [("l2_unit", 1), ("mixing", 1), ("dot", 1), ("l2_unit", 2), ("dot", 2)])
def test_the_certified_bound_is_above_the_exact_jacobian_norm_whole_and_per_pair(attention, heads):
    net = hybrid(attention, num_heads=heads)
    bound, reason = certified_bound(net)
    assert bound is not None, reason
    w = bound.head_weight.double()
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.rand(1, 1, 8, 8, generator=gen, dtype=torch.float64)
        logits = jacobian(net, x)
        assert float(torch.linalg.matrix_norm(logits, ord=2)) <= bound.value
        features = jacobian(lambda z: net.backbone.forward_head(net.backbone.forward_features((z - net.mean) / net.std),
                                                                pre_logits=True).flatten(1), x)
        assert float(torch.linalg.matrix_norm(features, ord=2)) <= bound.features
        for i in range(10):
            for j in range(i + 1, 10):
                pair = float(torch.linalg.vector_norm(logits[i] - logits[j]))
                assert pair <= bound.features * float(torch.linalg.vector_norm(w[i] - w[j])) * (1 + 1e-12)


def attaining_network() -> tuple[Network, torch.Tensor]:
    """A hybrid that attains its bound for the class pair (0, 1): the stem one 1×1 convolution to two channels with
    weight (1, 1)/√2, then MaxMin — the same two values in either order, so the stem is linear and an isometry; the
    blocks' branches zero (W_O and the MLP's output), so each block is (1 − a)·x exactly; the head's rows 0 and 1
    ±v with v in the range of the features' Jacobian. Then ‖∇(z₀ − z₁)‖ = 2‖v‖·(1 − a)^(2·depth)/σ = the bound."""
    torch.manual_seed(0)
    backbone = build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10, convs=[[2, 1, 1]],
                              embed_dim=2, depth=2)
    net = Network(backbone, MEAN, STD)
    LipschitzTransformer(attention="l2_unit", activation="maxmin", pooling="flatten").prepare(net)
    net = net.double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        net.backbone.patch_embed.layers[0].weight.copy_(torch.full((2, 1, 1, 1), 2 ** -0.5))
        for wrapper in net.backbone.blocks:
            wrapper.block.attn.proj.weight.zero_()
            wrapper.block.mlp.fc2.weight.zero_()
        coefficients = torch.randn(64, 1, generator=gen, dtype=torch.float64)
        v = torch.cat([torch.zeros(1, 2, dtype=torch.float64), coefficients.expand(64, 2) * 2 ** -0.5]).flatten()
        head = net.backbone.head.weight
        head.zero_()
        head[0], head[1] = v, -v
    return net, v


def pair_exact_and_bound(net: Network) -> tuple[float, float]:
    bound, reason = certified_bound(net)
    assert bound is not None, reason
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logits = jacobian(net, x)
    exact = float(torch.linalg.vector_norm(logits[0] - logits[1]))
    w = bound.head_weight.double()
    return exact, bound.features * float(torch.linalg.vector_norm(w[0] - w[1]))


def test_a_network_that_attains_the_bound_meets_it_to_the_last_bits():
    net, v = attaining_network()
    exact, bound = pair_exact_and_bound(net)
    a = net.backbone.blocks[0].a
    assert exact == pytest.approx(2 * float(v.norm()) * (1 - a) ** 4 / float(net.std), rel=1e-12)  # σ as stored
    assert exact <= bound <= exact * (1 + 1e-12)


def test_a_bound_without_the_pixel_normalisation_fails_the_same_check(monkeypatch):
    """The planted error: the embedding's 1/σ dropped (a missing factor of 2.5). The check above fails with it."""
    net, _ = attaining_network()
    original = transformer_bounds._embedding

    def missing_factor(network, *args):
        bound, size = original(network, *args)
        return bound * network.std.min().to(bound.dtype), size

    monkeypatch.setattr(transformer_bounds, "_embedding", missing_factor)
    exact, bound = pair_exact_and_bound(net)
    assert bound < exact


def test_the_token_size_bound_holds_on_the_pixel_box():
    """r bounds every token the blocks see for any image in [0, 1]ⁿ: checked on random images and on the box's
    corners (pixels 0 or 1), where the tokens are largest."""
    net = hybrid("dot")
    backbone, embed, _ = transformer_bounds._parts(net)
    sigmas = {name: transformer_bounds.exact_sigma(m.detach()) for name, m in
              transformer_bounds.bound_matrices(net).items()}
    _, r = transformer_bounds._embedding(net, backbone, embed, sigmas, torch.float64, False)
    gen = torch.Generator().manual_seed(4)
    images = torch.cat([torch.rand(64, 1, 8, 8, generator=gen, dtype=torch.float64),
                        torch.randint(0, 2, (64, 1, 8, 8), generator=gen).double()])
    with torch.no_grad():
        tokens = backbone._pos_embed(embed((images - net.mean) / net.std))
    largest = float(tokens.norm(dim=-1).max())
    assert largest <= float(r) and float(r) < 10 * largest


def test_the_divisor_of_unit_l2_attention_grows_with_the_tokens():
    """The numbers the configs and the report quote: one head of 64 dimensions on 17 and 50 tokens."""
    assert unit_divisor(17, 1, 64) == pytest.approx(3.45, abs=0.01)
    assert unit_divisor(50, 1, 64) == pytest.approx(8.43, abs=0.01)
    assert unit_divisor(50, 1, 64) > 2 * unit_divisor(17, 1, 64)


@pytest.mark.parametrize("heads", [1, 2])
def test_the_training_bound_matches_the_certified_one_at_initialisation(heads):
    """GloRo's per-step bound on the hybrid: the stem at AOL's 1 per layer, the blocks from power-iteration
    estimates (from below), the head's weight: in float32 within 1e-5 of the float64 certificate."""
    torch.manual_seed(0)
    module = ImageClassifier(backbone="hybrid", image_size=8, backbone_options={"num_heads": heads},
                             stabilizer=["lipschitz_transformer", "muon", "gloro"],
                             stabilizer_options={"lipschitz_transformer": {"attention": "l2_unit",
                                                                           "pooling": "flatten", "zero_init": False},
                                                 "muon": {"constraint": "hard_cap", "layers": "all"}})
    gloro = module.stabilizers[-1]
    training = gloro.margin_bound(module.network)
    certified, reason = certified_bound(module.network)
    assert certified is not None, reason
    assert training.total.dtype == torch.float32
    assert float(training.total) <= certified.value * (1 + 1e-5)
    assert float(training.total) == pytest.approx(certified.value, rel=1e-5)
    training.total.backward()  # differentiable through the blocks' estimates
    assert module.network.backbone.blocks[0].block.attn.qkv.q.weight.grad is not None


def test_the_paper_bound_and_a_patch_size_are_refused_with_the_reason():
    with pytest.raises(transformer_bounds.NotALipschitzTransformer, match="convolutional stem"):
        transformer_bounds.paper_bound(hybrid())
    with pytest.raises(ValueError, match="patch_size is not an option"):
        build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10, patch_size=2)
    with pytest.raises(ValueError, match="convs is empty"):
        build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10, convs=[])
    with pytest.raises(ValueError, match="built for 8×8 images"):
        build_backbone("hybrid", "micro", img_size=8, in_chans=1, num_classes=10)(torch.rand(1, 1, 16, 16))
    with pytest.raises(ValueError, match="applies to the backbones"):
        ImageClassifier(backbone="hybrid", stabilizer="jasmin")


def test_the_hybrid_certifies_through_the_float64_path():
    """The monitors certify on a float64 copy of the trained network (exact_certificate): for the hybrid with GloRo
    that copy is float64, its bound is the bound of the network, and it is never below the copy's exact Jacobian
    norm at a point of the box."""
    from stability.callbacks.bounds import exact_certificate

    torch.manual_seed(0)
    module = ImageClassifier(backbone="hybrid", image_size=8, stabilizer=["lipschitz_transformer", "muon", "gloro"],
                             stabilizer_options={"lipschitz_transformer": {"attention": "l2_unit",
                                                                           "pooling": "flatten", "zero_init": False}})
    bound, reason, exact = exact_certificate(module.stabilizers, module.network)
    assert bound is not None and exact is not None, reason
    assert next(exact.parameters()).dtype == torch.float64
    assert bound.value == pytest.approx(certified_bound(module.network.double())[0].value, rel=1e-9)
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert float(torch.linalg.matrix_norm(jacobian(exact, x).detach(), ord=2)) <= bound.value


def test_the_run_names_only_what_no_constraint_holds():
    """The stem's AOL weights are 1-Lipschitz for every value, so the run's warning names only the stem's biases and
    the head, which Muon leaves free with ``layers: hidden`` (GloRo's margin carries the head's rows)."""
    module = ImageClassifier(backbone="hybrid", image_size=8,
                             stabilizer=["lipschitz_transformer", "muon", "gloro"],
                             stabilizer_options={"lipschitz_transformer": {"attention": "l2_unit",
                                                                           "activation": "maxmin",
                                                                           "pooling": "flatten"},
                                                 "muon": {"constraint": "hard_cap", "layers": "hidden"}})
    free = module.unconstrained_parameters()
    assert {n for n in free if not n.endswith("bias")} == {"backbone.head.weight"}
    assert all(n.startswith("backbone.patch_embed.layers.") for n in free if n.endswith("bias"))
    alone = ImageClassifier(backbone="hybrid", image_size=8, stabilizer=["lipschitz_transformer"])
    assert any(n.endswith("qkv.q.weight") for n in alone.unconstrained_parameters())  # no Muon: the blocks are free
