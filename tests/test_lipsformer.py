"""LipsFormer components against their theorems: CenterNorm's exact Lipschitz constant, SCSA
below Theorem 1's bound (exact Jacobians by torch.func), spectral init σ₁ = 1 by SVD."""
import copy as copy_module
import io

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention
from torch import nn
from torch.func import jacrev

from stability.classifier import ImageClassifier
from stability.models import attention_sites, norm_sites, residual_sites
from stability.models.adapters import ConvexResidualBlock
from stability.models.surgery import replace_submodule
from stability.nn import center_norm, folded_scale
from stability.nn.center_norm import CenterNorm
from stability.nn.cosine_attention import ScaledCosineKernel, scsa_lipschitz_bound
from stability.nn.folded_scale import ScaledOutputLinear, fold_output_scale, folds_at
from stability.nn.spectral import conv_operator_norm, spectral_init_
from stability.stabilizers.lipsformer import LipsFormer, ResidualScale

VIT = dict(embed_dim=16, depth=2, num_heads=2)


@pytest.mark.parametrize("dim", [2, 5, 16])
@pytest.mark.parametrize("gamma", [1.0, -0.3, 2.5])
def test_center_norm_jacobian_norm_is_d_over_d_minus_1_times_gamma(dim, gamma):
    norm = CenterNorm(dim).double()
    with torch.no_grad():
        norm.weight.fill_(gamma)
        norm.bias.normal_()
    x = torch.randn(dim, dtype=torch.float64)
    jac = jacrev(norm)(x)
    exact = float(torch.linalg.matrix_norm(jac, ord=2))
    assert exact == pytest.approx(dim / (dim - 1) * abs(gamma), rel=1e-10)
    assert norm.lipschitz() == pytest.approx(exact, rel=1e-10)
    torch.testing.assert_close(jacrev(norm)(torch.randn(dim, dtype=torch.float64)), jac)  # constant Jacobian


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_center_norm_and_its_gradients_equal_the_formula(dtype, tolerance):
    """CN(x) = γ ⊙ (D/(D−1))·(x − mean(x)) + β and its gradients in x, γ and β, against autograd through the formula
    written out; the formula with β dropped or with D/(D+1) (planted errors) fails."""
    gen = torch.Generator().manual_seed(0)
    norm = CenterNorm(12).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen, dtype=dtype))
        norm.bias.copy_(torch.randn(12, generator=gen, dtype=dtype))
    x = (3 + torch.randn(2, 5, 12, generator=gen, dtype=dtype)).requires_grad_(True)  # a mean away from 0
    upstream = torch.randn(2, 5, 12, generator=gen, dtype=dtype)

    def outputs_and_gradients(function):
        out = function(x)
        return [out, *torch.autograd.grad(out, (x, norm.weight, norm.bias), upstream, allow_unused=True)]

    def formula(inputs, scale=12 / 11, with_bias=True):
        out = norm.weight * scale * (inputs - inputs.mean(-1, keepdim=True))
        return out + norm.bias if with_bias else out + 0 * norm.bias

    def close(got, want):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * float(b.abs().max()))

    close(outputs_and_gradients(norm), outputs_and_gradients(formula))
    for planted in (lambda t: formula(t, scale=12 / 13), lambda t: formula(t, with_bias=False)):
        with pytest.raises(AssertionError):
            close(outputs_and_gradients(norm), outputs_and_gradients(planted))


