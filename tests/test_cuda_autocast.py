"""CUDA's autocast on CPU tensors (stability/testing/cuda_autocast.py), against CUDA's own autocast kernels: each
operator whose CUDA policy the CPU's autocast lacks, called on fake CUDA tensors under CUDA's autocast and on CPU
tensors under the CPU's autocast inside ``cuda_autocast()``, launches the same operators with the same dtypes; so does
a ViT's forward with timm's QK norm; outside the block the CPU's own lists are back."""
import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from stability.testing import fake_gpu
from stability.testing.cuda_autocast import CUDA_POLICY, NOT_ON_THE_CPU, applied_policies, cpu_only, cuda_autocast

needs_fake_cuda = pytest.mark.skipif(not fake_gpu.SUPPORTED,
                                     reason="fake CUDA tensors without a GPU need torch >= 2.11")


def _dtypes(values) -> tuple:
    return tuple(v.dtype if isinstance(v, torch.Tensor) else _dtypes(v) for v in values
                 if isinstance(v, (torch.Tensor, list, tuple)))


class Launched(TorchDispatchMode):
    """(operator, its inputs' dtypes) of every operator that is not a view, as autocast passed them on (recorded before
    the operator runs: one that refuses a dtype is recorded too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = collections.Counter()
        self.paused = False  # while the inputs are made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (self.paused or func.is_view or func.overloadpacket.__name__ == "device"):
            self.ops[func.overloadpacket.__name__, _dtypes((*args, *kwargs.values()))] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda_autocast():
    """Fake CUDA tensors (no GPU) under CUDA's own bf16 autocast."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_gpu.fake_h200(), FakeTensorMode(allow_non_fake_inputs=True):
        enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        torch.set_autocast_enabled("cuda", True)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", dtype)


@contextlib.contextmanager
def emulated_autocast():
    with cuda_autocast(), torch.autocast("cpu", torch.bfloat16):
        yield


def launched(call, device: str, autocast) -> tuple[collections.Counter, object]:
    """What ``call(make)`` launches under ``autocast`` on ``device``, and its result's dtype (or whether the error
    raised says the operator refuses the dtype); ``make(*shape, dtype=)`` gives a seeded tensor there,
    ``make.move(module)`` calls a module with its weights there, ``make.index(values)`` makes an integer tensor there,
    none of them recorded."""
    generator = torch.Generator().manual_seed(0)
    recorder = Launched()

    @contextlib.contextmanager
    def unrecorded():
        recorder.paused = True
        try:
            yield
        finally:
            recorder.paused = False

    def make(*shape, dtype=torch.bfloat16):
        with unrecorded():
            return (torch.rand(*shape, generator=generator) + 0.5).to(device=device, dtype=dtype)

    def move(module):
        with unrecorded():
            state = {name: value.to(device) for name, value in module.state_dict(keep_vars=True).items()}
        return lambda *inputs: torch.func.functional_call(module, state, inputs)

    def index(values):
        with unrecorded():
            return torch.tensor(values, device=device)

    make.move, make.index = move, index
    with autocast():
        try:
            with recorder:
                out = call(make)
        except RuntimeError as error:
            return recorder.ops, ("refused", "unsafe to autocast" in str(error) or "not implemented" in str(error))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return recorder.ops, tuple(o.dtype for o in outs if isinstance(o, torch.Tensor))


