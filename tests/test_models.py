"""Backbones: shapes, the uniform view, the fused path, and CSwin against a naive reference."""
import pytest
import torch
import torch.nn.functional as F

from stability.models import (
    CSWinTransformer,
    Network,
    attention_sites,
    build_backbone,
    capture_attention,
    norm_sites,
    patch_embed,
    residual_sites,
)
from stability.models.cswin import CrossShapedAttention

TINY = {
    "vit": dict(embed_dim=16, depth=2, num_heads=2),
    "swin": dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2), window_size=2),
    "cswin": dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2)),
}


@pytest.mark.parametrize("name", ["vit", "swin", "cswin"])
def test_backbone_shapes_and_view(name):
    net = build_backbone(name, "micro", img_size=8, in_chans=1, num_classes=7, **TINY[name]).eval()
    x = torch.rand(3, 1, 8, 8)
    assert net(x).shape == (3, 7)
    sites = attention_sites(net)
    assert len(sites) == 2 and len(residual_sites(net)) == 4
    assert norm_sites(net) and patch_embed(net) is net.patch_embed
    for site in sites:
        d = site.head_dim
        assert site.qkv.out_features == 3 * site.num_heads * d
        w_k1 = site.head_weight("k", 1)
        assert w_k1.shape == (d, site.qkv.in_features)
        start = site.num_heads * d + d
        assert torch.equal(w_k1, site.qkv.weight[start:start + d])
    with pytest.raises(ValueError, match="part must be one of"):
        sites[0].head_weight("o", 0)


@pytest.mark.parametrize("name", ["vit", "swin", "cswin"])
def test_capture_attention_gives_probabilities_and_restores_fused_path(name):
    net = build_backbone(name, "micro", img_size=8, in_chans=1, num_classes=5, **TINY[name]).eval()
    for site in attention_sites(net):
        site.module.fused_attn = True
    x = torch.rand(2, 1, 8, 8)
    fused = net(x)
    with capture_attention(net) as probs:
        explicit = net(x)
    assert all(s.module.fused_attn for s in attention_sites(net))
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-4)
    assert len(probs) >= len(attention_sites(net))
    for p in probs:
        assert p.ndim == 4 and p.shape[-1] == p.shape[-2]
        assert (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))
    count = len(probs)
    net(x)  # hooks removed: a later forward records nothing
    assert len(probs) == count


def test_residual_site_scales_branch():
    net = build_backbone("vit", "micro", img_size=8, in_chans=1, num_classes=3, **TINY["vit"]).eval()
    x = torch.rand(2, 1, 8, 8)
    before = net(x)
    for site in residual_sites(net):
        assert site.dim == 16
        site.scale_branch(torch.nn.Identity())
    torch.testing.assert_close(net(x), before)  # identity scale: same function
    # scale 0 on every branch leaves only the shortcut: the blocks drop out
    zero = net
    for site in residual_sites(zero):
        site.scale_branch(_Zero())
    tokens = zero.patch_embed(x)
    tokens = zero._pos_embed(tokens)
    expected = zero.head(zero.fc_norm(zero.norm(tokens))[:, 0])
    torch.testing.assert_close(zero(x), expected)