@pytest.mark.parametrize("seed", range(5))
def test_center_norm_bound_holds_for_unequal_gamma(seed):
    gen = torch.Generator().manual_seed(seed)
    norm = CenterNorm(8).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=gen, dtype=torch.float64) * 2)
    exact = float(torch.linalg.matrix_norm(jacrev(norm)(torch.randn(8, dtype=torch.float64)), ord=2))
    assert exact <= norm.lipschitz() * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_scsa_jacobian_is_below_theorem_1(seed):
    gen = torch.Generator().manual_seed(seed)
    n, d_model, d_head, tau, nu, eps = 5, 6, 4, 3.0, 0.7, 1e-2
    w_q, w_k, w_v = (torch.randn(d_head, d_model, generator=gen, dtype=torch.float64) for _ in range(3))
    kernel = ScaledCosineKernel(1, tau, nu, eps, normalize_v=True).double()
    drop = nn.Dropout(0.0)

    def head(x):  # (N, D) → (N, d)
        q, k, v = (x @ w.T for w in (w_q, w_k, w_v))
        return kernel(q[None, None], k[None, None], v[None, None], None, drop, fused=False)[0, 0]

    bound = scsa_lipschitz_bound(n, tau, nu, eps, *(float(torch.linalg.matrix_norm(w, ord=2)) for w in (w_q, w_k, w_v)))
    for scale in (0.01, 0.1, 1.0, 10.0):  # small inputs sit near the ε-region where the Jacobian is largest
        x = scale * torch.randn(n, d_model, generator=gen, dtype=torch.float64)
        jac = jacrev(head)(x).reshape(n * d_head, n * d_model)
        exact = float(torch.linalg.matrix_norm(jac, ord=2))
        assert torch.isfinite(torch.tensor(exact)) and exact <= bound


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test, whether it passes or not."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_graph_spells_the_cosine_normalisation_out_where_eager_takes_the_fused_norm(monkeypatch,
                                                                                               fresh_dynamo):
    """Where the device has the fused RMSNorm, eager attention normalises q, k and v through it (three calls), while
    inside torch.compile the formula is spelled out (Inductor makes fewer kernels of it: ViT-S's compiled LipsFormer
    network 634 launches against 694), with the same values and gradients (float32, 1e-5); a dispatch that ignores
    compiling (planted) puts RMSNorm into the graph, which the graph's nodes show."""
    from stability.nn import cosine_attention

    monkeypatch.setattr(cosine_attention, "fused_norm_on", lambda device: True)
    kernel, drop = ScaledCosineKernel(2, tau=5.0), nn.Dropout(0.0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(3))

    def attend(q, k, v):
        return kernel(q, k, v, None, drop, True)

    def graph_and_gradients(run):
        nodes = []

        def recording(gm, example_inputs):
            nodes.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = torch.compile(run, backend=recording, fullgraph=True)(*inputs)
        grads = torch.autograd.grad(out, [*inputs, kernel.tau, kernel.nu], torch.ones_like(out))
        return nodes, [out, *grads]

    calls = []
    monkeypatch.setattr(F, "rms_norm", lambda *args, _rms_norm=F.rms_norm, **kwargs: calls.append(1)
                        or _rms_norm(*args, **kwargs))
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    eager_out = attend(*inputs)
    eager = [eager_out, *torch.autograd.grad(eager_out, [*inputs, kernel.tau, kernel.nu], torch.ones_like(eager_out))]
    assert len(calls) == 3  # q, k and v, eagerly through the fused norm
    nodes, compiled = graph_and_gradients(attend)
    assert nodes and not any("rms_norm" in node for node in nodes), nodes
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()))
    monkeypatch.setattr(cosine_attention, "takes_fused_norm", lambda x: cosine_attention.fused_norm_on(x.device))
    planted, _ = graph_and_gradients(attend)
    assert any("rms_norm" in node for node in planted)


