"""The per-channel scale's written-out backward (stability/nn/channel_scale.py, LipsFormer's weighted residual) against
autograd through α ⊙ x: the same numbers bit for bit, in the gradient's layout, where α widens x (bf16 or fp16 and
float32; float32 and float64) and in one dtype; twice differentiable and under torch.func; planted errors fail; taken
only where it pays (CUDA, a large input, a gradient to take); and two passes over the float32 gradient fewer,
counted as a GPU runs it."""
import pytest
import torch
from torch.func import grad, jacrev, vmap

import stability.nn.center_norm as center_norm_module
import stability.nn.channel_scale as channel_scale_module
from stability.classifier import ImageClassifier
from stability.nn.channel_scale import _ChannelScale, channel_scale
from stability.stabilizers.lipsformer import LipsFormer, ResidualScale
from stability.testing.gpu_model import count


def formula(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return alpha * x


def inputs(dtype: torch.dtype, shape=(3, 5, 16), alpha_dtype: torch.dtype | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    alpha = torch.randn(shape[-1], generator=gen).to(alpha_dtype or dtype)
    upstream = torch.randn(shape, generator=gen).to(torch.promote_types(dtype, alpha.dtype))
    return x, alpha, upstream


def outputs_and_gradients(function, x, alpha, upstream, create_graph=False):
    x, alpha = (t.detach().clone().requires_grad_(True) for t in (x, alpha))
    out = function(x, alpha)
    return [out, *torch.autograd.grad(out, (x, alpha), upstream, create_graph=create_graph)]


def assert_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("narrow, wide", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                          (torch.float32, torch.float64)])
def test_a_widened_input_gets_autograds_gradients_bit_for_bit(narrow, wide):
    """x narrower than α (a bf16 residual branch and a float32 α under autocast): the output in α's dtype, ∂x in x's,
    ∂α in α's (float64 stays float64), every value equal to autograd's, whose ∂x is the wide product cast after it
    (the written-out product rounds once to the same value)."""
    args = inputs(narrow, alpha_dtype=wide)
    got = outputs_and_gradients(_ChannelScale.apply, *args)
    assert_equal(got, outputs_and_gradients(formula, *args))
    assert (got[0].dtype, got[1].dtype, got[2].dtype) == (wide, narrow, wide)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_dtype_throughout_is_the_formula_bit_for_bit(dtype):
    args = inputs(dtype)
    got = outputs_and_gradients(_ChannelScale.apply, *args)
    assert_equal(got, outputs_and_gradients(formula, *args))
    assert all(t.dtype == dtype for t in got)


def test_a_strided_upstream_gradient_keeps_its_layout():
    """A permuted upstream gradient: ∂x in that layout, as autograd's cast keeps it (a contiguous ∂x, planted,
    fails)."""
    x, alpha, _ = inputs(torch.bfloat16, shape=(4, 6, 16), alpha_dtype=torch.float32)
    strided = torch.randn(6, 4, 16).transpose(0, 1)  # (4, 6, 16), not contiguous
    want = outputs_and_gradients(formula, x, alpha, strided)
    assert_equal(outputs_and_gradients(_ChannelScale.apply, x, alpha, strided), want)
    contiguous = outputs_and_gradients(_ChannelScale.apply, x, alpha, strided)
    contiguous[1] = contiguous[1].contiguous()
    with pytest.raises(AssertionError):
        assert_equal(contiguous, want)


def _dropped_scale(ctx, grad):
    x, alpha = ctx.saved_tensors
    return grad.to(ctx.x_dtype), (grad * x).sum_to_size(alpha.shape)


def _rounded_twice(ctx, grad):
    """The upstream gradient rounded to x's dtype before the product: two roundings where autograd takes one."""
    x, alpha = ctx.saved_tensors
    return grad.to(ctx.x_dtype) * alpha.to(ctx.x_dtype), (grad * x).sum_to_size(alpha.shape)


def _scale_gradient_from_the_gradient_alone(ctx, grad):
    x, alpha = ctx.saved_tensors
    return (grad * alpha).to(ctx.x_dtype), grad.sum_to_size(alpha.shape)


def _wrong_sign(ctx, grad):
    x, alpha = ctx.saved_tensors
    return (grad * alpha).to(ctx.x_dtype), -(grad * x).sum_to_size(alpha.shape)


@pytest.mark.parametrize("planted", [_dropped_scale, _rounded_twice, _scale_gradient_from_the_gradient_alone,
                                     _wrong_sign])
def test_a_planted_error_in_the_backward_fails(planted, monkeypatch):
    args = inputs(torch.bfloat16, alpha_dtype=torch.float32)
    want = outputs_and_gradients(formula, *args)
    assert_equal(outputs_and_gradients(_ChannelScale.apply, *args), want)
    monkeypatch.setattr(_ChannelScale, "backward", staticmethod(planted))
    with pytest.raises(AssertionError):
        assert_equal(outputs_and_gradients(_ChannelScale.apply, *args), want)


def test_twice_differentiable_and_under_torch_func():
    x, alpha, upstream = inputs(torch.float64, shape=(2, 3, 5))
    leaves = tuple(t.clone().requires_grad_(True) for t in (x, alpha))
    assert torch.autograd.gradcheck(_ChannelScale.apply, leaves)
    assert torch.autograd.gradgradcheck(_ChannelScale.apply, leaves)
    for argnums in (0, 1):
        torch.testing.assert_close(jacrev(_ChannelScale.apply, argnums=argnums)(x, alpha),
                                   jacrev(formula, argnums=argnums)(x, alpha), rtol=1e-10, atol=1e-12)

    def loss(function):
        return lambda a, rows: (function(rows, a) ** 2).sum()

    torch.testing.assert_close(vmap(grad(loss(_ChannelScale.apply)), in_dims=(None, 0))(alpha, x),
                               vmap(grad(loss(formula)), in_dims=(None, 0))(alpha, x), rtol=1e-10, atol=1e-12)
    # a backward that keeps its graph, with a half-precision x: the formula's operators, the same gradients, and the
    # same second derivatives
    half = inputs(torch.bfloat16, shape=(2, 3, 5), alpha_dtype=torch.float32)
    first = {f: outputs_and_gradients(f, *half, create_graph=True) for f in (_ChannelScale.apply, formula)}
    assert_equal(first[_ChannelScale.apply], first[formula])

    def second(function):
        x, alpha = (t.detach().clone().requires_grad_(True) for t in half[:2])
        grad_x, grad_alpha = torch.autograd.grad(function(x, alpha), (x, alpha), half[2], create_graph=True)
        return torch.autograd.grad((grad_x.float() ** 2).sum() + (grad_alpha ** 2).sum(), (x, alpha))

    assert_equal(second(_ChannelScale.apply), second(formula))


def test_a_batched_gradient_takes_the_formulas_operators(monkeypatch):
    """``is_grads_batched`` (vmap over the backward): a batched upstream gradient has no ``out=`` rule, so the backward
    takes autograd's product; the same gradients as the formula's (the ``out=`` product taken, planted, fails)."""
    x, alpha, _ = inputs(torch.bfloat16, shape=(3, 4), alpha_dtype=torch.float32)
    seeds = torch.randn(5, 3, 4)

    def batched(function):
        xx, aa = (t.detach().clone().requires_grad_(True) for t in (x, alpha))
        return list(torch.autograd.grad(function(xx, aa), (xx, aa), seeds, is_grads_batched=True))

    assert_equal(batched(_ChannelScale.apply), batched(formula))
    monkeypatch.setattr(channel_scale_module, "transformed", lambda t: False)  # the batched gradient not seen
    with pytest.raises(RuntimeError, match="out="):
        batched(_ChannelScale.apply)


@pytest.mark.parametrize("frozen", ["x", "alpha"])
def test_a_frozen_input_gets_no_gradient_and_the_other_its_own(frozen):
    x, alpha, upstream = inputs(torch.bfloat16, alpha_dtype=torch.float32)
    x.requires_grad_(frozen != "x")
    alpha.requires_grad_(frozen != "alpha")
    _ChannelScale.apply(x, alpha).backward(upstream)
    want = outputs_and_gradients(formula, x, alpha, upstream)
    assert (x.grad is None) == (frozen == "x") and (alpha.grad is None) == (frozen == "alpha")
    live = x.grad if frozen == "alpha" else alpha.grad
    assert_equal([live], [want[1] if frozen == "alpha" else want[2]])


def test_taken_on_cuda_for_a_widened_input_from_32_mib_with_a_gradient_and_never_compiled(monkeypatch):
    """The Function where the device casts as it stores (CUDA; here as ``cuda_path`` counts it), α widens x, x has
    32 MiB (judged at ``sized_as``'s scale, as CenterNorm judges) and a gradient will be taken; never compiled nor
    under torch.func's transforms; autograd's product elsewhere (one dtype: nothing to save; the CPU: an ``out=`` of
    another dtype is a temporary and a copy there)."""
    def path(x, alpha_dtype=torch.float32, requires_grad=True):
        alpha = torch.ones(x.shape[-1], dtype=alpha_dtype, requires_grad=requires_grad)
        out = channel_scale(x, alpha)
        return type(out.grad_fn).__name__ if out.grad_fn is not None else None

    width = 256
    large = torch.empty(channel_scale_module.WRITTEN_OUT_FROM_BYTES // (2 * width), width, dtype=torch.bfloat16)
    assert path(large) == "MulBackward0"  # the CPU's own kernels
    monkeypatch.setattr(channel_scale_module, "casting_out_on", lambda device: True)
    assert (path(large), path(large[:-1])) == ("_ChannelScaleBackward", "MulBackward0")
    assert path(large, requires_grad=False) is None  # no gradient to take: the formula, not the Function
    with torch.no_grad():
        assert channel_scale(large, torch.ones(width, requires_grad=True)).grad_fn is None
    assert path(large.float()) == "MulBackward0"  # float32 x and α: one kernel each way already
    assert path(large, torch.bfloat16) == "MulBackward0"
    small = torch.empty(4, 257, 384, dtype=torch.bfloat16)  # a ViT-S branch at batch 4, standing for batch 256
    assert path(small) == "MulBackward0"
    with center_norm_module.sized_as(256 / 4):
        assert path(small) == "_ChannelScaleBackward"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert path(large) == "MulBackward0"


def test_under_torch_funcs_transforms_and_forward_mode_the_formula(monkeypatch):
    """Forward mode, which the Function does not have — ``jvp`` in x or in α alone, a dual tensor of
    ``torch.autograd.forward_ad`` — and ``vmap``: the formula is taken, so they run (the Function taken, planted,
    fails for want of a jvp)."""
    import torch.autograd.forward_ad as forward_ad

    monkeypatch.setattr(channel_scale_module, "WRITTEN_OUT_FROM_BYTES", 0)
    monkeypatch.setattr(channel_scale_module, "casting_out_on", lambda device: True)
    x, alpha, tangent = inputs(torch.bfloat16, alpha_dtype=torch.float32)
    alpha.requires_grad_(True)
    tangent = tangent.to(x.dtype)

    def in_x():
        return torch.func.jvp(lambda rows: channel_scale(rows, alpha), (x,), (tangent,))

    trained_x = x.detach().requires_grad_(True)  # a gradient will be taken: the Function's other condition

    def in_alpha():
        return torch.func.jvp(lambda a: channel_scale(trained_x, a), (alpha.detach(),), (torch.ones_like(alpha),))

    def dual():
        with forward_ad.dual_level():
            out = channel_scale(forward_ad.make_dual(x, tangent), alpha)
            return list(forward_ad.unpack_dual(out))

    assert_equal(list(in_x()), [formula(x, alpha), formula(tangent, alpha)])
    assert_equal(list(in_alpha()), [formula(x, alpha), formula(x, torch.ones_like(alpha))])
    assert_equal(dual(), [formula(x, alpha), formula(tangent, alpha)])
    assert_equal([torch.func.vmap(lambda rows: channel_scale(rows, alpha))(x)], [formula(x, alpha)])
    monkeypatch.setattr(channel_scale_module, "transformed", lambda t: False)
    for forward in (in_x, in_alpha, dual):
        with pytest.raises(NotImplementedError, match="jvp"):
            forward()


def test_two_passes_over_the_float32_gradient_fewer_than_autograd():
    """Counted as a GPU runs it (stability/testing/gpu_model.py), forward and backward: autograd's float32 product and
    its cast to x's dtype (a write and a read of the float32 gradient more) against one product written in x's dtype."""
    x, alpha, upstream = inputs(torch.bfloat16, shape=(8, 32, 64), alpha_dtype=torch.float32)

    def counted(function):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, alpha)]
        return count(lambda: function(*leaves).backward(upstream))

    fast, slow = counted(_ChannelScale.apply), counted(formula)
    assert slow.bytes - fast.bytes == pytest.approx(2 * upstream.nbytes, rel=0.01)
    assert fast.launches == slow.launches - 1