class _Zero(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def test_network_normalises_inside():
    backbone = torch.nn.Flatten()
    net = Network(backbone, mean=(0.5,), std=(0.25,))
    x = torch.rand(2, 1, 2, 2)
    torch.testing.assert_close(net(x), ((x - 0.5) / 0.25).flatten(1))
    with pytest.raises(ValueError, match="std must be positive"):
        Network(backbone, mean=(0.5,), std=(0.0,))


def test_registry_errors_name_the_choices():
    with pytest.raises(ValueError, match=r"unknown backbone 'resnet'.*cswin.*swin.*vit"):
        build_backbone("resnet", img_size=8, in_chans=1, num_classes=2)
    with pytest.raises(ValueError, match="unknown size 'huge'.*micro"):
        build_backbone("vit", "huge", img_size=8, in_chans=1, num_classes=2)
    with pytest.raises(ValueError, match="patch_size 3 does not divide"):
        build_backbone("vit", img_size=8, in_chans=1, num_classes=2, patch_size=3)
    with pytest.raises(ValueError, match="bad backbone option"):
        build_backbone("vit", img_size=8, in_chans=1, num_classes=2, not_an_option=1)


@pytest.mark.parametrize("name,size,img,options", [
    ("vit", "tiny", 32, {}),
    ("swin", "tiny", 32, {"patch_size": 2, "window_size": 4}),
    ("cswin", "tiny", 32, {"patch_size": 2, "stripe_widths": (1, 2, 2, 2)}),
])
def test_paper_presets_build_at_cifar_size(name, size, img, options):
    net = build_backbone(name, size, img_size=img, in_chans=3, num_classes=10, **options)
    assert len(attention_sites(net)) == {"vit": 12, "swin": 12, "cswin": 25}[name]


# ----------------------------------------------------------------------------- CSwin


def naive_cross_shaped_attention(attn: CrossShapedAttention, x: torch.Tensor) -> torch.Tensor:
    """Loop over stripes and heads: softmax(q kᵀ/√d) v + DWConv3×3(v) inside each stripe."""
    b, h, w, c = x.shape
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
    branches = len(attn.stripes)
    cb, heads, d = c // branches, attn.num_heads // branches, attn.head_dim
    out = torch.zeros(b, h, w, c)
    for i, (sh, sw) in enumerate(attn.stripes):
        conv = attn.lepe[i]
        for n in range(b):
            for r0 in range(0, h, sh):
                for c0 in range(0, w, sw):
                    rows, cols = slice(r0, r0 + sh), slice(c0, c0 + sw)
                    chans = slice(i * cb, (i + 1) * cb)
                    vs = v[n, rows, cols, chans]  # (sh, sw, cb)
                    lepe = F.conv2d(vs.permute(2, 0, 1)[None], conv.weight, conv.bias, padding=1, groups=cb)[0]
                    for hd in range(heads):
                        ch = slice(i * cb + hd * d, i * cb + (hd + 1) * d)
                        qs = q[n, rows, cols, ch].reshape(-1, d)
                        ks = k[n, rows, cols, ch].reshape(-1, d)
                        vh = v[n, rows, cols, ch].reshape(-1, d)
                        o = torch.softmax(qs @ ks.T / d ** 0.5, dim=-1) @ vh
                        out[n, rows, cols, ch] = o.reshape(sh, sw, d) + lepe[hd * d:(hd + 1) * d].permute(1, 2, 0)
    return out @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize("stripe_width", [1, 2, None])
@pytest.mark.parametrize("fused", [True, False])
def test_cross_shaped_attention_matches_naive_reference(stripe_width, fused):
    attn = CrossShapedAttention(dim=8, num_heads=4, resolution=4, stripe_width=stripe_width).eval()
    torch.nn.init.normal_(attn.qkv.weight, std=0.5)
    attn.fused_attn = fused
    x = torch.randn(2, 4, 4, 8)
    torch.testing.assert_close(attn(x), naive_cross_shaped_attention(attn, x), atol=1e-5, rtol=1e-4)


def test_cross_shaped_attention_splits_heads_between_stripe_directions():
    attn = CrossShapedAttention(dim=8, num_heads=4, resolution=4, stripe_width=1)
    assert attn.stripes == [(4, 1), (1, 4)]  # vertical stripes for heads 0-1, horizontal for 2-3
    with capture_attention(attn_holder(attn)) as probs:
        attn(torch.randn(1, 4, 4, 8))
    assert [tuple(p.shape) for p in probs] == [(4, 2, 4, 4), (4, 2, 4, 4)]


def attn_holder(attn):
    holder = torch.nn.Module()
    holder.attn = attn
    return holder


def test_cswin_forward_and_clear_errors():
    net = CSWinTransformer(img_size=16, patch_size=2, in_chans=3, num_classes=4, embed_dim=16,
                           depths=(1, 1, 1), num_heads=(2, 2, 4), stripe_widths=(2, 2, 2))
    assert net(torch.rand(2, 3, 16, 16)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"stripe width 3 does not divide the stage resolution 8.*\[1, 2, 4, 8\]"):
        CSWinTransformer(img_size=16, patch_size=2, embed_dim=16, depths=(1, 1), num_heads=(2, 2),
                         stripe_widths=(3, 1))
    with pytest.raises(ValueError, match="num_heads must be even"):
        CSWinTransformer(img_size=16, patch_size=2, embed_dim=18, depths=(1, 1), num_heads=(3, 2),
                         stripe_widths=(2, 1))
    with pytest.raises(ValueError, match="patch_size 3 does not divide img_size 16"):
        CSWinTransformer(img_size=16, patch_size=3)
    with pytest.raises(ValueError, match="must be divisible by 8"):
        CSWinTransformer(img_size=12, patch_size=2, depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2),
                         stripe_widths=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="one entry per stage"):
        CSWinTransformer(img_size=16, patch_size=2, depths=(1, 1), num_heads=(2,), stripe_widths=(1, 1))


