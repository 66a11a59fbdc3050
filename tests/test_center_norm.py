"""CenterNorm's fast paths (stability/nn/center_norm.py) against autograd through its formula, in float64 to 1e-10 and
float32 to 1e-5, on their own and in LipsFormer on every backbone: LayerNorm's kernels with ε = s² and γ·s (float32
and float64; rows of spread up to 10⁸, and past its exact range within CenterNorm's bound), the written-out
backward (half precision; both ways of taking the parameters' gradients: LayerNorm's fused kernel, a product and sums
where a graph of the backward is kept); twice differentiated, under torch.func and under CUDA's autocast; planted
errors fail; each moves fewer bytes than autograd through the formula."""
import copy

import pytest
import torch
from torch.func import grad, jacrev, vmap

import stability.nn.center_norm as center_norm_module
from stability.classifier import ImageClassifier
from stability.nn.center_norm import CenterNorm, _CenterNorm, center_norm
from stability.testing.cuda_autocast import cuda_autocast
from stability.testing.gpu_model import count

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def formula(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The slow path: β + w ⊙ (x − mean(x)), differentiated by autograd."""
    return bias + weight * (x - x.mean(dim=-1, keepdim=True))


def inputs(dtype: torch.dtype, shape=(3, 5, 12), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1]
    x = 3 + torch.randn(shape, generator=gen, dtype=dtype)  # a mean away from 0: a dropped centring shows
    weight, bias = torch.randn(width, generator=gen, dtype=dtype), torch.randn(width, generator=gen, dtype=dtype)
    upstream = torch.randn(shape, generator=gen, dtype=dtype)
    return x, weight, bias, upstream


def outputs_and_gradients(function, x, weight, bias, upstream, create_graph=False):
    x, weight, bias = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    out = function(x, weight, bias)
    return [out, *torch.autograd.grad(out, (x, weight, bias), upstream, create_graph=create_graph)]


def assert_all_close(got, want, tolerance):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * float(b.detach().abs().max()))


@pytest.mark.parametrize("create_graph", [False, True], ids=["fused-parameter-gradients", "graph-kept"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_written_out_backward_equals_autograd_through_the_formula(dtype, create_graph):
    args = inputs(dtype)
    assert_all_close(outputs_and_gradients(center_norm, *args, create_graph=create_graph),
                     outputs_and_gradients(formula, *args), TOLERANCE[dtype])


def test_a_strided_upstream_gradient_and_one_row():
    x, weight, bias, _ = inputs(torch.float64, shape=(4, 6, 10))
    strided = torch.randn(6, 4, 10, dtype=torch.float64).transpose(0, 1)  # (4, 6, 10), not contiguous
    assert_all_close(outputs_and_gradients(center_norm, x, weight, bias, strided),
                     outputs_and_gradients(formula, x, weight, bias, strided), 1e-10)
    one_row = inputs(torch.float64, shape=(7,))
    assert_all_close(outputs_and_gradients(center_norm, *one_row), outputs_and_gradients(formula, *one_row), 1e-10)


def _dropped_row_mean(ctx, grad, grad_centred):
    weight, centred = ctx.saved_tensors
    return grad * weight, (grad * centred).reshape(-1, grad.shape[-1]).sum(0), grad.reshape(-1, grad.shape[-1]).sum(0)


def _row_mean_added(ctx, grad, grad_centred):
    weight, centred = ctx.saved_tensors
    grad_x = grad * weight + (grad @ weight).unsqueeze(-1) / grad.shape[-1]
    return grad_x, (grad * centred).reshape(-1, grad.shape[-1]).sum(0), grad.reshape(-1, grad.shape[-1]).sum(0)


def _uncentred_weight_gradient(ctx, grad, grad_centred):
    weight, centred = ctx.saved_tensors
    grad_x = grad * weight - (grad @ weight).unsqueeze(-1) / grad.shape[-1]
    return grad_x, grad.reshape(-1, grad.shape[-1]).sum(0), grad.reshape(-1, grad.shape[-1]).sum(0)


@pytest.mark.parametrize("planted", [_dropped_row_mean, _row_mean_added, _uncentred_weight_gradient])
def test_a_planted_error_in_the_backward_fails(planted, monkeypatch):
    args = inputs(torch.float64)
    want = outputs_and_gradients(formula, *args)
    assert_all_close(outputs_and_gradients(center_norm, *args), want, 1e-10)
    monkeypatch.setattr(_CenterNorm, "backward", staticmethod(planted))
    with pytest.raises(AssertionError):
        assert_all_close(outputs_and_gradients(center_norm, *args), want, 1e-10)


def test_wrong_statistics_in_the_fused_parameter_gradients_fail(monkeypatch):
    """LayerNorm's kernel with an rstd of 2 where it must be 1: the weight's gradient doubles."""
    args = inputs(torch.float64)
    real = torch.ops.aten.native_layer_norm_backward.default

    def doubled(grad, x, shape, mean, rstd, *rest):
        return real(grad, x, shape, mean, 2 * rstd, *rest)

    monkeypatch.setattr(torch.ops.aten.native_layer_norm_backward, "default", doubled)
    with pytest.raises(AssertionError):
        assert_all_close(outputs_and_gradients(center_norm, *args), outputs_and_gradients(formula, *args), 1e-10)


@pytest.mark.parametrize("path", ["written-out", "layer-norm"])
def test_twice_differentiable_and_under_torch_func(path):
    """gradcheck and gradgradcheck (for LayerNorm's kernels: its double backward, the variance's terms zero to
    rounding), jacrev in x, γ and β, and vmap of a gradient, against the formula in float64."""
    function, spread = (center_norm, 1.0) if path == "written-out" else (by_layer_norm, 10.0)
    x, weight, bias, _ = spread_inputs(torch.float64, spread, shape=(2, 3, 5))
    leaves = tuple(t.clone().requires_grad_(True) for t in (x, weight, bias))
    assert torch.autograd.gradcheck(function, leaves)
    assert torch.autograd.gradgradcheck(function, leaves)
    for argnums in (0, 1, 2):
        torch.testing.assert_close(jacrev(function, argnums=argnums)(x, weight, bias),
                                   jacrev(formula, argnums=argnums)(x, weight, bias), rtol=1e-10, atol=1e-12)

    def loss(f):
        return lambda w, rows: (f(rows, w, bias) ** 2).sum()

    torch.testing.assert_close(vmap(grad(loss(function)), in_dims=(None, 0))(weight, x),
                               vmap(grad(loss(formula)), in_dims=(None, 0))(weight, x), rtol=1e-10, atol=1e-12)


def test_a_backward_run_under_cuda_autocast_keeps_float32(monkeypatch):
    """Backward called inside CUDA's bf16 autocast (emulated on the CPU), which runs ``mv`` in bf16: the row sums stay
    float32 (to 1e-5); without autocast switched off around them (planted) the gradient is off by bf16's rounding."""
    args = inputs(torch.float32, shape=(4, 9, 64))
    want = outputs_and_gradients(formula, *args)

    def under_autocast():
        with cuda_autocast(), torch.autocast("cpu", torch.bfloat16):
            return outputs_and_gradients(center_norm, *args)

    assert_all_close(under_autocast(), want, 1e-5)
    monkeypatch.setattr(center_norm_module, "autocast_off", lambda device_type: torch.autocast("cpu", enabled=True))
    with pytest.raises(AssertionError):
        assert_all_close(under_autocast(), want, 1e-5)


@pytest.mark.parametrize("trained", [(True, False), (False, True), (False, False)], ids=["bias-frozen",
                                                                                    "weight-frozen", "both-frozen"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_frozen_parameters_get_no_gradient_and_the_others_theirs(trained, create_graph):
    x, weight, bias, upstream = inputs(torch.float64)

    def gradients(function):
        leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(trained[0]),
                  bias.clone().requires_grad_(trained[1])]
        wanted = [t for t in leaves if t.requires_grad]
        return torch.autograd.grad(function(*leaves), wanted, upstream, create_graph=create_graph)

    assert_all_close(gradients(center_norm), gradients(formula), 1e-10)


def fused_calls(monkeypatch) -> list:
    """Records each call of LayerNorm's backward kernel."""
    calls, real = [], torch.ops.aten.native_layer_norm_backward.default
    monkeypatch.setattr(torch.ops.aten.native_layer_norm_backward, "default",
                        lambda *args: calls.append(args[1].dtype) or real(*args))
    return calls


def test_half_precision_takes_the_product_and_sums_not_layernorms_kernel(monkeypatch):
    """bf16 and fp16 never reach LayerNorm's kernel (CUDA's reads their mean and rstd as float32, the CPU's in their
    own dtype: no one call serves both); float32 does. An all-bf16 CenterNorm (``bf16-true``) and a bf16 input with
    float32 parameters (Swin's and CSwin's patch-embedding norms under autocast) equal the formula to bf16's rounding,
    checked against float64."""
    calls = fused_calls(monkeypatch)
    x, weight, bias, upstream = inputs(torch.float32, shape=(4, 9, 64))
    outputs_and_gradients(center_norm, x, weight, bias, upstream)
    assert calls == [torch.float32]
    calls.clear()
    rounded = x.bfloat16()
    for parameters in ((weight.bfloat16(), bias.bfloat16()), (weight, bias)):
        got = outputs_and_gradients(center_norm, rounded, *parameters, upstream)
        want = outputs_and_gradients(formula, rounded.double(), *(p.double() for p in parameters), upstream.double())
        assert got[1].dtype == torch.bfloat16  # the input's gradient in the input's dtype
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()))
    assert calls == []


