"""The attention adapters' head split (stability/models/adapters.py, ``heads_of``) against timm's: the same q, k and v
(values and strides), bit-for-bit the same gradients, a pass over the qkv gradient fewer (counted as a GPU runs it);
a wrong split fails."""
import pytest
import torch

from stability.models.adapters import heads_of
from stability.testing.gpu_model import count

BATCH, TOKENS, HEADS, WIDTH = 4, 17, 2, 8


def timm_heads(qkv: torch.Tensor, heads: int, width: int):
    """timm's ``Attention``: ``reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4)``, unbound."""
    b, n, _ = qkv.shape
    return qkv.reshape(b, n, 3, heads, width).permute(2, 0, 3, 1, 4).unbind(0)


def heads_and_gradient(split, dtype=torch.float64, heads=HEADS, width=WIDTH):
    """q, k, v from a projection's output and the gradient of a weighted sum of them (distinct weights per part) in
    the projection's input."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, TOKENS, 3 * heads * width, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(3 * heads * width, 3 * heads * width, generator=gen, dtype=dtype)
    upstream = [torch.randn(BATCH, heads, TOKENS, width, generator=gen, dtype=dtype) for _ in range(3)]
    parts = split(x @ weight, heads, width)
    (gradient,) = torch.autograd.grad(sum((p * u).sum() for p, u in zip(parts, upstream)), x)
    return [p.detach() for p in parts], gradient


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_heads_of_gives_timms_views_and_gradients(dtype):
    got, got_gradient = heads_and_gradient(heads_of, dtype)
    want, want_gradient = heads_and_gradient(timm_heads, dtype)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (BATCH, HEADS, TOKENS, WIDTH) and a.stride() == b.stride()
        assert torch.equal(a, b)
    assert torch.equal(got_gradient, want_gradient)


def test_a_wrong_split_fails():
    """Heads and width swapped (the same sizes: h = d), or q and k exchanged: the parts or the gradient differ."""
    want, want_gradient = heads_and_gradient(timm_heads, heads=4, width=4)

    def swapped(qkv, heads, width):
        b, n, _ = qkv.shape
        return tuple(p.transpose(1, 2) for p in qkv.reshape(b, n, 3, width, heads).transpose(-1, -2).unbind(2))

    def exchanged(qkv, heads, width):
        q, k, v = heads_of(qkv, heads, width)
        return k, q, v

    assert all(torch.equal(a, b) for a, b in zip(heads_and_gradient(heads_of, heads=4, width=4)[0], want))
    for planted in (swapped, exchanged):
        got, gradient = heads_and_gradient(planted, heads=4, width=4)
        assert not all(torch.equal(a, b) for a, b in zip(got, want)) and not torch.equal(gradient, want_gradient)


def test_heads_of_gathers_the_gradient_in_one_pass():
    """Counted as a GPU runs it: timm's split stacks the three gradients head-major and copies the result to the
    projection's layout (a ``clone``: 2 passes over the qkv gradient); ``heads_of`` stacks them in that layout."""
    x = torch.randn(BATCH, TOKENS, 3 * HEADS * WIDTH, requires_grad=True)

    def step(split):
        def run():
            q, k, v = split(x * 1.0, HEADS, WIDTH)
            (q + 2 * k + 3 * v).sum().backward()
        x.grad = None
        return count(run)

    timm, ours = step(timm_heads), step(heads_of)
    assert timm.ops["clone"] == 1 and "clone" not in ours.ops
    assert ours.launches == timm.launches - 1
    assert timm.bytes - ours.bytes == pytest.approx(2 * x.nbytes, rel=0.01)


@pytest.mark.parametrize("masked", [False, True])
def test_window_attention_with_a_head_width_other_than_dim_over_heads(masked):
    """Swin's ``WindowAttention`` with head_dim 8 for a width of 16 and 4 heads (so 3·h·d = 96, not 3·16): the adapter
    (head width from the projection, heads taken by ``heads_of``) equals timm's module, output and every gradient, in
    float64, with and without a shift mask."""
    from timm.models.swin_transformer import WindowAttention

    from stability.models.adapters import KernelWindowAttention
    from stability.nn.dot_attention import DotProductKernel

    torch.manual_seed(0)
    original = WindowAttention(16, num_heads=4, head_dim=8, window_size=2).double().eval()
    adapter = KernelWindowAttention(original, DotProductKernel(original.scale)).eval()
    x = torch.randn(6, 4, 16, dtype=torch.float64)  # 2 images × 3 windows of 2 × 2 tokens
    mask = torch.zeros(3, 4, 4, dtype=torch.float64)
    mask[1, :2, 2:] = mask[1, 2:, :2] = -100.0  # a shifted window's two regions
    results = []
    for module in (original, adapter):
        leaf = x.clone().requires_grad_(True)
        out = module(leaf, mask if masked else None)
        parameters = [p for p in original.parameters()]
        gradients = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(),
                                        [leaf, *parameters])
        results.append([out, *gradients])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert adapter.head_dim == 8