@pytest.mark.parametrize("fused, for_fused", [(True, False), (True, True), (False, False)])  # spelled out: one layout
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_cosine_normalisation_and_its_gradients_equal_the_formula(dtype, tolerance, fused, for_fused,
                                                                      monkeypatch):
    """τ · x/√(‖x‖² + ε) and the scaled queries and keys whose product is τ·q̂k̂ᵀ — through RMSNorm with ε/d and the
    scales as its weight (``fused``: CUDA's path, one fused kernel each way) or spelled out (elsewhere) — with their
    gradients in x, k and τ, against autograd through the formula written out in float64 (relative to each tensor's
    largest entry); RMSNorm with ε itself, a √d left on and τ/√d in place of τ/d (planted errors) fail. Rows near the
    ε-region (‖x‖² ≈ ε) are included, where ε's placement matters most. ``for_fused``: as a fused attention kernel
    takes them, token-major (the same values)."""
    from stability.nn import cosine_attention

    monkeypatch.setattr(cosine_attention, "fused_norm_on", lambda device: fused)
    gen = torch.Generator().manual_seed(0)
    eps, width = 1e-2, 8
    x = torch.randn(2, 2, 5, width, generator=gen, dtype=torch.float64) * torch.tensor(
        [1e-2, 1.0, 30.0, 0.05, 3.0], dtype=torch.float64).view(5, 1)
    k = torch.randn(2, 2, 5, width, generator=gen, dtype=torch.float64)
    upstream, upstream_logits = torch.randn_like(x), torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64)

    def unit(t, eps=eps):
        return t / (t.pow(2).sum(-1, keepdim=True) + eps).sqrt()

    def outputs_and_gradients(kernel, normalize, logits):
        xs, ks = (t.to(kernel.tau.dtype).requires_grad_(True) for t in (x, k))
        out, products = normalize(kernel, xs), logits(kernel, xs, ks)
        grads = torch.autograd.grad((out, products), (xs, ks, kernel.tau),
                                    (upstream.to(out.dtype), upstream_logits.to(out.dtype)))
        return [t.double() for t in (out, products, *grads)]

    def close(got, want):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance * float(b.abs().max()))

    def normalized(kernel, t):
        return kernel.normalize(t, kernel.tau, for_fused=for_fused)

    def logits(kernel, q, kk):
        queries, keys = kernel.scaled_queries_and_keys(q, kk, for_fused=for_fused)
        return queries @ keys.transpose(-2, -1)

    kernel = ScaledCosineKernel(2, tau=7.0, eps=eps).to(dtype)
    want = outputs_and_gradients(ScaledCosineKernel(2, tau=7.0, eps=eps).double(), lambda m, t: m.tau * unit(t),
                                 lambda m, q, kk: m.tau * unit(q) @ unit(kk).transpose(-2, -1))
    close(outputs_and_gradients(kernel, normalized, logits), want)
    planted = [
        (lambda m, t: m.tau * F.rms_norm(t, (width,), eps=eps) / width ** 0.5, logits),  # ε not divided by d
        (lambda m, t: m.tau * F.rms_norm(t, (width,), eps=eps / width), logits),  # the √d left on
        (normalized, lambda m, q, kk: m.unit(q, m.tau / width ** 0.5) @ m.unit(kk).transpose(-2, -1)),  # τ/√d
    ]
    for normalize, logit in planted:
        with pytest.raises(AssertionError):
            close(outputs_and_gradients(kernel, normalize, logit), want)


@pytest.mark.parametrize("fused_norm", [True, False])
def test_the_cosine_attention_comes_out_token_major_from_the_fused_kernel(fused_norm, monkeypatch):
    """q, k and v as KernelAttention makes them (views of the qkv projection): with the fused RMSNorm (CUDA's path)
    the normalised q, k and v are token-major, as spelled out (its products take the views' layout), so the fused
    kernel's output is token-major too and merges into the projection's input as a view; the values and gradients
    equal the explicit path's (float64)."""
    from stability.nn import cosine_attention

    monkeypatch.setattr(cosine_attention, "fused_norm_on", lambda device: fused_norm)
    received = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, _sdpa=F.scaled_dot_product_attention,
                        **kwargs: received.append((q, k, v)) or _sdpa(q, k, v, **kwargs))
    kernel = ScaledCosineKernel(3, tau=4.0, nu=0.5).double()
    gen = torch.Generator().manual_seed(0)
    projected = torch.randn(2, 9, 3 * 3 * 8, generator=gen, dtype=torch.float64)
    upstream = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
    results = []
    for path in (True, False):
        qkv = projected.clone().requires_grad_(True)
        q, k, v = qkv.reshape(2, 9, 3, 3, 8).permute(2, 0, 3, 1, 4)
        out = kernel(q, k, v, None, nn.Dropout(0.0), path)
        results.append((out, *torch.autograd.grad(out, [qkv, kernel.tau, kernel.nu], upstream)))
    assert all(t.transpose(1, 2).is_contiguous() for t in received[0])  # SDPA's q, k and v, token-major
    assert results[0][0].transpose(1, 2).is_contiguous()
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.detach().abs().max()))