def test_it_runs_on_meta_tensors():
    """Forward and backward on ``meta`` (the tensors that count a step without computing it), which has no autocast."""
    norm = CenterNorm(16).to("meta")
    assert center_norm_module.written_out(torch.empty(2**22, device="meta"))
    x = torch.empty(2, 5, 16, device="meta", requires_grad=True)
    with center_norm_module.sized_as(2**30):
        norm(x).sum().backward()
    assert x.grad.shape == x.shape and norm.weight.grad.shape == (16,)


@pytest.mark.parametrize("path", ["layer-norm", "written-out"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backbone, size", [("vit", 8), ("swin", 16), ("cswin", 16)])
def test_lipsformer_trains_with_the_gradients_of_the_formula(backbone, size, dtype, path, monkeypatch):
    """A LipsFormer step's loss and every parameter's gradient, with each fast path (LayerNorm's kernels; the
    written-out backward) and with autograd through the formula (both fast paths off), on each backbone."""
    def loss_and_gradients():
        torch.manual_seed(0)
        module = ImageClassifier(backbone=backbone, image_size=size, stabilizer="lipsformer").to(dtype).train()
        images = torch.rand(3, 1, size, size, dtype=dtype, generator=torch.Generator().manual_seed(1))
        _, terms = module.losses(images, torch.tensor([0, 1, 2]))
        loss = sum(terms.values())
        loss.backward()
        return [loss.detach(), *(p.grad for p in module.parameters() if p.grad is not None)]

    assert any(isinstance(m, CenterNorm) for m in
               ImageClassifier(backbone=backbone, image_size=size, stabilizer="lipsformer").modules())
    calls = []
    if path == "layer-norm":
        fast_path = center_norm_module.centred_by_layer_norm
        monkeypatch.setattr(center_norm_module, "centred_by_layer_norm",
                            lambda *args: calls.append(1) or fast_path(*args))
    else:
        monkeypatch.setattr(center_norm_module, "takes_layer_norm", lambda *args: False)
        monkeypatch.setattr(center_norm_module, "WRITTEN_OUT_FROM_BYTES", 0)  # every norm takes it, however small
        fast_path = center_norm_module.center_norm
        monkeypatch.setattr(center_norm_module, "center_norm", lambda *args: calls.append(1) or fast_path(*args))
    fast = loss_and_gradients()
    assert calls  # the fast path ran
    monkeypatch.setattr(center_norm_module, "takes_layer_norm", lambda *args: False)
    monkeypatch.setattr(center_norm_module, "center_norm", formula)
    assert_all_close(fast, loss_and_gradients(), TOLERANCE[dtype])


def test_which_path_a_norm_takes(monkeypatch):
    """float32 and float64 (x, γ and β of one dtype) take LayerNorm's kernels at every size; other inputs (bf16 or fp16,
    or a bf16 x with float32 parameters) the written-out backward from 16 MiB of input (ViT-S at 256 tokens holds 101 MB
    a norm at batch 256, 1.2 MB at batch 3), judged as ``sized_as`` says (a step counted at batch 4 for batch 256),
    below that autograd through the formula; a compiled graph the formula always."""
    def path(x, parameters=None):
        norm = CenterNorm(x.shape[-1]).to(parameters or x.dtype)
        return type(norm(x.requires_grad_(True)).grad_fn).__name__

    for dtype in (torch.float32, torch.float64):
        assert path(torch.randn(3, 5, 8, dtype=dtype)) == "NativeLayerNormBackward0"
    assert path(torch.randn(3, 5, 8), torch.float64) == "AddcmulBackward0"
    small = torch.randn(3, 257, 384, dtype=torch.bfloat16)
    large = torch.randn(2**24 // (2 * 256), 256, dtype=torch.bfloat16)  # 16 MiB exactly
    assert (path(small), path(large)) == ("AddcmulBackward0", "_CenterNormBackward")
    assert path(large, torch.float32) == "_CenterNormBackward"  # Swin's patch-embedding norm under autocast
    with center_norm_module.sized_as(256 / 3):
        assert path(small) == "_CenterNormBackward"
        with center_norm_module.sized_as(1.0):  # a nested scale replaces the outer one
            assert path(small) == "AddcmulBackward0"
        assert path(small) == "_CenterNormBackward"
    assert path(small) == "AddcmulBackward0"
    with pytest.raises(RuntimeError), center_norm_module.sized_as(1e9):
        raise RuntimeError("a failure inside the block")
    assert path(small) == "AddcmulBackward0"  # set back all the same
    with pytest.raises(ValueError, match="positive scale"), center_norm_module.sized_as(0.0):
        pass
    assert path(large[:-1]) == "AddcmulBackward0"  # one row under
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert path(large) == "AddcmulBackward0"
    assert path(torch.randn(3, 5, 8)) == "AddcmulBackward0"


def by_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:func:`~stability.nn.center_norm.centred_by_layer_norm` with the weight as the formula's w (factor 1)."""
    return center_norm_module.centred_by_layer_norm(x, weight, bias, 1.0)


def spread_inputs(dtype: torch.dtype, spread: float, shape=(4, 6, 12)):
    """:func:`inputs` whose rows have a standard deviation of about ``spread`` around a mean of about 3·spread."""
    x, weight, bias, upstream = inputs(dtype, shape)
    return 3 * spread + spread * (x - 3), weight, bias, upstream


# the rows' spreads the LayerNorm path is tested at: float32 up to a standard deviation of 10⁸ (var ≈ 2^53), float64
# up to 10²⁰ (var ≈ 2^133): both within the ranges where its 1/σ is 1/s exactly (var < 2^56 and < 2^147)
SPREADS = {torch.float32: (1.0, 1e4, 1e8), torch.float64: (1.0, 1e6, 1e20)}


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layer_norms_kernels_compute_the_formula(dtype, create_graph):
    """LayerNorm with ε = s² and γ·s: the output and the gradients in x, γ and β equal autograd through the formula,
    in float64 to 1e-10 and float32 to 1e-5 of each tensor's largest entry, on rows of spread 1 to 10⁸ (10²⁰ in
    float64); with a graph of the backward kept, the second derivatives of ⟨∂x, v⟩ in x, γ and β too."""
    for spread in SPREADS[dtype]:
        args = spread_inputs(dtype, spread)
        assert_all_close(outputs_and_gradients(by_layer_norm, *args, create_graph=create_graph),
                         outputs_and_gradients(formula, *args), TOLERANCE[dtype])
        if create_graph:  # ∂²/∂x² is zero for CenterNorm: held to the tolerance of the largest second derivative
            want = second_derivatives(formula, *args)
            largest = max(float(t.abs().max()) for t in want)
            for got, wanted in zip(second_derivatives(by_layer_norm, *args), want, strict=True):
                torch.testing.assert_close(got, wanted, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * largest)


def second_derivatives(function, x, weight, bias, upstream):
    """The gradients in x, γ and β of ⟨∂x, v⟩ (∂x the input's gradient for ``upstream``, v fixed): what the local
    Lipschitz estimate's power iteration differentiates."""
    x, weight, bias = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    (grad_x,) = torch.autograd.grad(function(x, weight, bias), x, upstream, create_graph=True)
    v = torch.randn(grad_x.shape, generator=torch.Generator().manual_seed(7), dtype=grad_x.dtype)
    return torch.autograd.grad((grad_x * v).sum(), (x, weight, bias), allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("gradient_scale", [1e-20, 1e18])
def test_layer_norms_kernels_keep_float32_gradients_far_from_one(gradient_scale):
    """float32 upstream gradients of 10⁻²⁰ and 10¹⁸ (inside the range the scale s = 2^40 leaves them: γ's gradient
    loses precision to subnormals below |g·(x − mean)| ≈ 10⁻²⁶): the gradients equal the formula's to 1e-5."""
    x, weight, bias, upstream = inputs(torch.float32)
    assert_all_close(outputs_and_gradients(by_layer_norm, x, weight, bias, upstream * gradient_scale),
                     outputs_and_gradients(formula, x, weight, bias, upstream * gradient_scale), 1e-5)


def test_its_one_over_sigma_is_one_over_s_exactly_where_the_docstring_says():
    """The kernel's own 1/σ (``native_layer_norm``'s third output) is 1/s exactly on rows of variance up to 2^55 in
    float32 and 2^146 in float64 (the claimed range: below 2^56 and 2^147), and not on float32 rows of variance 2^62."""
    def one_over_sigma(dtype, spread):
        x = spread * torch.randn(8, 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        x = (x / x.std(-1, unbiased=False, keepdim=True) * spread).to(dtype)  # each row's variance spread²
        scale = center_norm_module.LAYER_NORM_SCALE[dtype]
        return torch.native_layer_norm(x, (64,), None, None, scale * scale)[2], 1 / scale

    for dtype, spread in ((torch.float32, 1.0), (torch.float32, 2.0 ** 27.5), (torch.float64, 1.0),
                          (torch.float64, 2.0 ** 73)):
        got, want = one_over_sigma(dtype, spread)
        assert bool((got == want).all()), (dtype, spread)
    got, want = one_over_sigma(torch.float32, 2.0 ** 31)
    assert not bool((got == want).all())


@pytest.mark.parametrize("planted", ["plain-layer-norm", "smaller-epsilon", "no-weight-scale", "no-factor"])
def test_a_planted_error_in_the_layer_norm_path_fails(planted, monkeypatch):
    """LayerNorm's own ε (a LayerNorm), ε = 2^40 with γ·2^20 (its 1/σ no longer exact on float32 rows of spread 10⁴:
    off by var/2^41 ≈ 2^-14), γ not scaled by s, and D/(D−1) dropped: each fails."""
    def check():
        norm = CenterNorm(12)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(12, generator=torch.Generator().manual_seed(3)))
        for spread in SPREADS[torch.float32]:
            x = spread_inputs(torch.float32, spread)[0]
            want = formula(x, norm.weight * (12 / 11), norm.bias).detach()
            torch.testing.assert_close(norm(x).detach(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))

    check()
    real = torch.nn.functional.layer_norm
    scale = center_norm_module.LAYER_NORM_SCALE[torch.float32]

    def layer_norm(x, shape, weight, bias, eps):
        if planted == "plain-layer-norm":
            return real(x, shape, weight / scale, bias)
        if planted == "smaller-epsilon":
            return real(x, shape, weight / scale * 2.0 ** 20, bias, eps=2.0 ** 40)
        if planted == "no-weight-scale":
            return real(x, shape, weight / scale, bias, eps=eps)
        return real(x, shape, weight * (11 / 12), bias, eps=eps)

    monkeypatch.setattr(center_norm_module.F, "layer_norm", layer_norm)
    with pytest.raises(AssertionError):
        check()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_beyond_its_exact_range_the_layer_norm_path_stays_within_the_bound(dtype):
    """Rows whose variance is about s² (spread s: 2^40 in float32, 2^100 in float64), far past the exact range: the
    function computed is CenterNorm times about 1/√2, no longer CenterNorm, and its Jacobian's spectral norm (jacrev,
    exact SVD) is still at most D/(D−1)·max|γ| (the docstring's proof), as at spread 1."""
    norm = CenterNorm(7).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, -2.0, 0.5, 1.5, -0.3, 2.5, 1.0], dtype=dtype))
    bound, scale = norm.lipschitz(), center_norm_module.LAYER_NORM_SCALE[dtype]
    norms = {}
    for spread in (scale, 1.0):
        x = spread * torch.randn(7, dtype=dtype, generator=torch.Generator().manual_seed(4))
        norms[spread] = float(torch.linalg.matrix_norm(jacrev(norm)(x), ord=2))
        assert norms[spread] <= bound * (1 + TOLERANCE[dtype])
    assert norms[scale] < 0.9 * norms[1.0]  # the factor (1 + var/s²)^(-1/2) at work
    far = scale * torch.randn(7, dtype=dtype, generator=torch.Generator().manual_seed(4))
    centred = formula(far, norm.weight * 7 / 6, norm.bias) - norm.bias
    assert float((norm(far) - norm.bias - centred / 2 ** 0.5).abs().max()) < 0.25 * float(centred.abs().max())


def test_the_layer_norm_path_under_autocast_and_on_meta_tensors(monkeypatch):
    """Under CUDA's bf16 autocast (emulated) and the CPU's, a float32 norm stays float32 and equals the formula to
    1e-5, LayerNorm called with autocast off (whatever a torch's autocast lists say of it); on ``meta`` tensors it runs
    forward and backward."""
    norm = CenterNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(5)))
    x, _, _, upstream = inputs(torch.float32, shape=(4, 9, 64))
    want = outputs_and_gradients(formula, x, norm.weight * (64 / 63), norm.bias, upstream)
    autocast_seen, real = [], torch.nn.functional.layer_norm
    monkeypatch.setattr(center_norm_module.F, "layer_norm",
                        lambda *args, **kwargs: autocast_seen.append(torch.is_autocast_enabled("cpu"))
                        or real(*args, **kwargs))
    for autocast in (cuda_autocast, lambda: torch.autocast("cpu", torch.bfloat16)):
        leaf = x.clone().requires_grad_(True)
        with autocast(), torch.autocast("cpu", torch.bfloat16):
            out = norm(leaf)
            gradients = torch.autograd.grad(out, (leaf, norm.weight, norm.bias), upstream)
        assert out.dtype == torch.float32 and out.grad_fn.name() == "NativeLayerNormBackward0"
        weight_gradient = gradients[1] * (63 / 64)  # the formula's w is γ·64/63
        assert_all_close([out, gradients[0], weight_gradient, gradients[2]], want, 1e-5)
    assert autocast_seen == [False, False]
    meta = CenterNorm(16).to("meta")
    leaf = torch.empty(2, 5, 16, device="meta", requires_grad=True)
    meta(leaf).sum().backward()
    assert leaf.grad.shape == leaf.shape and meta.weight.grad.shape == (16,)


