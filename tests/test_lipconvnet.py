"""The convolutional anchor: AOL layers are 1-Lipschitz by construction and their float64 Schur bound is never below
the exact operator norm; the network's certified bound is never below its exact Jacobian norm, per class pair too;
it certifies through the same float64 path as the transformers; bad shapes are refused by name."""
import pytest
import torch
import torch.nn.functional as F

from stability.callbacks.bounds import exact_certificate
from stability.classifier import ImageClassifier
from stability.lipschitz.certified import certified_bound
from stability.models import Network, build_backbone
from stability.nn.aol import (
    AOLConv2d,
    AOLLinear,
    ChannelMaxMin,
    StridedAOLConv,
    aol_weight,
    isometric_init_,
    padded_conv2d,
)
from stability.robustness import certified_radii


def operator_norm(f, shape) -> float:
    """σ₁ of a linear map, exactly: the 2-norm of its Jacobian matrix (float64)."""
    x = torch.zeros(1, *shape, dtype=torch.float64)
    jacobian = torch.func.jacrev(f)(x)
    return float(torch.linalg.matrix_norm(jacobian.reshape(-1, x.numel()), ord=2))


def randomised(layer, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
    return layer.double()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aol_layers_are_one_lipschitz_and_their_schur_bound_is_above_the_exact_norm(seed):
    conv = randomised(AOLConv2d(3, 4, 3), seed)
    linear = randomised(AOLLinear(6, 5), seed)
    strided = StridedAOLConv(3, 4, 4)
    randomised(strided.conv, seed)
    cases = [(conv, lambda x: F.conv2d(F.pad(x, conv.pads), conv.effective_weight()), (3, 7, 7)),
             (linear, lambda x: x @ linear.effective_weight().T, (6,)),
             (strided, lambda x: strided.conv.forward(F.pixel_unshuffle(x, 2)) - strided.conv.bias[:, None, None],
              (3, 6, 6))]
    for layer, f, shape in cases:
        exact = operator_norm(f, shape)
        bound = float(layer.lipschitz())
        assert exact <= 1 + 1e-12 and exact <= bound * (1 + 1e-12), (type(layer).__name__, exact, bound)
        assert bound == pytest.approx(1.0, abs=1e-12)


def test_without_the_rescaling_the_same_kernel_is_not_one_lipschitz():
    """The planted error: AOL's d skipped. The check above would catch it (the exact norm exceeds 1)."""
    conv = randomised(AOLConv2d(3, 4, 3))
    raw = operator_norm(lambda x: F.conv2d(F.pad(x, conv.pads), conv.weight), (3, 7, 7))
    assert raw > 1.5


def test_the_isometric_initialisation_keeps_every_singular_value_at_one():
    conv, linear = AOLConv2d(3, 8, 3).double(), AOLLinear(4, 6).double()
    for layer in (conv, linear):
        isometric_init_(layer)
    for f, shape in ((lambda x: F.conv2d(F.pad(x, conv.pads), conv.effective_weight()), (3, 5, 5)),
                     (lambda x: x @ linear.effective_weight().T, (4,))):
        x = torch.zeros(1, *shape, dtype=torch.float64)
        singular = torch.linalg.svdvals(torch.func.jacrev(f)(x).reshape(-1, x.numel()))
        torch.testing.assert_close(singular, torch.ones_like(singular))
    torch.testing.assert_close(aol_weight(linear.weight), linear.weight)  # d = 1: W = P


def test_the_rescaling_is_computed_in_float32_under_bf16_autocast():
    """A GPU run trains under bf16 autocast and TF32: d's Gram sums must not round there (they moved the effective
    weight by up to 0.5% before), so the network trained is the one the float64 Schur bound certifies."""
    conv, linear = AOLConv2d(8, 16, 3), AOLLinear(64, 32)
    for layer in (conv, linear):
        randomised(layer).float()
        reference = layer.effective_weight()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = layer.effective_weight()
        assert under_autocast.dtype == torch.float32
        torch.testing.assert_close(under_autocast, reference, rtol=1e-6, atol=0)
    double = randomised(AOLLinear(6, 5))
    assert aol_weight(double.weight).dtype == torch.float64  # float64 stays float64


def test_the_anchor_compiles_in_one_graph_with_the_rescaling_out_of_autocast():
    """``--model.compile true``: the float32 rescaling must not break the graph at every layer (setting the TF32
    flags inside it did: 23 breaks), and inside the graph autocast is still off for it."""
    torch._dynamo.reset()
    net = Network(build_backbone("lipcnn", "micro", img_size=8, in_chans=1, num_classes=10), [0.3], [0.4])
    assert torch._dynamo.explain(net)(torch.rand(2, 1, 8, 8)).graph_break_count == 0
    layer = net.backbone.features[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(layer.effective_weight, backend="eager")()
    torch.testing.assert_close(compiled, layer.effective_weight(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("pads", [(1, 1, 1, 1), (0, 1, 0, 1), (0, 2, 0, 2), (2, 0, 1, 3), (0, 3, 0, 0)])
def test_the_convolutions_padding_equals_padding_the_input(pads, stride):
    """padded_conv2d against the definition F.conv2d(F.pad(x, pads)), in float64, values and both gradients, on even
    and odd sizes; a window shifted by one pixel (what a wrong cut of the output gives) is far from it."""
    gen = torch.Generator().manual_seed(sum(pads) + stride)
    weight = torch.randn(3, 2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=gen, dtype=torch.float64)
    for size in ((9, 8), (8, 11)):
        x = torch.randn(2, 2, *size, generator=gen, dtype=torch.float64, requires_grad=True)
        mine, reference = padded_conv2d(x, weight, bias, pads, stride), F.conv2d(F.pad(x, pads), weight, bias, stride)
        assert mine.shape == reference.shape
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)
        grad = torch.randn(reference.shape, generator=gen, dtype=torch.float64)
        for got, want in zip(torch.autograd.grad(mine, (x, weight), grad), torch.autograd.grad(reference, (x, weight),
                                                                                                grad)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        shifted = F.conv2d(F.pad(x, (pads[0] + 1, max(0, pads[1] - 1), *pads[2:])), weight, bias, stride)
        columns = min(shifted.shape[-1], reference.shape[-1])
        assert float((shifted[..., :columns] - reference[..., :columns]).abs().max()) > 0.1


@pytest.mark.parametrize("size", [8, 7])
def test_the_strided_convolution_is_its_blockwise_definition(size):
    """StridedAOLConv as one k × k convolution of stride 2 equals zero padding, pixel_unshuffle and the AOL
    convolution, in float64: values, the input's and the parameter's gradients."""
    torch.manual_seed(size)
    layer = StridedAOLConv(3, 4, 4).double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64, requires_grad=True)
    mine, reference = layer(x), layer.blockwise(x)
    assert mine.shape == reference.shape == (2, 4, (size + 1) // 2, (size + 1) // 2)
    torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(reference)
    for got, want in zip(torch.autograd.grad(mine, (x, layer.conv.weight), grad),
                         torch.autograd.grad(reference, (x, layer.conv.weight), grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_maxmin_over_channels_permutes_each_point():
    x = torch.randn(2, 6, 3, 3)
    y = ChannelMaxMin()(x)
    torch.testing.assert_close(y.sort(dim=1).values, x.sort(dim=1).values)
    with pytest.raises(ValueError, match="even number"):
        ChannelMaxMin()(torch.randn(1, 3, 2, 2))


def random_network(seed=0, head="linear"):
    torch.manual_seed(seed)
    backbone = build_backbone("lipcnn", "micro", img_size=8, in_chans=1, num_classes=10, head=head)
    net = Network(backbone, [0.3], [0.4]).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return net


@pytest.mark.parametrize("head", ["linear", "lln", "aol"])
def test_the_certified_bound_is_above_the_exact_jacobian_norm_whole_and_per_pair(head):
    net = random_network(head=head)
    bound, reason = certified_bound(net)
    assert bound is not None, reason
    w = bound.head_weight.double()
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.rand(1, 1, 8, 8, generator=gen, dtype=torch.float64)
        jacobian = torch.func.jacrev(net)(x).reshape(10, -1)
        assert float(torch.linalg.matrix_norm(jacobian, ord=2)) <= bound.value
        features = torch.func.jacrev(lambda z: net.backbone.forward_features((z - net.mean) / net.std))(x)
        assert float(torch.linalg.matrix_norm(features.reshape(features.shape[1], -1), ord=2)) <= bound.features
        for i in range(10):
            for j in range(i + 1, 10):
                pair = float(torch.linalg.vector_norm(jacobian[i] - jacobian[j]))
                assert pair <= bound.features * float(torch.linalg.vector_norm(w[i] - w[j])) * (1 + 1e-12)


def test_an_isometric_network_attains_the_features_bound():
    """Random weights make AOL contract (the exact norm is ≈ 0.1 of the bound above), where a bound short by a
    factor would still pass; here every hidden map is an isometry (one 1×1 convolution to two channels, orthogonal,
    then MaxMin), so the exact Jacobian norm of the features *is* 1/σ_pixel and the bound must equal it: a bound
    that dropped the 1/σ (2.5×) or a layer's factor fails."""
    backbone = build_backbone("lipcnn", "micro", img_size=8, in_chans=1, num_classes=10, convs=[[2, 1, 1]], dense=[])
    net = Network(backbone, [0.3], [0.4]).double()
    bound, reason = certified_bound(net)
    assert bound is not None, reason
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    features = torch.func.jacrev(lambda z: net.backbone.forward_features((z - net.mean) / net.std))(x)
    exact = float(torch.linalg.matrix_norm(features.reshape(features.shape[1], -1), ord=2))
    assert exact == pytest.approx(1 / net.std.min().item(), rel=1e-12)
    assert bound.features == pytest.approx(exact, rel=1e-12)  # equal to the last bits (the radii add 1e-9 of slack)


def margin_attack(network, images, labels, radii, steps=30):
    """ℓ2 PGD on the margin z_y − max_{j≠y} z_j within each point's own radius (steps of radius/10)."""
    delta = torch.zeros_like(images, requires_grad=True)
    r = radii.view(-1, 1, 1, 1)
    for _ in range(steps):
        logits = network(images + delta)
        top = logits.gather(1, labels[:, None]).squeeze(1)
        other = logits.scatter(1, labels[:, None], -torch.inf).amax(1)
        (grad,) = torch.autograd.grad((top - other).sum(), delta)
        with torch.no_grad():
            delta -= r / 10 * grad / grad.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1, 1)
            delta *= (r / delta.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1, 1)).clamp(max=1)
    with torch.no_grad():
        return network(images + delta).argmax(-1)


def test_the_anchor_certifies_through_the_float64_path_without_a_stabilizer():
    """``--stabilizer none`` on ``lipcnn``: the monitors get a float64 copy and its bound; the radii they certify
    hold against a margin attack inside them, and the same attack at 16 radii flips every point (so it can fail)."""
    torch.manual_seed(0)
    module = ImageClassifier(backbone="lipcnn")
    bound, reason, exact = exact_certificate(module.stabilizers, module.network)
    assert bound is not None and exact is not None, reason
    assert next(exact.parameters()).dtype == torch.float64 and "AOL" in bound.label
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(16, 1, 8, 8, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        labels = exact(images).argmax(-1)
        radii = certified_radii(exact(images), labels, bound)
    assert (radii > 0).all()
    assert (margin_attack(exact, images, labels, 0.999 * radii) == labels).all()
    assert (margin_attack(exact, images, labels, 16 * radii) != labels).all()


def test_the_4c3f_preset_has_gloros_shapes():
    backbone = build_backbone("lipcnn", "4c3f", img_size=28, in_chans=1, num_classes=10)
    shapes = [tuple(m.weight.shape) for m in backbone.modules() if isinstance(m, (AOLConv2d, AOLLinear))]
    # 3×3 convs as they are; the 4×4 stride-2 ones as 2×2 convs on 2×2-blocked inputs (4× the channels)
    assert shapes == [(32, 1, 3, 3), (32, 128, 2, 2), (64, 32, 3, 3), (64, 256, 2, 2), (512, 3136), (512, 512)]
    assert backbone(torch.rand(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("options, message", [({"head": "softmax"}, "head must be one of"),
                                              ({"convs": [[7, 3, 1]]}, "even number of channels"),
                                              ({"convs": [[8, 3, 3]]}, "stride must be 1 or 2"),
                                              ({"convs": [[8, 3, 2]]}, "needs an even kernel"),
                                              ({"convs": [[8, 4, 1]]}, "needs an odd kernel")])
def test_bad_shapes_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        build_backbone("lipcnn", "micro", img_size=8, in_chans=1, num_classes=10, **options)


def test_a_failed_freeze_leaves_nothing_frozen(monkeypatch):
    from stability.nn import aol
    from stability.robustness.attacks import evaluating

    network = random_network().float().eval()
    original, seen = aol.aol_weight, []

    def failing(weight):
        seen.append(weight)
        if len(seen) == 2:
            raise RuntimeError("out of memory")
        return original(weight)

    monkeypatch.setattr(aol, "aol_weight", failing)
    with pytest.raises(RuntimeError, match="out of memory"), evaluating(network):
        pass
    assert not aol._FROZEN


def test_measurements_compute_each_aol_weight_once_and_get_the_same_numbers(monkeypatch):
    """Inside ``evaluating`` (every attack and estimate) the AOL layers multiply by effective weights computed once on
    entry: no rescaling at each pass, the same logits and input gradients bit for bit; a weight changed inside is
    rescaled again, and a float64 copy made inside computes its own, in float64."""
    import copy

    from stability.nn import aol
    from stability.robustness.attacks import evaluating

    network = random_network().float().eval()
    images = torch.rand(6, 1, 8, 8, requires_grad=True)

    def fresh(net, x):
        """The logits with every AOL weight rescaled now, nothing frozen."""
        saved = dict(aol._FROZEN)
        aol._FROZEN.clear()
        try:
            return net(x).detach()
        finally:
            aol._FROZEN.update(saved)

    def logits_and_gradient(net, x):
        out = net(x)
        return out.detach(), torch.autograd.grad(out.square().sum(), x)[0]

    expected = logits_and_gradient(network, images)
    layers = sum(isinstance(m, (AOLConv2d, AOLLinear)) for m in network.modules())
    calls = []
    counted = aol.aol_weight

    def counting(weight):
        calls.append(weight)
        return counted(weight)

    with evaluating(network):
        monkeypatch.setattr(aol, "aol_weight", counting)
        got = logits_and_gradient(network, images)
        assert not calls  # frozen on entry
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        dense = next(m for m in network.modules() if isinstance(m, AOLLinear))
        with torch.no_grad():
            dense.weight.add_(torch.randn_like(dense.weight))  # changed inside the block: rescaled again
        changed = network(images)
        assert len(calls) == 1
        assert torch.equal(changed, fresh(network, images))
        dense.weight = torch.nn.Parameter(torch.randn_like(dense.weight))  # replaced: rescaled again
        assert torch.equal(network(images), fresh(network, images))
        calls.clear()
        copied = copy.deepcopy(network).double()
        out = copied(images.detach().double())
        assert out.dtype == torch.float64 and len(calls) == layers
    assert layers >= 3 and not aol._FROZEN  # outside the block nothing stays frozen
    calls.clear()
    network(images)
    assert len(calls) == layers  # each pass rescales again