def test_kernel_fused_and_explicit_paths_agree_and_eps_must_be_positive():
    kernel = ScaledCosineKernel(2, tau=4.0, nu=0.5, eps=1e-3)
    q, k, v = (torch.randn(3, 2, 7, 4) for _ in range(3))
    bias = torch.randn(1, 2, 7, 7)
    fused, explicit = (kernel(q, k, v, bias, nn.Dropout(0.0), path) for path in (True, False))
    torch.testing.assert_close(fused, explicit)
    with pytest.raises(ValueError, match="eps > 0"):
        ScaledCosineKernel(2, eps=0.0)


def test_spectral_init_gives_unit_sigma_by_svd():
    net = nn.Sequential(nn.Linear(7, 5), nn.Conv2d(3, 4, 3), nn.Linear(5, 9))
    spectral_init_(net)
    for m in net:
        sigma = float(torch.linalg.matrix_norm(m.weight.reshape(m.weight.shape[0], -1), ord=2))
        assert sigma == pytest.approx(1.0, rel=1e-5)


def exact_conv_norm(conv, shape):
    def apply(x):
        return F.conv2d(x[None], conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)[0]
    jac = jacrev(apply)(torch.zeros(shape, dtype=conv.weight.dtype))
    return float(torch.linalg.matrix_norm(jac.reshape(-1, int(torch.tensor(shape).prod())), ord=2))


def test_conv_operator_norm_differs_from_reshaped_sigma_and_matches_the_exact_jacobian():
    conv = nn.Conv2d(4, 4, 7, padding=3, groups=4).double()
    with torch.no_grad():
        conv.weight.div_(torch.linalg.matrix_norm(conv.weight.reshape(4, -1), ord=2))
    shape = (4, 8, 8)
    exact = exact_conv_norm(conv, shape)
    assert conv_operator_norm(conv, shape, iterations=200) == pytest.approx(exact, rel=1e-4)
    assert exact > 1.05  # a depthwise kernel with reshaped σ = 1 is not a 1-Lipschitz convolution
    spectral_init_(conv, {conv: shape})
    assert exact_conv_norm(conv, shape) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize("backbone,size", [("vit", 8), ("swin", 16), ("cswin", 16)])