def test_the_layer_norm_path_moves_fewer_bytes_than_the_written_out_backward():
    """Counted as a GPU would run it, forward and backward: LayerNorm's kernels at most 7 passes over the input, where
    the written-out backward takes 10 to 11 and autograd through the formula more than 20."""
    x, weight, bias, upstream = inputs(torch.float32, shape=(8, 32, 64))

    def counted(function):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
        return count(lambda: function(*leaves).backward(upstream))

    layer_norm, written = counted(by_layer_norm), counted(center_norm)
    assert layer_norm.bytes <= 7 * x.nbytes < 10 * x.nbytes <= written.bytes
    assert layer_norm.launches < written.launches


def test_it_moves_about_half_the_bytes_of_autograd_through_the_formula():
    """Counted as a GPU would run it (stability/testing/gpu_model.py), forward and backward: at most 11 passes over
    the input (10 and the parameters' small vectors), where autograd through the formula takes more than 20."""
    x, weight, bias, upstream = inputs(torch.float32, shape=(8, 32, 64))

    def counted(function):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
        return count(lambda: function(*leaves).backward(upstream))

    fast, slow = counted(center_norm), counted(formula)
    assert fast.bytes <= 11 * x.nbytes and slow.bytes >= 20 * x.nbytes
    assert fast.launches <= slow.launches


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_on_a_gpu_the_written_out_backward_equals_the_formula(dtype):
    """CUDA's kernels (its LayerNorm backward for the parameters' gradients, cuBLAS's matrix-vector product), with the
    backward run plainly and inside bf16 autocast, against the formula on the CPU; float64 stays float64."""
    args = [t.cuda() for t in inputs(dtype, shape=(64, 197, 384))]
    want = [t.cuda() for t in outputs_and_gradients(formula, *(t.cpu() for t in args))]
    got = outputs_and_gradients(center_norm, *args)
    assert all(t.dtype == dtype for t in got)
    assert_all_close(got, want, TOLERANCE[dtype])
    with torch.autocast("cuda", torch.bfloat16):
        assert_all_close(outputs_and_gradients(center_norm, *args), want, TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_on_a_gpu_layer_norms_kernels_compute_the_formula(dtype):
    """CUDA's LayerNorm kernels with ε = s² and γ·s, in a CenterNorm module, plainly and under bf16 autocast, against
    the formula on the CPU, on rows of spread 1 to 10⁸ (10²⁰ in float64); float64 stays float64. Their 1/σ comes from
    CUDA's ``rsqrt`` (within 2 ulps, not correctly rounded): held here to 2 ulps of 1/s, which a wrong ε would miss by
    far."""
    norm = CenterNorm(384).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(384, generator=torch.Generator().manual_seed(5), dtype=dtype))
    gpu = copy.deepcopy(norm).cuda()
    scale, ulp = center_norm_module.LAYER_NORM_SCALE[dtype], torch.finfo(dtype).eps
    for spread in SPREADS[dtype]:
        x, _, _, upstream = spread_inputs(dtype, spread, shape=(64, 197, 384))
        one_over_sigma = torch.native_layer_norm(x.cuda(), (384,), None, None, scale * scale)[2]
        assert float((one_over_sigma * scale - 1).abs().max()) <= 2 * ulp
        want = outputs_and_gradients(formula, x, norm.weight * (384 / 383), norm.bias, upstream)
        want[2] = want[2] * (384 / 383)  # γ's gradient: the formula's is w's, w = γ·384/383
        for autocast in (False, True):
            leaf = x.cuda().requires_grad_(True)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                out = gpu(leaf)
                got = [out, *torch.autograd.grad(out, (leaf, gpu.weight, gpu.bias), upstream.cuda())]
            assert out.grad_fn.name() == "NativeLayerNormBackward0" and all(t.dtype == dtype for t in got)
            assert_all_close([t.cpu() for t in got], want, TOLERANCE[dtype])


@pytest.mark.gpu
def test_on_a_gpu_half_precision_inputs_train():
    """CUDA, bf16 and fp16 throughout (``bf16-true``, ``16-true``) and a bf16 input with float32 parameters under
    autocast: the gradients run (LayerNorm's kernel, which reads half-precision statistics as float32, is not taken)
    and equal the float64 formula to half precision's rounding."""
    x, weight, bias, upstream = (t.cuda() for t in inputs(torch.float32, shape=(64, 197, 384)))
    for half in (torch.bfloat16, torch.float16):
        rounded = x.to(half)
        for parameters in ((weight.to(half), bias.to(half)), (weight, bias)):
            with torch.autocast("cuda", torch.bfloat16, enabled=parameters[0].dtype == torch.float32):
                got = outputs_and_gradients(center_norm, rounded, *parameters, upstream)
            want = outputs_and_gradients(formula, rounded.double(), *(p.double() for p in parameters),
                                         upstream.double())
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * float(b.detach().abs().max()))