def test_it_runs_on_meta_tensors():
    x = torch.empty(2, 5, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    alpha = torch.empty(16, device="meta", requires_grad=True)
    _ChannelScale.apply(x, alpha).sum().backward()
    assert (x.grad.shape, x.grad.dtype, alpha.grad.shape) == (x.shape, torch.bfloat16, (16,))


@pytest.mark.parametrize("backbone, size", [("vit", 8), ("swin", 16), ("cswin", 16)])
def test_lipsformer_trains_under_bf16_autocast_with_autograds_gradients(backbone, size, monkeypatch):
    """A LipsFormer step under the CPU's bf16 autocast, every weighted residual taking the written-out backward, against
    autograd through α ⊙ x: the loss and every parameter's gradient bit for bit. α is kept out of the Linear layers
    here (``after_prepare`` skipped), as where it cannot be folded into them (a parametrised Linear, another block)."""
    def loss_and_gradients():
        torch.manual_seed(0)
        module = ImageClassifier(backbone=backbone, image_size=size, stabilizer="lipsformer").train()
        images = torch.rand(3, 1, size, size, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", torch.bfloat16):
            _, terms = module.losses(images, torch.tensor([0, 1, 2]))
            loss = sum(terms.values())
        loss.backward()
        return [loss.detach(), *(p.grad for p in module.parameters() if p.grad is not None)]

    monkeypatch.setattr(LipsFormer, "after_prepare", lambda self, network: None)  # α not folded
    monkeypatch.setattr(channel_scale_module, "WRITTEN_OUT_FROM_BYTES", 0)  # every scale takes it, however small
    monkeypatch.setattr(channel_scale_module, "casting_out_on", lambda device: True)  # as on CUDA
    calls, written_out = [], _ChannelScale.apply
    monkeypatch.setattr(_ChannelScale, "apply", lambda *args: calls.append(1) or written_out(*args))
    fast = loss_and_gradients()
    scales = ImageClassifier(backbone=backbone, image_size=size, stabilizer="lipsformer").modules()
    assert len(calls) == sum(isinstance(m, ResidualScale) for m in scales) > 0  # one call each
    monkeypatch.setattr(channel_scale_module, "channel_scale", formula)
    monkeypatch.setattr("stability.stabilizers.lipsformer.channel_scale", formula)
    assert_equal(fast, loss_and_gradients())


@pytest.mark.gpu
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_on_a_gpu_a_half_precision_input_gets_autograds_gradients(half):
    """CUDA's kernels: the product written in x's dtype equals autograd's product and cast, bit for bit, in either
    layout of the upstream gradient, and a float32 x under a float64 α (float64 stays float64); CUDA takes the
    Function from 32 MiB."""
    args = [t.cuda() for t in inputs(half, shape=(64, 197, 384), alpha_dtype=torch.float32)]
    assert_equal(outputs_and_gradients(_ChannelScale.apply, *args), outputs_and_gradients(formula, *args))
    permuted = args[2].transpose(0, 1).contiguous().transpose(0, 1)  # the same values, another layout
    assert_equal(outputs_and_gradients(_ChannelScale.apply, *args[:2], permuted),
                 outputs_and_gradients(formula, *args[:2], permuted))
    large = torch.zeros(256, 197, 384, dtype=half, device="cuda")  # 37 MiB: CUDA takes the Function from 32 MiB
    alpha = args[1].detach().requires_grad_(True)
    assert type(channel_scale(large, alpha).grad_fn).__name__ == "_ChannelScaleBackward"
    assert type(channel_scale(large[:200], alpha).grad_fn).__name__ == "MulBackward0"
    # a float32 x and a float64 α: the product in float64, written in float32 by the kernel; α's gradient float64
    wide = [t.cuda() for t in inputs(torch.float32, shape=(64, 197, 384), alpha_dtype=torch.float64)]
    got = outputs_and_gradients(_ChannelScale.apply, *wide)
    assert_equal(got, outputs_and_gradients(formula, *wide))
    assert [t.dtype for t in got] == [torch.float64, torch.float32, torch.float64]