def test_every_component_lands_in_every_backbone(backbone, size):
    module = ImageClassifier(backbone=backbone, image_size=size, stabilizer="lipsformer")
    net = module.network.backbone
    assert not norm_sites(net) and any(isinstance(m, CenterNorm) for m in net.modules())
    assert all(isinstance(getattr(s.module, "kernel", None), ScaledCosineKernel) for s in attention_sites(net))
    sites = residual_sites(net)
    alphas = [getattr(s.block, s.attr)[0].alpha for s in sites]
    assert all(torch.allclose(a, torch.full_like(a, 1 / (len(sites) // 2))) for a in alphas)
    for m in net.modules():
        if isinstance(m, nn.Linear):
            assert float(torch.linalg.matrix_norm(m.weight, ord=2)) == pytest.approx(1.0, rel=1e-4)
    assert module(torch.rand(2, 1, size, size)).shape == (2, 10)


def test_components_switch_off_one_by_one():
    plain = ImageClassifier(backbone_options=VIT, stabilizer="lipsformer", stabilizer_options={"lipsformer": dict(
        center_norm=False, attention="dot", weighted_residual=False, spectral_init=False)})
    net = plain.network.backbone
    assert norm_sites(net) and all(isinstance(s.module, TimmAttention) for s in attention_sites(net))
    assert all(isinstance(getattr(s.block, s.attr), nn.Identity) for s in residual_sites(net))
    reference = ImageClassifier(backbone_options=VIT, stabilizer="lipsformer", stabilizer_options={"lipsformer": dict(
        learn_scales=False, normalize_v=False, head_scale=False, tau=10.0, alpha=0.2, drop_path=0.2)})
    kernel = attention_sites(reference.network.backbone)[0].module.kernel
    assert not isinstance(kernel.tau, nn.Parameter) and kernel.normalize_v is False and kernel.head_factor == 1.0
    sites = residual_sites(reference.network.backbone)
    assert float(getattr(sites[0].block, sites[0].attr)[0].alpha[0]) == pytest.approx(0.2)
    assert getattr(sites[-1].block, sites[-1].attr)[1].drop_prob == pytest.approx(0.2)


def test_bad_options():
    with pytest.raises(ValueError, match="attention must be 'cosine' or 'dot'"):
        LipsFormer(attention="linear")
    with pytest.raises(ValueError, match="eps must be > 0"):
        LipsFormer(eps=0)


def test_reference_cswin_branch_scale_divides_each_branch_by_the_root_of_its_heads():
    """The reference CSwin divides each stripe branch's output (attention + LePE) by √(heads in the
    branch): with W_O's bias at zero the attention module's output is the unscaled one over √heads."""
    torch.manual_seed(0)
    options = {"attention": "dot", "spectral_init": False, "weighted_residual": False, "center_norm": False}
    plain = ImageClassifier(backbone="cswin", image_size=16, stabilizer="lipsformer",
                            stabilizer_options={"lipsformer": options})
    scaled = ImageClassifier(backbone="cswin", image_size=16, stabilizer="lipsformer",
                             stabilizer_options={"lipsformer": {**options, "branch_scale": True}})
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 8, 8, 32)
    for a, b in zip(attention_sites(plain.network), attention_sites(scaled.network)):
        if x.shape[-1] != a.module.qkv.in_features:
            continue
        a.module.proj.bias.data.zero_()
        b.module.proj.bias.data.zero_()
        heads = a.num_heads // len(a.module.stripes)
        torch.testing.assert_close(b.module(x), a.module(x) / heads ** 0.5)
        assert b.module.branch_divisor == pytest.approx(heads ** 0.5)
        break
    else:
        raise AssertionError("no attention module at the first stage's width")


def test_spectral_init_can_leave_conv_biases_at_their_default_initialisation():
    torch.manual_seed(0)
    reference = ImageClassifier(backbone="cswin", image_size=16, stabilizer="lipsformer",
                                stabilizer_options={"lipsformer": {"conv_bias_init": "default"}})
    zeroed = ImageClassifier(backbone="cswin", image_size=16, stabilizer="lipsformer")
    convs = [m for m in reference.network.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(float(m.bias.abs().max()) > 0 for m in convs)
    assert all(float(m.bias.abs().max()) == 0 for m in zeroed.network.modules() if isinstance(m, nn.Conv2d))
    with pytest.raises(ValueError, match="conv_bias_init must be"):
        ImageClassifier(stabilizer="lipsformer", stabilizer_options={"lipsformer": {"conv_bias_init": "ones"}})


def lipsformer_network(backbone: str, size: int, dtype: torch.dtype, folded: bool, monkeypatch,
                       stabilizer: str = "lipsformer", options: dict | None = None) -> ImageClassifier:
    """A LipsFormer network (seed 0) with per-channel α, biases and cosine scales drawn at random (seed 1), its residual
    scales folded into the Linear layers that write their branches, or kept apart (``after_prepare`` skipped)."""
    with monkeypatch.context() as patch:
        if not folded:
            patch.setattr(LipsFormer, "after_prepare", lambda self, network: None)
        torch.manual_seed(0)
        module = ImageClassifier(backbone=backbone, image_size=size, stabilizer=stabilizer,
                                 stabilizer_options=options).to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.network.named_parameters():
            if name.endswith(("alpha", "bias")):
                parameter.copy_(torch.rand(parameter.shape, generator=gen, dtype=torch.float64) * 1.5 - 0.25)
    return module


def outputs_and_gradients(module: ImageClassifier, size: int) -> dict[str, torch.Tensor]:
    dtype = next(module.parameters()).dtype
    images = torch.rand(3, 1, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    torch.manual_seed(3)  # the same stochastic depth (Swin's, CSwin's DropPath) for both
    logits = module(images)
    (logits.square().sum() + F.cross_entropy(logits, torch.tensor([0, 1, 2]))).backward()
    return {"logits": logits.detach(), **{name: p.grad for name, p in module.named_parameters() if p.grad is not None}}


def outputs_scaled_after_the_product(monkeypatch) -> list:
    """A list that gets an entry each time a folded Linear layer applies α ⊙ y after its product (its small path)."""
    calls, channel_scale = [], folded_scale.channel_scale
    monkeypatch.setattr(folded_scale, "channel_scale", lambda *args: calls.append(1) or channel_scale(*args))
    return calls


@pytest.mark.parametrize("backbone,size", [("vit", 8), ("swin", 16), ("cswin", 16)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("into_weights", [True, False])
def test_residual_scales_folded_into_the_linear_layers_give_the_same_outputs_and_gradients(backbone, size, dtype,
                                                                                           tolerance, into_weights,
                                                                                           monkeypatch):
    """α ⊙ (W h + b) computed by the Linear layer that writes each branch (the attention's proj, the MLP's fc2), as
    (diag(α) W) h + α ⊙ b (a large output) or as α ⊙ y after its product (a small one): the logits and every
    parameter's gradient (W, b and α among them) as with α ⊙ y applied by α's own module, relative to each tensor's
    largest entry; every scale folded, the state dict unchanged.
    In float32 the cosine attention's τ and ν, scalars whose gradients sum every logit's, are held to 1e-3: the
    reference's own float32 gradient of τ is 1.2e-4 off float64's (measured), the two paths 3e-5 to 2e-4 apart
    with the order of the sums (the threads); a fold that drops α or its bias scaling errs by more than 1e-1."""
    folded = lipsformer_network(backbone, size, dtype, True, monkeypatch)
    apart = lipsformer_network(backbone, size, dtype, False, monkeypatch)
    monkeypatch.setattr(folded_scale, "WRITTEN_OUT_FROM_BYTES", 0 if into_weights else 2 ** 62)
    scaled_outputs = outputs_scaled_after_the_product(monkeypatch)
    sites = residual_sites(folded.network.backbone)
    for site in sites:
        scale = getattr(site.block, site.attr)[0]
        linear = site.block.attn.proj if site.kind == "attention" else site.block.mlp.fc2
        assert scale.folded and isinstance(linear, ScaledOutputLinear) and linear.output_scale is scale
    assert not any(getattr(s.block, s.attr)[0].folded for s in residual_sites(apart.network.backbone))
    assert list(folded.state_dict()) == list(apart.state_dict())
    got, expected = outputs_and_gradients(folded, size), outputs_and_gradients(apart, size)
    assert len(scaled_outputs) == (0 if into_weights else len(sites))
    assert got.keys() == expected.keys() and any(name.endswith("alpha") for name in got)
    for name in expected:
        error = (got[name] - expected[name]).abs().max() / expected[name].abs().max()
        scalar = dtype == torch.float32 and name.endswith(("kernel.tau", "kernel.nu"))
        assert error <= (1e-3 if scalar else tolerance), (name, float(error))


def test_alpha_stays_apart_where_it_cannot_be_folded(monkeypatch):
    """Where another stabilizer parametrises the Linear layers (spectral_norm's parametrisation), α stays a module of
    its own and no Linear layer folds it; a block whose residuals another module computes, bypassing α's slot (a convex
    residual), keeps α apart too (its Linear layers unchanged), while the other blocks fold theirs."""
    options = {"spectral_norm": {"mode": "parametrize"}}
    parametrized = lipsformer_network("vit", 8, torch.float64, True, monkeypatch, "lipsformer,spectral_norm", options)
    sites = residual_sites(parametrized.network.backbone)
    assert sites and not any(getattr(s.block, s.attr)[0].folded for s in sites)
    assert not any(isinstance(m, ScaledOutputLinear) for m in parametrized.modules())

    module = lipsformer_network("vit", 8, torch.float64, False, monkeypatch)
    backbone = module.network.backbone
    replace_submodule(backbone, "blocks.0", ConvexResidualBlock(backbone.blocks[0], 0.5))
    module.stabilizers[0].after_prepare(module.network)
    folded = [getattr(site.block, site.attr)[0].folded for site in residual_sites(backbone)]
    assert folded[:2] == [False, False] and all(folded[2:]) and len(folded) > 2
    assert type(backbone.blocks[0].block.attn.proj) is nn.Linear and type(backbone.blocks[0].block.mlp.fc2) is nn.Linear
    module.stabilizers[0].after_prepare(module.network)  # again: nothing folds twice
    assert type(backbone.blocks[1].attn.proj) is ScaledOutputLinear


def test_a_folded_network_copies_pickles_and_takes_swapped_parameters(monkeypatch):
    """A deep copy's and an unpickled copy's Linear layers read their own copy's α, not the original's; a
    ``torch.func.functional_call`` that swaps α (a local Lipschitz estimate's, say) is read by the Linear layers as by
    α's own module."""
    monkeypatch.setattr(folded_scale, "WRITTEN_OUT_FROM_BYTES", 0)  # α into the weights at this size
    module = lipsformer_network("vit", 8, torch.float64, True, monkeypatch)
    apart = lipsformer_network("vit", 8, torch.float64, False, monkeypatch)
    images = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(module.network, buffer)
    buffer.seek(0)
    for copy in (copy_module.deepcopy(module.network), torch.load(buffer, weights_only=False)):
        proj = copy.backbone.blocks[0].attn.proj
        assert proj.output_scale is copy.backbone.blocks[0].drop_path1[0]
        with torch.no_grad():
            copy.backbone.blocks[0].drop_path1[0].alpha.mul_(3.0)
        expected = {name: (p * 3.0 if name == "backbone.blocks.0.drop_path1.0.alpha" else p)
                    for name, p in apart.network.named_parameters()}
        torch.testing.assert_close(copy(images), torch.func.functional_call(apart.network, expected, (images,)))
    torch.testing.assert_close(module.network(images), apart.network(images), rtol=1e-12, atol=0)
    swapped = {name: p.detach() * 2.0 if name.endswith("alpha") else p.detach()
               for name, p in module.network.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(module.network, swapped, (images,)),
                               torch.func.functional_call(apart.network, swapped, (images,)), rtol=1e-12, atol=0)
    assert not torch.allclose(torch.func.functional_call(module.network, swapped, (images,)), module.network(images))


def test_fold_output_scale_refuses_what_it_cannot_fold():
    scale = ResidualScale(4, 0.5)
    with pytest.raises(ValueError, match="plain nn.Linear"):
        fold_output_scale(ScaledOutputLinear(3, 4), scale)
    with pytest.raises(ValueError, match="does not scale the 5 outputs"):
        fold_output_scale(nn.Linear(3, 5), scale)


def test_only_a_branch_that_a_known_linear_layer_ends_is_folded():
    """timm's post-norm block normalises the branch after its last Linear layer: α ⊙ norm(W h) is not
    norm((diag(α) W) h), so its sites name no Linear layer to fold into; its pre-norm block names proj and fc2."""
    from timm.models.vision_transformer import ResPostBlock, VisionTransformer

    post = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2, block_fn=ResPostBlock)
    sites = residual_sites(post)
    assert len(sites) == 2 and all(site.output_linear() is None for site in sites)
    pre = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2)
    assert [site.output_linear() for site in residual_sites(pre)] == [pre.blocks[0].attn.proj, pre.blocks[0].mlp.fc2]


def test_alpha_goes_into_the_weights_where_the_output_is_large():
    """ViT-S's branch output at 256 tokens and batch 256 (48 MiB in bf16, and ViT-S's MLP's too) takes α into the
    weight; the micro ViT's at batch 128 (1.6 MiB) keeps α ⊙ y after the product (five launches fewer a branch, where
    launches set the time); a small step standing for the large one (``sized_as``) decides as it; a compiled graph
    folds at every size, float16 apart (one path at every batch size)."""
    x = torch.empty(256, 257, 384, dtype=torch.bfloat16, device="meta")
    assert folds_at(x, 384) and folds_at(torch.empty(256, 257, 1536, dtype=torch.bfloat16, device="meta"), 384)
    small = torch.empty(128, 65, 64, dtype=torch.bfloat16, device="meta")
    assert not folds_at(small, 64)
    with center_norm.sized_as(256 * 257 * 384 / (128 * 65 * 64)):
        assert folds_at(small, 64)
    assert not folds_at(x[:, :100], 384)  # 19 MiB: below the 32 MiB that the written-out scale takes too
    assert not folds_at(torch.empty(256, 100, 1536, dtype=torch.bfloat16, device="meta"), 384)  # its output's size
    assert torch.compile(lambda t: torch.tensor(folds_at(t, 4)), backend="eager", fullgraph=True)(torch.ones(2, 4))
    # under autocast the output is the product's dtype: 24 MiB in bf16 from float32 inputs (48 MiB in float32)
    def float32(*shape):  # CPU float32 inputs of that shape, holding one element (autocast is not asked on meta)
        return torch.empty(()).expand(*shape)

    assert folds_at(float32(256, 128, 384), 384)
    with torch.autocast("cpu", torch.bfloat16):
        assert not folds_at(float32(256, 128, 384), 384) and folds_at(float32(256, 257, 384), 384)
    # float16: α stays after the product (diag(α)W in fp16 would reach its subnormals), compiled or not
    assert not folds_at(torch.empty(256, 257, 384, dtype=torch.float16, device="meta"), 384)
    with torch.autocast("cpu", torch.float16):
        assert not folds_at(float32(256, 257, 384), 384)
        assert not torch.compile(lambda t: torch.tensor(folds_at(t, 4)), backend="eager", fullgraph=True)(
            torch.ones(2, 4))


@pytest.mark.parametrize("backbone,size", [("vit", 8), ("swin", 16), ("cswin", 16)])
def test_folded_scales_under_bf16_autocast_keep_the_logits_to_bf16s_rounding(backbone, size, monkeypatch):
    """Under the CPU's bf16 autocast, α folded into the weights rounds diag(α)W and the product's output where α ⊙ y
    rounds W and y: both paths' logits within 2e-2 of the float64 network's (relative to its largest; each about
    5e-3 off, measured: bf16's 2⁻⁸ over the layers), where a dropped α or bias scaling errs by more than 1e-1."""
    monkeypatch.setattr(folded_scale, "WRITTEN_OUT_FROM_BYTES", 0)  # α into the weights at this size
    scaled_outputs = outputs_scaled_after_the_product(monkeypatch)
    images = torch.rand(3, 1, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    network = lipsformer_network(backbone, size, torch.float64, False, monkeypatch)
    torch.manual_seed(3)  # the same stochastic depth (Swin's, CSwin's DropPath) in every forward
    exact = network(images)
    for folded in (True, False):
        module = lipsformer_network(backbone, size, torch.float32, folded, monkeypatch)
        torch.manual_seed(3)
        with torch.autocast("cpu", torch.bfloat16):
            logits = module(images.float())
        assert logits.dtype == torch.bfloat16 and not scaled_outputs  # the folded layers took α into their weights
        assert (logits.double() - exact).abs().max() <= 2e-2 * exact.abs().max(), folded
