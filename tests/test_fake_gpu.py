"""The Triton program Inductor writes for an H200, generated without a GPU (stability/testing/fake_gpu.py)."""
import re

import pytest
import torch
import torch.nn.functional as F

from stability.testing import fake_gpu
from stability.testing.fake_gpu import FakeGpuUnavailable, triton_code

needs_fake_gpu = pytest.mark.skipif(not fake_gpu.SUPPORTED, reason="GPU code without a GPU needs torch >= 2.11")


def launches(source: str) -> list[str]:
    """The calls of the generated ``call`` function that launch: Triton kernels (``name.run(``), library calls and
    ATen fallbacks, by name."""
    body = source[source.index("def call("):]
    body = body[:body.index("\n\n\n")] if "\n\n\n" in body else body
    launch = r"(\w+\.run|extern_kernels\.\w+|torch\.ops\.aten\.[\w.]+)"
    return re.findall(r"^\s*(?:[\w ,()\[\]]+=\s*)?" + launch + r"\(", body, re.M)


def compiled_on_h200(fn, *inputs, backward: bool = False) -> tuple[list[str], torch.Tensor]:
    torch._dynamo.reset()
    with triton_code() as sources:
        out = torch.compile(fn)(*inputs)
        if backward:
            out.sum().backward()
    return sources, out


@needs_fake_gpu
def test_a_layer_norm_compiles_to_one_triton_kernel_on_the_h200_and_the_cpu_still_computes_it():
    """A row's statistics and its normalisation are one Triton kernel (a persistent reduction), where the CPU's C++
    writes two loop nests; the CPU compile still runs, so the values are the eager ones."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    sources, out = compiled_on_h200(lambda t: F.layer_norm(t, (64,)), x)
    assert len(sources) == 1
    assert [name.endswith(".run") for name in launches(sources[0])] == [True]
    assert "empty_strided_cuda" in sources[0] and "empty_strided_cpu(" not in sources[0]
    assert "multi_processor_count=132" in sources[0] and "cc=90" in sources[0]  # an H200's kernels
    assert "@triton.jit" in sources[0] and "cpp_pybinding" not in sources[0]  # Triton's code, not the CPU's
    torch.testing.assert_close(out, F.layer_norm(x, (64,)), rtol=0, atol=1e-6)


@needs_fake_gpu
def test_forward_and_backward_are_each_generated_with_their_library_calls():
    """A linear layer, GELU and a sum, with a backward: the forward's product is one cuBLAS call with the GELU fused
    after it into one kernel; the backward's one product (the weight's gradient: the input takes none) is a library
    call; the gradients are the eager ones (the CPU compile ran)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=generator)
    w = torch.randn(24, 32, generator=generator, requires_grad=True)
    sources, _ = compiled_on_h200(lambda t: F.gelu(t @ w.T), x, backward=True)
    forward, backward = (launches(source) for source in sources)
    assert [n for n in forward if n.startswith("extern_kernels")] == ["extern_kernels.mm"]
    assert sum(n.endswith(".run") for n in forward) == 1  # the GELU, one kernel
    assert sorted(n for n in backward if n.startswith("extern_kernels")) == ["extern_kernels.mm"]  # dW; dx unused
    expected = torch.autograd.grad(F.gelu(x @ w.T).sum(), w)[0]
    torch.testing.assert_close(w.grad, expected, rtol=1e-5, atol=1e-5)


@needs_fake_gpu
def test_a_torch_without_inductors_entry_point_gets_a_clear_error(monkeypatch):
    from torch._inductor import compile_fx

    monkeypatch.delattr(compile_fx, "fx_codegen_and_compile")
    with pytest.raises(FakeGpuUnavailable, match="fx_codegen_and_compile"), triton_code():
        pass


@needs_fake_gpu
def test_tensors_the_graph_creates_on_the_cpu_are_created_on_the_gpu():
    """A factory in the traced graph names the CPU, where the inputs lived: its copy for the H200 names ``cuda:0``,
    so the constant fuses into the one kernel that adds it (a CPU tensor would be a kernel of the CPU's)."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    sources, out = compiled_on_h200(lambda t: t * torch.arange(64, device=t.device), x)
    assert [name.endswith(".run") for name in launches(sources[0])] == [True]
    assert "cpp_pybinding" not in sources[0]
    torch.testing.assert_close(out, x * torch.arange(64), rtol=0, atol=0)


def test_an_older_torch_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(fake_gpu, "SUPPORTED", False)
    with pytest.raises(FakeGpuUnavailable, match="2.11 or newer"), triton_code():
        pass


@needs_fake_gpu
def test_a_constant_the_graph_holds_moves_with_it_and_everything_is_restored_after_the_block():
    """A tensor the graph reads as an attribute moves to the GPU with it (left on the CPU, the fake compile fails on
    mixed devices); after the block, and after one left by an exception, Inductor and torch.cuda are as they were and a
    compile is the CPU's again."""
    from torch._inductor import compile_fx
    from torch._inductor.graph import GraphLowering

    saved = (compile_fx.fx_codegen_and_compile, GraphLowering.compile_to_module, torch.cuda.get_device_properties)
    constant = torch.linspace(-1, 1, 64)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    sources, out = compiled_on_h200(lambda t: t * torch.tensor(constant.tolist()), x)
    assert [name.endswith(".run") for name in launches(sources[0])] == [True]
    torch.testing.assert_close(out, x * constant, rtol=0, atol=0)
    with pytest.raises(KeyError), triton_code():
        raise KeyError("interrupted")
    assert (compile_fx.fx_codegen_and_compile, GraphLowering.compile_to_module,
            torch.cuda.get_device_properties) == saved
    torch._dynamo.reset()
    assert torch.compile(lambda t: t.sin())(x).device.type == "cpu" and not fake_gpu._active


@needs_fake_gpu
def test_recording_blocks_do_not_nest():
    with triton_code(), pytest.raises(FakeGpuUnavailable, match="do not nest"), triton_code():
        pass