f32 = torch.float32
# one call of each operator CUDA's autocast handles otherwise than the CPU's: inputs its policy casts (bf16 where CUDA
# takes float32, float32 where it takes bf16, both where it promotes)
CALLS = {
    "convolution": lambda t: torch.ops.aten.convolution(t(1, 2, 5, 5, dtype=f32), t(3, 2, 3, 3, dtype=f32), None,
                                                        [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    "addmv": lambda t: torch.addmv(t(3, dtype=f32), t(3, 4, dtype=f32), t(4, dtype=f32)),
    "addr": lambda t: torch.addr(t(3, 4, dtype=f32), t(3, dtype=f32), t(4, dtype=f32)),
    "chain_matmul": lambda t: torch.chain_matmul(t(3, 4, dtype=f32), t(4, 5, dtype=f32), t(5, 2, dtype=f32)),
    "einsum": lambda t: torch.einsum("ij,j->i", t(3, 4, dtype=f32), t(4, dtype=f32)),
    "linalg_multi_dot": lambda t: torch.linalg.multi_dot([t(3, 4, dtype=f32), t(4, 5, dtype=f32),
                                                          t(5, 2, dtype=f32)]),
    "mv": lambda t: torch.mv(t(3, 4, dtype=f32), t(4, dtype=f32)),
    **{name: (lambda t, n=name: getattr(torch, n)(t(2, 3, dtype=f32), t(2, 4, dtype=f32), t(4, 3, dtype=f32),
                                                  t(4, 4, dtype=f32))) for name in ("rnn_relu_cell", "rnn_tanh_cell")},
    **{name: (lambda t, n=name: getattr(torch, n)(t(3, 4) * 0.5)) for name in
       ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt",
        "sinh", "tan")},
    "pow.Scalar": lambda t: torch.pow(2.0, t(3, 4)),
    "pow.Tensor_Scalar": lambda t: t(3, 4) ** 2,
    "pow.Tensor_Tensor": lambda t: t(3, 4) ** t(3, 4),
    "softplus": lambda t: F.softplus(t(3, 4)),
    "layer_norm": lambda t: F.layer_norm(t(3, 4), (4,), t(4, dtype=f32), t(4, dtype=f32)),
    "rms_norm": lambda t: F.rms_norm(t(3, 4), (4,), t(4, dtype=f32), 1e-6),
    "native_layer_norm": lambda t: torch.native_layer_norm(t(3, 4), [4], t(4, dtype=f32), t(4, dtype=f32), 1e-5),
    "group_norm": lambda t: F.group_norm(t(2, 4, 3), 2, t(4, dtype=f32), t(4, dtype=f32)),
    "frobenius_norm.dim": lambda t: torch.ops.aten.frobenius_norm.dim(t(3, 4), [1]),
    "nuclear_norm": lambda t: torch.nuclear_norm(t(3, 4)),
    "nuclear_norm.dim": lambda t: torch.nuclear_norm(t(2, 3, 4), dim=[1, 2]),
    "cosine_similarity": lambda t: F.cosine_similarity(t(3, 4), t(3, 4)),
    "dist": lambda t: torch.dist(t(3, 4), t(3, 4)),
    "pdist": lambda t: F.pdist(t(3, 4)),
    "renorm": lambda t: torch.renorm(t(3, 4), 2, 0, 1.0),
    "logsumexp": lambda t: torch.logsumexp(t(3, 4), 1),
    "upsample_nearest1d": lambda t: torch.ops.aten.upsample_nearest1d(t(1, 2, 4), [8]),
    "upsample_nearest2d": lambda t: torch.ops.aten.upsample_nearest2d(t(1, 2, 4, 4), [8, 8]),
    "upsample_nearest3d": lambda t: torch.ops.aten.upsample_nearest3d(t(1, 2, 2, 4, 4), [4, 8, 8]),
    "upsample_linear1d": lambda t: torch.ops.aten.upsample_linear1d(t(1, 2, 4), [8], False),
    "upsample_bilinear2d": lambda t: torch.ops.aten.upsample_bilinear2d(t(1, 2, 4, 4), [8, 8], False),
    "upsample_bicubic2d": lambda t: torch.ops.aten.upsample_bicubic2d(t(1, 2, 4, 4), [8, 8], False),
    "upsample_trilinear3d": lambda t: torch.ops.aten.upsample_trilinear3d(t(1, 2, 2, 4, 4), [4, 8, 8], False),
    "_upsample_nearest_exact1d": lambda t: torch.ops.aten._upsample_nearest_exact1d(t(1, 2, 4), [8]),
    "_upsample_nearest_exact2d": lambda t: torch.ops.aten._upsample_nearest_exact2d(t(1, 2, 4, 4), [8, 8]),
    "_upsample_nearest_exact3d": lambda t: torch.ops.aten._upsample_nearest_exact3d(t(1, 2, 2, 4, 4), [4, 8, 8]),
    "_upsample_bilinear2d_aa": lambda t: torch.ops.aten._upsample_bilinear2d_aa(t(1, 2, 4, 4), [8, 8], False),
    "_upsample_bicubic2d_aa": lambda t: torch.ops.aten._upsample_bicubic2d_aa(t(1, 2, 4, 4), [8, 8], False),
    "sum": lambda t: t(3, 4).sum(),
    "sum.dim_IntList": lambda t: t(3, 4).sum(1),
    "prod": lambda t: t(3, 4).prod(),
    "prod.dim_int": lambda t: t(3, 4).prod(1),
    "softmax.int": lambda t: t(3, 4).softmax(1),
    "log_softmax.int": lambda t: t(3, 4).log_softmax(1),
    "cumsum": lambda t: t(3, 4).cumsum(1),
    "cumprod": lambda t: t(3, 4).cumprod(1),
    "linalg_vector_norm": lambda t: torch.linalg.vector_norm(t(3, 4), dim=1),
    "linalg_matrix_norm": lambda t: torch.linalg.matrix_norm(t(3, 4), ord=1),
    "linalg_matrix_norm.str_ord": lambda t: torch.linalg.matrix_norm(t(3, 4)),
    "norm.Scalar": lambda t: torch.ops.aten.norm.Scalar(t(3, 4)),  # Tensor.norm() is linalg_vector_norm: aten's own
    "norm.Scalar, p": lambda t: torch.ops.aten.norm.Scalar(t(3, 4), 3),
    "norm.ScalarOpt_dim": lambda t: torch.ops.aten.norm.ScalarOpt_dim(t(3, 4), 2, [1]),  # keepdim at its default
    "norm.ScalarOpt_dim, float32": lambda t: torch.ops.aten.norm.ScalarOpt_dim(t(3, 4, dtype=f32), 2, [1], True),
    "addcdiv": lambda t: torch.addcdiv(t(3, 4), t(3, 4, dtype=f32), t(3, 4)),
    "addcmul": lambda t: torch.addcmul(t(3, 4), t(3, 4, dtype=f32), t(3, 4)),
    "atan2": lambda t: torch.atan2(t(3, 4), t(3, 4, dtype=f32)),
    "bilinear": lambda t: F.bilinear(t(2, 3), t(2, 4, dtype=f32), t(5, 3, 4, dtype=f32)),
    "cross": lambda t: torch.cross(t(2, 3), t(2, 3, dtype=f32), dim=1),
    "dot": lambda t: torch.dot(t(4), t(4, dtype=f32)),
    "vdot": lambda t: torch.vdot(t(4), t(4, dtype=f32)),
    "index_put": lambda t: torch.index_put(t(3, 4), (t.index([0, 2]),), t(2, 4, dtype=f32)),
    "scatter_add": lambda t: torch.scatter_add(t(3, 4), 1, t.index([[0, 0]] * 3),
                                               t(3, 2, dtype=f32)),
    "tensordot": lambda t: torch.tensordot(t(3, 4), t(4, 5, dtype=f32), dims=1),
    "binary_cross_entropy": lambda t: F.binary_cross_entropy(t(3) * 0.5, t(3) * 0.5),
    "grid_sampler": lambda t: F.grid_sample(t(1, 2, 4, 4), t(1, 3, 3, 2) - 1.0, align_corners=False),
}
# CUDA kernels only (no CPU kernel to call on CPU tensors); operators that fake CUDA tensors cannot run
# (``_convolution`` asks the driver, the GRU and LSTM cells reach CUDA's fused cells, which have no fake kernel); the
# named-dimension overloads, whose families are called above
NOT_CALLED = {"_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell", "_convolution",
              "gru_cell", "lstm_cell",
              "sum.dim_DimnameList", "prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumsum.dimname",
              "cumprod.dimname", "norm.names_ScalarOpt_dim"}
# operators only the CPU's autocast casts, and ones both cast alike: the CPU's lists no longer apply to the first
AS_ON_BOTH = {
    "cross_entropy_loss": lambda t: F.cross_entropy(t(3, 4), t.index([0, 1, 3])),
    "cat": lambda t: torch.cat([t(2, 4), t(1, 4, dtype=f32)]),
    "stack": lambda t: torch.stack([t(4), t(4, dtype=f32)]),
    "linalg_eigvalsh": lambda t: torch.linalg.eigvalsh(t(3, 3)),  # bf16 on both: refused by the kernel
    "linear": lambda t: F.linear(t(3, 4, dtype=f32), t(5, 4, dtype=f32), t(5, dtype=f32)),
    "bmm": lambda t: torch.bmm(t(2, 3, 4, dtype=f32), t(2, 4, 5, dtype=f32)),
    "conv2d": lambda t: F.conv2d(t(1, 2, 5, 5, dtype=f32), t(3, 2, 3, 3, dtype=f32)),
    "nll_loss": lambda t: F.nll_loss(t(3, 4), t.index([0, 1, 3])),
    "mse_loss": lambda t: F.mse_loss(t(3, 4), t(3, 4, dtype=f32)),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(*(t(1, 2, 4, 8, dtype=f32),) * 3),
}

# bf16 into an eigensolver: the CPU's autocast would cast it to float32; CUDA's autocast passes it on, and CUDA's
# kernel, like the CPU's, has no bf16
REFUSED_BY_THE_KERNEL = {"linalg_eigvalsh"}


@needs_fake_cuda
@pytest.mark.parametrize("name", sorted(set(CALLS) | set(AS_ON_BOTH)))
def test_each_operator_is_cast_as_cuda_casts_it(name):
    call = {**CALLS, **AS_ON_BOTH}[name]
    cuda_ops, cuda_out = launched(call, "cuda", fake_cuda_autocast)
    cpu_ops, cpu_out = launched(call, "cpu", emulated_autocast)
    if name in REFUSED_BY_THE_KERNEL:  # fake tensors check no dtype support: the CPU's kernel refuses as CUDA's does
        assert cpu_out == ("refused", True)
    else:
        assert cpu_out == cuda_out
    if name not in ("scaled_dot_product_attention", "rms_norm"):  # other operators on each device (fused attention;
        assert cpu_ops == cuda_ops                                     # RMSNorm: CUDA's fused kernel, the CPU's parts)


def test_every_policy_is_called_and_every_cuda_only_kernel_has_one():
    """Every operator with a CUDA autocast kernel the CPU's autocast lacks has a policy here (or runs on cuDNN only),
    which applies (a policy of an operator this torch's CUDA autocast has no kernel for does not: ``rms_norm`` before
    torch 2.14); every policy has a call above (or is a named-dimension overload of one that has, or a CUDA-only
    kernel)."""
    from stability.testing.cuda_autocast import _kernel

    names = [name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("aten::")]
    cuda_only = {name for name in names if _kernel(name, "AutocastCUDA") and not _kernel(name, "AutocastCPU")}
    assert cuda_only <= set(applied_policies()) | NOT_ON_THE_CPU
    assert all(_kernel(name, "AutocastCUDA") for name in applied_policies())
    assert ("rms_norm" in applied_policies()) == _kernel("rms_norm", "AutocastCUDA")
    assert set(CUDA_POLICY) == {name.partition(",")[0] for name in CALLS} | NOT_CALLED
    assert "cross_entropy_loss" in cpu_only() and "layer_norm" not in cpu_only()


def test_outside_the_block_the_cpus_lists_are_back():
    x, weight = torch.rand(3, 4, dtype=torch.bfloat16), torch.ones(4)
    with torch.autocast("cpu", torch.bfloat16):
        with cuda_autocast():
            inside = F.layer_norm(x, (4,), weight, weight).dtype, torch.mv(x.float(), weight).dtype
            with cuda_autocast():  # nested: the outer block's kernels
                nested = F.layer_norm(x, (4,), weight, weight).dtype
        after = F.layer_norm(x, (4,), weight, weight).dtype, torch.mv(x.float(), weight).dtype
    assert inside == (torch.float32, torch.bfloat16) and nested == torch.float32
    assert after == (torch.bfloat16, torch.float32)


def test_the_cpus_lists_are_back_after_a_failure_inside_the_block_or_in_its_registration(monkeypatch):
    from stability.testing import cuda_autocast as module

    x, weight = torch.rand(3, 4, dtype=torch.bfloat16), torch.ones(4)

    def layer_norm_dtype():
        with torch.autocast("cpu", torch.bfloat16):
            return F.layer_norm(x, (4,), weight, weight).dtype

    with pytest.raises(RuntimeError, match="in the block"):
        with cuda_autocast():
            assert layer_norm_dtype() == torch.float32
            raise RuntimeError("in the block")
    assert layer_norm_dtype() == torch.bfloat16
    original = module._policy_kernel

    def failing_after_layer_norm(name, policy):  # the registration fails half done, LayerNorm's policy registered
        if name == "cumsum":
            raise RuntimeError("registration failed")
        return original(name, policy)

    monkeypatch.setattr(module, "_policy_kernel", failing_after_layer_norm)
    with pytest.raises(RuntimeError, match="registration failed") as caught:  # its traceback held, as loggers do
        with cuda_autocast():
            pass
    assert layer_norm_dtype() == torch.bfloat16 and not module._active and caught.traceback


def test_float64_stays_float64():
    x = torch.rand(3, 4, dtype=torch.float64)
    with emulated_autocast():
        assert {x.exp().dtype, torch.mv(x, x[0]).dtype, x.sum().dtype, torch.addcmul(x, x, x).dtype} == {torch.float64}


def test_the_gradient_flows_through_the_casts():
    x = torch.rand(3, 4, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(4, requires_grad=True)
    with emulated_autocast():
        out = F.layer_norm(x, (4,), weight, weight)
    out.sum().backward()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    reference = F.layer_norm(x.detach().float().requires_grad_(), (4,), weight.detach(), weight.detach())
    assert torch.allclose(out, reference, atol=1e-6)


@needs_fake_cuda
@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_vits_forward_launches_what_cudas_autocast_launches(qk_norm):
    """timm's ViT with its explicit attention (the fused kernels are other operators on each device) and, with
    ``qk_norm``, LayerNorms on bf16 queries and keys, which CUDA runs in float32 and the CPU's lists in bf16."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1, num_classes=10,
                              qk_norm=qk_norm)
    for block in model.blocks:
        block.attn.fused_attn = False

    def forward(t):
        net = t.move(model)
        return F.cross_entropy(net(t(2, 3, 8, 8, dtype=f32)), t.index([1, 2]))

    cuda_ops, cuda_out = launched(forward, "cuda", fake_cuda_autocast)
    model.to("cpu")
    cpu_ops, cpu_out = launched(forward, "cpu", emulated_autocast)
    plain_ops, _ = launched(forward, "cpu", lambda: torch.autocast("cpu", torch.bfloat16))
    assert cpu_ops == cuda_ops and cpu_out == cuda_out
    # without the block the CPU's lists apply: the log-softmax of the cross-entropy in float32 (CUDA: bf16), the
    # attention's softmax in bf16 (CUDA: float32), and timm's QK norms in bf16 (CUDA: float32)
    assert plain_ops != cuda_ops

    def bf16_layer_norms(ops):
        return sum(n for (name, dtypes), n in ops.items()
                   if name == "native_layer_norm" and dtypes[0] == torch.bfloat16)

    assert bf16_layer_norms(cuda_ops) == 0 and bf16_layer_norms(plain_ops) == (2 if qk_norm else 0)
