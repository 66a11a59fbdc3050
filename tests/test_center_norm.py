"""CenterNorm's written-out backward (stability/nn/center_norm.py) against autograd through its formula: in float64 to
1e-10 and float32 to 1e-5, on its own and in LipsFormer on every backbone, both ways of taking the parameters'
gradients (LayerNorm's fused kernel; a product and sums where a graph of the backward is kept), twice differentiated,
under torch.func and under CUDA's autocast; planted errors fail; and it moves about half the bytes."""
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


def test_twice_differentiable_and_under_torch_func():
    x, weight, bias, _ = inputs(torch.float64, shape=(2, 3, 5))
    leaves = tuple(t.clone().requires_grad_(True) for t in (x, weight, bias))
    assert torch.autograd.gradcheck(center_norm, leaves)
    assert torch.autograd.gradgradcheck(center_norm, leaves)
    for argnums in (0, 1, 2):
        torch.testing.assert_close(jacrev(center_norm, argnums=argnums)(x, weight, bias),
                                   jacrev(formula, argnums=argnums)(x, weight, bias), rtol=1e-10, atol=1e-12)

    def loss(function):
        return lambda w, rows: (function(rows, w, bias) ** 2).sum()

    torch.testing.assert_close(vmap(grad(loss(center_norm)), in_dims=(None, 0))(weight, x),
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backbone, size", [("vit", 8), ("swin", 16), ("cswin", 16)])
def test_lipsformer_trains_with_the_gradients_of_the_formula(backbone, size, dtype, monkeypatch):
    """A LipsFormer step's loss and every parameter's gradient, with the written-out backward and with autograd
    through the formula (CenterNorm's function swapped for it), on each backbone."""
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
    monkeypatch.setattr(center_norm_module, "WRITTEN_OUT_FROM_BYTES", 0)  # every norm takes it, however small
    calls, written_out = [], center_norm_module.center_norm
    monkeypatch.setattr(center_norm_module, "center_norm", lambda *args: calls.append(1) or written_out(*args))
    fast = loss_and_gradients()
    assert calls  # the written-out backward ran
    monkeypatch.setattr(center_norm_module, "center_norm", formula)
    assert_all_close(fast, loss_and_gradients(), TOLERANCE[dtype])


def test_a_norm_takes_the_written_out_backward_from_16_mib_and_never_compiled(monkeypatch):
    """The written-out backward costs the host more and the device less: a norm takes it from 16 MiB of input (a
    ViT-S at 256 tokens holds 101 MB a norm at batch 256, 1.2 MB at batch 3), judged as ``sized_as`` says (a step
    counted at batch 4 for batch 256), and never inside a compiled graph; below, autograd through the formula."""
    def path(x):
        norm = CenterNorm(x.shape[-1])
        return type(norm(x.requires_grad_(True)).grad_fn).__name__

    small, large = torch.randn(3, 257, 384), torch.randn(2**24 // (4 * 256), 256)  # 16 MiB exactly
    assert (path(small), path(large)) == ("AddcmulBackward0", "_CenterNormBackward")
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