@pytest.mark.parametrize("bias", [True, False])
def test_lepe_taps_equal_the_depthwise_convolution(bias):
    """The nine shifted products LePE computes when compiled are F.conv2d's cross-correlation (padding 1, one group
    per channel): values and gradients in float64 to 1e-12, on a non-square map; a kernel read transposed differs."""
    from stability.models.cswin import depthwise_conv3x3_taps

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 1, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    ours = depthwise_conv3x3_taps(x, w, b)
    reference = F.conv2d(x, w, b, padding=1, groups=5)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    inputs = [t for t in (x, w, b) if t is not None]
    cotangent = torch.randn(ours.shape, dtype=torch.float64, generator=g)
    for a, r in zip(torch.autograd.grad(ours, inputs, cotangent), torch.autograd.grad(reference, inputs, cotangent)):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
    transposed = depthwise_conv3x3_taps(x, w.transpose(-1, -2), b)
    assert (transposed - reference).abs().max() > 1e-2


def test_lepe_compiled_equals_the_convolution_in_float64_and_under_autocast(monkeypatch):
    """A CSwin network traced compiled (its LePE as the nine products) gives the eager network's values and input
    gradients: in float64 to 1e-10, and under bf16 autocast in bf16 (the convolution's dtype there) to its rounding.
    Eager, LePE is the convolution itself."""
    from stability.models.cswin import LePEConv

    torch.manual_seed(0)
    conv = LePEConv(4)
    x = torch.randn(2, 4, 3, 5)
    assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1, groups=4))
    network = build_backbone("cswin", "micro", img_size=16, in_chans=1, num_classes=10).double()
    compiled = torch.compile(network, backend="eager")
    images = torch.rand(3, 1, 16, 16, dtype=torch.float64, requires_grad=True)
    eager_out, compiled_out = network(images), compiled(images)
    assert compiled_out.dtype == torch.float64
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=1e-10)
    grads = [torch.autograd.grad(out.square().sum(), images)[0] for out in (eager_out, compiled_out)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-10)
    network.float()
    with torch.autocast("cpu", torch.bfloat16):
        eager_bf16, compiled_bf16 = network(images.float()), compiled(images.float())
        lepe = network.stages[0][0].attn.lepe[0]
        lepe_input = torch.randn(2, lepe.in_channels, 3, 5)  # float32 into a bf16 convolution, cast as it casts
        eager_lepe, compiled_lepe = lepe(lepe_input), torch.compile(lepe, backend="eager")(lepe_input)
    assert compiled_lepe.dtype == eager_lepe.dtype == torch.bfloat16
    torch.testing.assert_close(compiled_lepe.float(), eager_lepe.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled_bf16.float(), eager_bf16.float(), rtol=5e-2, atol=5e-2)
