"""CUDA's fused RMSNorm stood in on the CPU (stability/testing/fused_rms_norm.py): the same values and gradients as
``F.rms_norm`` (a planted backward without its mean term fails), one operator each way to the counter, with the
inputs and outputs of CUDA's kernels (CUDA calls ``_fused_rms_norm`` for every dtype: fake CUDA tensors), and
``gpu_model.cuda_path`` routes ``F.rms_norm`` through it only inside its block."""
import pytest
import torch
import torch.nn.functional as F

from stability.testing import fake_gpu
from stability.testing import fused_rms_norm as module
from stability.testing.fused_rms_norm import counted_as_on_cuda, rms_norm_as_on_cuda
from stability.testing.gpu_model import count, cuda_path


def values_and_gradients(function, dtype, weighted, width=1, create_graph=False):
    gen = torch.Generator().manual_seed(0)
    shape = (3, 4, 6) if width == 1 else (3, 4, 2, 3)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * torch.tensor([0.01, 1.0, 30.0, 3.0]).view(
        4, *[1] * width).double()).to(dtype).requires_grad_(True)
    weight = torch.randn(shape[-width:], generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True) \
        if weighted else None
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    out = function(x, shape[-width:], weight, 1e-3)
    inputs = [x] + ([weight] if weighted else [])
    grads = torch.autograd.grad(out, inputs, upstream, create_graph=create_graph)
    if create_graph:  # the gradient's own gradient in x
        grads = (*grads, torch.autograd.grad(grads[0], x, upstream)[0])
    return [t.double() for t in (out, *grads)]


def close(got, want, tolerance):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * max(float(b.abs().max()), 1.0))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("width", [1, 2])
def test_the_stand_in_computes_what_rms_norm_computes(dtype, tolerance, weighted, width):
    """Against ``F.rms_norm`` in float64; bf16 to its own rounding (one bf16 ulp of the output and of the gradients,
    which the stand-in, like CUDA's kernel, computes in float32 from bf16 inputs)."""
    reference = values_and_gradients(F.rms_norm, torch.float64, weighted, width)
    close(values_and_gradients(rms_norm_as_on_cuda, dtype, weighted, width), reference, tolerance)


def test_a_differentiable_backward_is_the_composite_and_a_planted_backward_fails(monkeypatch):
    reference = values_and_gradients(F.rms_norm, torch.float64, True, create_graph=True)
    close(values_and_gradients(rms_norm_as_on_cuda, torch.float64, True, create_graph=True), reference, 1e-12)
    plain = values_and_gradients(F.rms_norm, torch.float64, True)
    original = module._backward

    def without_the_mean_term(grad, x, rstd, weight, width):
        grad_x, grad_weight = original(grad, x, rstd, weight, width)
        gw = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        return (grad_x - (rstd * gw - grad_x)).to(x.dtype), grad_weight  # r·(g⊙w) alone

    monkeypatch.setattr(module, "_backward", without_the_mean_term)
    with pytest.raises(AssertionError):
        close(values_and_gradients(rms_norm_as_on_cuda, torch.float64, True), plain, 1e-6)


def test_each_way_is_one_operator_with_cudas_inputs_and_outputs():
    x = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn_like(x)
    counts = count(lambda: torch.autograd.backward(rms_norm_as_on_cuda(x, (8,), None, 1e-6), upstream))
    assert counts.ops == {"fused_rms_norm": 1, "fused_rms_norm_backward": 1}
    rows = 2 * 3 * 5
    # forward: x read, y and the float32 statistics written; backward: the gradient, x and the statistics read, the
    # input's gradient written
    assert counts.bytes == (2 * x.numel() * 2 + rows * 4) + (3 * x.numel() * 2 + rows * 4)
    composite = count(lambda: torch.autograd.backward(F.rms_norm(x, (8,), None, 1e-6), upstream))
    assert composite.launches > 10 and composite.bytes > 2 * counts.bytes


@pytest.mark.parametrize("rows", [64, 70_000])
def test_the_weights_gradient_is_a_kernel_of_its_own_and_partial_sums_over_many_rows(rows):
    x = torch.randn(rows, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True)
    upstream = torch.randn(rows, 8)
    counts = count(lambda: torch.autograd.grad(rms_norm_as_on_cuda(x, (8,), weight, 1e-6), (x, weight), upstream))
    many = rows > module.MANY_ROWS
    assert counts.ops == {"fused_rms_norm": 1, "fused_rms_norm_backward": 1, "fused_rms_norm_weight_partials": 1,
                          **({"sum": 1} if many else {})}
    got = torch.autograd.grad(rms_norm_as_on_cuda(x, (8,), weight, 1e-6), weight, upstream)[0]
    want = torch.autograd.grad(F.rms_norm(x, (8,), weight, 1e-6), weight, upstream)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    strided = torch.randn(8, 2)[:, 0].requires_grad_(True)  # a strided weight: copied each way, as CUDA does
    counts = count(lambda: torch.autograd.grad(rms_norm_as_on_cuda(x, (8,), strided, 1e-6), strided, upstream))
    assert counts.ops["clone"] == 2


def test_a_strided_input_is_copied_each_way_as_cuda_copies_it():
    x = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)  # strided, as q, k, v
    upstream = torch.randn(x.shape, dtype=torch.bfloat16)
    counts = count(lambda: torch.autograd.grad(rms_norm_as_on_cuda(x, (8,), None, 1e-6), x, upstream))
    assert counts.ops == {"fused_rms_norm": 1, "fused_rms_norm_backward": 1, "clone": 2}
    reference = torch.autograd.grad(F.rms_norm(x, (8,), None, 1e-6), x, upstream)[0]
    torch.testing.assert_close(torch.autograd.grad(rms_norm_as_on_cuda(x, (8,), None, 1e-6), x, upstream)[0],
                               reference, rtol=0, atol=0)


def test_the_default_eps_is_that_of_the_statistics_dtype():
    x = 1e-3 * torch.randn(4, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm_as_on_cuda(x, (8,)), F.rms_norm(x, (8,)), rtol=0, atol=0)


def test_the_cuda_path_routes_rms_norm_through_the_stand_in_only_inside_its_block():
    from stability.classifier import ImageClassifier

    module_ = ImageClassifier(image_size=8, backbone_options=dict(embed_dim=8, depth=1, num_heads=2))
    original = F.rms_norm
    with cuda_path(module_):
        assert F.rms_norm is rms_norm_as_on_cuda
        with counted_as_on_cuda():  # nested: restored to the outer block's
            pass
        assert F.rms_norm is rms_norm_as_on_cuda
    assert F.rms_norm is original


@pytest.mark.skipif(not fake_gpu.SUPPORTED, reason="fake CUDA tensors without a GPU need torch >= 2.11")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_runs_rms_norm_as_one_fused_operator_with_the_stand_ins_outputs(dtype, weighted):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    called = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.overloadpacket.__name__ != "device":
                called.append((func.overloadpacket.__name__, [(o.dtype, tuple(o.shape)) for o in out]))
            return out

    with fake_gpu.fake_h200(), FakeTensorMode():
        x = torch.empty(4, 6, 17, 64, dtype=dtype, device="cuda", requires_grad=True)
        weight = torch.empty(64, dtype=dtype, device="cuda") if weighted else None
        with Recorder():
            F.rms_norm(x, (64,), weight, 1e-6)
        stand_in = module.fused_rms_norm(x, 1, weight, 1e-6)  # its fake outputs
    assert called == [("_fused_rms_norm", [(o.dtype, tuple(o.shape)) for o in stand_in])]
