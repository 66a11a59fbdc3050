"""JaSMin: g_k against the exact softmax-Jacobian spectrum (Theorem 4) and the regulariser."""
import re
import warnings

import pytest
import torch

from stability.models import attention_sites, build_backbone, capture_attention
from stability.nn.softmax_bounds import g_k, softmax_jacobian
from stability.stabilizers.jasmin import JaSMin


def random_distributions(n_rows=200, n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    temperatures = torch.logspace(-1, 1.5, n_rows, dtype=torch.float64)[:, None]
    return torch.softmax(torch.randn(n_rows, n, generator=gen, dtype=torch.float64) * temperatures, dim=-1)


def adversarial_distributions(n=12):
    """Two-peak vectors (a, b, rest spread), where σ₁ of M(p) approaches its maximum 1/2."""
    rows = []
    for a in torch.linspace(0.05, 0.95, 19, dtype=torch.float64):
        for rest in (0.0, 1e-3, 0.05):
            b = (1 - a) - rest
            p = torch.zeros(n, dtype=torch.float64)
            p[0], p[1], p[2:] = a, b, rest / (n - 2)
            rows.append(p)
    return torch.stack(rows)


@pytest.mark.parametrize("make", [random_distributions, adversarial_distributions])
def test_g1_bounds_the_exact_softmax_jacobian_norm(make):
    p = make()
    exact = torch.linalg.matrix_norm(softmax_jacobian(p), ord=2)
    g1 = g_k(p, 1)
    assert (g1 >= exact - 1e-12).all()
    assert (g1 <= 0.5 + 1e-12).all()


def test_g1_special_values():
    assert float(g_k(torch.tensor([0.5, 0.5, 0.0, 0.0]), 1)) == pytest.approx(0.5)
    assert float(g_k(torch.tensor([0.0, 1.0, 0.0]), 1)) == 0.0
    assert float(g_k(torch.tensor([0.2, 0.7, 0.1]), 1)) == pytest.approx(0.7 * (1 - 0.7 + 0.2))


def test_interlacing_chain_of_theorem_4():
    p = torch.cat([random_distributions(100, 8, seed=1), adversarial_distributions(8)])
    sigma = torch.linalg.svdvals(softmax_jacobian(p))  # descending
    order = p.sort(dim=-1, descending=True).values
    n = p.shape[-1]
    for k in range(1, n):
        gk = g_k(p, k)
        tol = 1e-12
        assert (order[:, k - 1] >= gk - tol).all()       # x_(k) ≥ g_k
        assert (gk >= sigma[:, k - 1] - tol).all()        # g_k ≥ σ_k
        assert (sigma[:, k - 1] >= order[:, k] - tol).all()  # σ_k ≥ x_(k+1)
    assert sigma[:, -1].abs().max() < 1e-12  # σ_n = 0


def test_g_k_pads_short_rows():
    p = torch.tensor([[0.6, 0.4]])
    assert float(g_k(p, 2)) == pytest.approx(0.4 * (1 - 0.4 + 0.0))


def naive_regulariser(probs_list, batch, k, reduction, eps):
    total = 0.0
    for probs in probs_list:
        windows = probs.shape[0] // batch
        for b in range(batch):
            for h in range(probs.shape[1]):
                rows = probs[b * windows:(b + 1) * windows, h].reshape(-1, probs.shape[-1])
                values = []
                for row in rows:
                    g1 = max(float(g_k(row, 1)), eps)
                    values.append(torch.tensor(g1).log() if k == 0
                                  else torch.tensor(g1 / (float(g_k(row, k)) + eps)).log())
                values = torch.stack(values)
                total += float(values.max() if reduction == "max" else values.mean()) / batch
    return total


@pytest.mark.parametrize("backbone", ["vit", "swin", "cswin"])
@pytest.mark.parametrize("k,reduction", [(0, "mean"), (0, "max"), (3, "mean"), (3, "max")])
def test_regulariser_matches_a_naive_loop(backbone, k, reduction):
    options = {"vit": dict(embed_dim=16, depth=1, num_heads=2),
               "swin": dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2), window_size=2),
               "cswin": dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2))}[backbone]
    net = build_backbone(backbone, img_size=8, in_chans=1, num_classes=3, **options)
    with capture_attention(net) as probs:
        net(torch.rand(3, 1, 8, 8))
    jasmin = JaSMin(lam=1.0, k=k, reduction=reduction)
    got = float(jasmin.regulariser(probs, 3))
    assert got == pytest.approx(naive_regulariser(probs, 3, k, reduction, jasmin.eps), rel=1e-5, abs=1e-6)


def test_lambda_zero_keeps_the_fused_path_and_bad_options_fail():
    assert JaSMin(lam=0).needs_attention_probs is False and JaSMin(lam=1e-3).needs_attention_probs is True
    with pytest.raises(ValueError, match="k must be 0"):
        JaSMin(k=1)
    with pytest.raises(ValueError, match="reduction must be 'max' or 'mean'"):
        JaSMin(reduction="sum")


# ---------------------------------------------------------------- streamed row statistics (ViT)
from stability.models import capture_queries_keys, supports_query_key_capture  # noqa: E402
from stability.nn.row_statistics import (  # noqa: E402
    row_statistics,
    row_statistics_recomputed,
    top_probabilities_streamed,
)
from stability.nn.softmax_bounds import top_probabilities  # noqa: E402
from stability.testing import fake_gpu  # noqa: E402


def test_row_statistics_equal_the_materialised_softmax_and_pass_gradcheck():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(0.7 * q @ k.transpose(-1, -2), dim=-1)
    for block in (1, 5, 64):  # blocks that do and do not divide N
        streamed = top_probabilities_streamed(q, k, 0.7, 4, block=block)
        assert torch.allclose(streamed, top_probabilities(probs, 4), atol=1e-12)
    assert torch.allclose(top_probabilities_streamed(q, k, 0.7, 20), top_probabilities(probs, 20), atol=1e-12)
    torch.autograd.gradcheck(lambda a, b: row_statistics(a, b, 0.7, 3, block=5), (q, k))


def test_row_statistics_blocks_fill_their_budget_and_multiply_fp32_values_in_ieee(monkeypatch):
    """Blocks hold as many rows as the budget's float32 logits allow (all 257 rows of a ViT-S layer at batch 256);
    bf16 queries and keys multiply with the run's TF32 setting (their products are exact there), float32 ones with
    TF32 off: a float32 product under TF32 (a planted error) would round each factor to 10 bits."""
    from stability.nn import row_statistics as module

    q = torch.empty(256, 6, 257, 64, device="meta")
    assert module.block_rows(q, q) == 257
    assert module.block_rows(torch.empty(2, 1, 100, 8), torch.empty(2, 1, 100, 8), budget=4 * 100 * 2 * 10) == 10
    seen = []
    original = torch.Tensor.topk

    def topk(self, *args, **kwargs):  # runs inside the block that multiplies
        seen.append(torch.get_float32_matmul_precision())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", topk)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # training on a GPU
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 2, 9, 8, generator=gen)
        row_statistics(x.bfloat16(), x.bfloat16(), 0.5, 3)
        row_statistics(x, x, 0.5, 3)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == ["high", "highest"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scale", [0.25, 1 / 32 ** 0.5])  # a power of two (q scaled first) and one that is not
def test_the_streamed_top_probabilities_of_bf16_values_equal_float64s(scale, device):
    """bf16 queries and keys: the streamed float32 statistics equal float64's of the same values to float32
    rounding (1e-5 relative: a logit of size |s| rounds by |s|·2⁻²⁴ in float32, and exp(s − LSE) carries it), whatever
    the scale (a scale that is not a power of two is applied to the products, not to q); on a GPU with the LSE from
    the flash kernel (32 wide: SDPA takes flash), end to end."""
    gen = torch.Generator().manual_seed(2)
    q, k = ((3 * torch.randn(2, 3, 40, 32, generator=gen)).bfloat16().to(device) for _ in range(2))
    reference = top_probabilities(torch.softmax(scale * q.double() @ k.double().mT, dim=-1), 6)
    torch.testing.assert_close(top_probabilities_streamed(q, k, scale, 6).double(), reference, rtol=1e-5, atol=1e-9)


# The LSE's gradient goes through whichever SDPA kernel the device picks, with the keys as the values: each kernel is
# held to the same bound. On a CPU, math and flash; on a GPU (marked, skipped here) the four CUDA kernels, TF32 on as
# a GPU training run has it. cuDNN's attention depends on the cuDNN release and the card: skipped where SDPA finds no
# kernel for it.
SDPA_KERNELS = [("cpu", "MATH"), ("cpu", "FLASH_ATTENTION")] + [
    pytest.param("cuda", name, marks=pytest.mark.gpu)
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")]
NO_KERNEL = ("No viable backend", "No available kernel")  # SDPA's refusal on the CPU and on CUDA


def bf16_gradient_bound(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, count: int):
    """The float64 gradient of Σ weights·(top probabilities) in q and k (through the materialised softmax: no SDPA
    kernel), and a bound on each entry's error in bf16: the LSE's part goes through the attention kernel in bf16, whose
    P (and P·K, Pᵀ·(g·Q)) are rounded to 8 bits: at most a few 2⁻⁸ of P·|K| and Pᵀ·|g·Q| (not of |P·K|, which
    cancels); the top logits' part multiplies float32 weights rounded to TF32 (2⁻¹¹); the gradient is returned in
    bf16 (2⁻⁹ of itself)."""
    q, k = q.double().requires_grad_(True), k.double().requires_grad_(True)
    logits = scale * q @ k.mT
    log_sum = logits.logsumexp(-1, keepdim=True)
    top, index = logits.topk(count, dim=-1)
    on_top = weights * (top - log_sum).exp()  # ∂loss/∂top: the top logits' gradient
    on_lse = -on_top.sum(-1, keepdim=True)  # ∂loss/∂LSE
    reference = torch.cat([g.flatten() for g in torch.autograd.grad(on_top.sum(), (q, k))])
    with torch.no_grad():
        probs = torch.softmax(logits, -1)
        sparse = torch.zeros_like(logits).scatter_add_(-1, index, on_top.abs())
        lse_q = scale * on_lse.abs() * (probs @ k.abs())
        lse_k = scale * probs.mT @ (on_lse.abs() * q.abs())
        top_q, top_k = scale * sparse @ k.abs(), scale * sparse.mT @ q.abs()
        bound = torch.cat([(2 ** -6 * lse + 2 ** -9 * top).flatten() for lse, top in ((lse_q, top_q), (lse_k, top_k))])
    return reference, bound + 2 ** -8 * reference.abs()


@pytest.mark.parametrize("device, kernel", SDPA_KERNELS)
@pytest.mark.parametrize("seed", [1, 14])  # 14: the seed where a bound relative to the largest entry failed
def test_the_bf16_gradient_is_within_bf16_rounding_and_a_dropped_term_is_not(device, kernel, seed, monkeypatch):
    """bf16 queries and keys (as under bf16-mixed), TF32 on: each entry of the gradient within the bound of
    :func:`bf16_gradient_bound` of the float64 gradient of the same values, on every SDPA kernel; the gradient without
    the LSE's part (a planted error) exceeds it by 4× somewhere."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stability.nn import row_statistics as module
    from stability.nn.precision import allow_tf32_training

    gen = torch.Generator().manual_seed(seed)
    q, k = ((2 * torch.randn(2, 3, 33, 16, generator=gen)).bfloat16().to(device) for _ in range(2))
    weights = torch.randn(2, 3, 33, 6, generator=gen, dtype=torch.float64).to(device)

    def gradient(a, b):
        a, b = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
        (top_probabilities_streamed(a, b, 0.25, 6).double() * weights).sum().backward()
        return torch.cat([a.grad.double().flatten(), b.grad.double().flatten()])

    reference, bound = bf16_gradient_bound(q, k, weights, 0.25, 6)
    precision, convolutions = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    allow_tf32_training()
    try:
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            try:
                streamed = gradient(q, k)
            except RuntimeError as error:
                if kernel == "CUDNN_ATTENTION" and any(message in str(error) for message in NO_KERNEL):
                    pytest.skip(f"cuDNN attention cannot run here: {str(error)[:120]}")
                raise
            worst = float(((streamed - reference).abs() / bound).max())
            assert worst <= 1, worst
            original = module.F.scaled_dot_product_attention
            monkeypatch.setattr(module.F, "scaled_dot_product_attention", lambda *a, **kw: 0 * original(*a, **kw))
            assert float(((gradient(q, k) - reference).abs() / bound).max()) > 4
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = convolutions


@pytest.mark.parametrize("block", [5, 64])
@pytest.mark.parametrize("used", ["lse", "top", "both"])
def test_the_streamed_gradient_of_either_statistic_alone_equals_the_materialised_one(block, used):
    """An unused output's gradient reaches the backward as None (no zero tensor is made for it): the gradient of the
    LSE alone, of the top logits alone, and of both equal autograd's through the materialised logits (float64)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    on_lse, on_top = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64), torch.randn(2, 3, 13, 3,
                                                                                              generator=gen,
                                                                                              dtype=torch.float64)

    def gradient(lse, top):
        loss = {"lse": (lse * on_lse).sum(), "top": (top * on_top).sum()}
        total = loss["lse"] + loss["top"] if used == "both" else loss[used]
        return torch.cat([g.flatten() for g in torch.autograd.grad(total, (q, k))])

    logits = 0.7 * q @ k.transpose(-1, -2)
    want = gradient(logits.logsumexp(-1), logits.topk(3, dim=-1).values)
    torch.testing.assert_close(gradient(*row_statistics(q, k, 0.7, 3, block=block)), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("statistics", [row_statistics, row_statistics_recomputed])
@pytest.mark.parametrize("columns", [(0, 1, 4, 5), (0, 1, 1, 2), (0, 1, 2, 3), (3,)])
def test_the_top_logits_at_chosen_columns_and_their_gradient_equal_those_of_all(statistics, columns):
    """``columns`` (JaSMin's g₁ and g_k read four of the k + 1 top logits): the same LSE, the chosen top logits
    exactly, and the gradient of a loss on them equal (1e-12, float64) to the gradient through all ``count`` top
    logits with the loss's weights placed in those columns (a repeated column adding its weights; one run of
    columns returned as a slice, several joined); the same weights placed one column off (a planted error) differ."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    on_lse = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64)
    on_top = torch.randn(2, 3, 13, len(columns), generator=gen, dtype=torch.float64)

    def gradient(weights, chosen=None):  # statistics made afresh each time (a checkpoint's backward runs once)
        lse, top = statistics(q, k, 0.7, 6, block=5, columns=chosen)
        loss = (lse * on_lse).sum() + (top * weights).sum()
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, (q, k))])

    def placed(shift=0):  # the chosen columns' weights in a (…, count) tensor, a repeated column's added
        weights = torch.zeros(2, 3, 13, 6, dtype=torch.float64)
        for position, column in enumerate(columns):
            weights[..., min(column + shift, 5)] += on_top[..., position]
        return weights

    lse_all, top_all = statistics(q, k, 0.7, 6, block=5)
    lse, top = statistics(q, k, 0.7, 6, block=5, columns=columns)
    assert top.shape == (2, 3, 13, len(columns))
    assert torch.equal(lse, lse_all) and torch.equal(top, top_all[..., list(columns)])
    got = gradient(on_top, columns)
    torch.testing.assert_close(got, gradient(placed()), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, gradient(placed(shift=1)), rtol=1e-6, atol=1e-6)
    if statistics is row_statistics:
        torch.autograd.gradcheck(lambda a, b: statistics(a, b, 0.7, 6, block=5, columns=columns), (q, k))


def test_probabilities_at_chosen_columns_past_the_keys_are_zero_and_bad_columns_are_refused():
    """Positions at M or past it (fewer keys than the top count) are probability 0, as the padded top probabilities
    are; every position past M: all zeros. Columns out of range, out of order or none are refused, naming them."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    probs = torch.softmax(0.7 * q @ k.transpose(-1, -2), dim=-1)
    for recomputed in (False, True):
        got = top_probabilities_streamed(q, k, 0.7, 11, recomputed=recomputed, columns=(0, 1, 9, 10))
        assert torch.allclose(got, top_probabilities(probs, 11)[..., [0, 1, 9, 10]], atol=1e-12)
        assert float(got[..., 2:].abs().max()) == 0 and float(got[..., :2].min()) > 0
        zeros = top_probabilities_streamed(q, k, 0.7, 11, recomputed=recomputed, columns=(6, 10))
        assert zeros.shape == (2, 3, 7, 2) and float(zeros.abs().max()) == 0
        with pytest.raises(ValueError, match="need the same leading dimensions"):  # checked before the zeros, too
            top_probabilities_streamed(q, k.transpose(0, 1), 0.7, 11, recomputed=recomputed, columns=(6, 10))
        with pytest.raises(ValueError, match="need N, M and d"):
            top_probabilities_streamed(q, k[..., :0, :], 0.7, 11, recomputed=recomputed, columns=(6, 10))
    for bad in [(2, 1), (-1,), (6,), ()]:
        with pytest.raises(ValueError, match=r"columns must be positions 0\.\.5 among the top 6 logits"):
            row_statistics(q, k.expand(2, 3, 5, 4).repeat(1, 1, 2, 1), 0.7, 6, columns=bad)


def test_streamed_jasmin_scatters_only_the_four_top_logits_it_reads():
    """k = 10 reads the 1st, 2nd, 10th and 11th largest probabilities of each row: the backward scatters those four
    a row (not all eleven, seven with zero weights), and no gradient of the eleven is assembled from selections.
    Counted as a GPU step counts them; the statistics of all eleven columns (a planted regression) fail."""
    from stability.testing.gpu_model import KernelCounter

    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 17, 3, 2, 8, generator=gen).bfloat16().permute(2, 0, 3, 1, 4)
    q, k = (x.detach().requires_grad_(True) for x in qkv[:2])
    jasmin = JaSMin(lam=1.0, k=10)

    class Scatters(KernelCounter):
        def __init__(self):
            super().__init__()
            self.widths = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.scatter_add_:
                self.widths.append(args[2].shape[-1])
            return super().__torch_dispatch__(func, types, args, kwargs)

    def counted(loss):
        with Scatters() as counter:
            loss().backward()
        return counter

    def all_eleven():  # the statistics of every top logit, g₁ and g_k selected from them
        return jasmin.scores_of_top(top_probabilities_streamed(q, k, 0.25, jasmin.top_count)).mean(-1).sum(-1).mean()

    fewer = counted(lambda: jasmin.regulariser_streamed([(q, k, 0.25)], 2))
    assert fewer.widths == [4] and not fewer.counts.ops.get("select_backward"), fewer.counts.ops
    everything = counted(all_eleven)
    assert everything.widths == [11] and everything.counts.launches > fewer.counts.launches
    assert everything.counts.bytes > fewer.counts.bytes


def test_row_statistics_refuse_queries_and_keys_of_other_leading_shapes():
    """Flattened into one batch, q (3, 2, N, d) and k (2, 3, M, d) would pair the wrong rows silently: refused."""
    q, k = torch.randn(3, 2, 5, 4), torch.randn(2, 3, 7, 4)
    with pytest.raises(ValueError, match=r"same leading dimensions and d; got \(3, 2, 5, 4\) and \(2, 3, 7, 4\)"):
        row_statistics(q, k, 0.5, 2)
    assert row_statistics(q, k.transpose(0, 1), 0.5, 2)[1].shape == (3, 2, 5, 2)


@pytest.mark.parametrize("statistics", [row_statistics, row_statistics_recomputed])
@pytest.mark.parametrize("q_shape, k_shape", [((2, 0, 4), (2, 5, 4)), ((2, 3, 4), (2, 0, 4)),
                                              ((2, 3, 0), (2, 5, 0))])
def test_row_statistics_refuse_no_rows_keys_or_dimensions_and_keep_an_empty_batch(statistics, q_shape, k_shape):
    """No query row, no key (a row's LSE over nothing is −∞) or no dimension: a clear error with both shapes, with or
    without an explicit block (the streamed statistics failed in an index, a reshape or a division by zero). An empty
    batch gives empty statistics and an empty gradient."""
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    for block in (None, 3):
        with pytest.raises(ValueError, match=re.escape(f"got {q_shape} and {k_shape}")):
            statistics(q, k, 0.5, 2, block=block)
    q, k = (torch.randn(0, 3, n, 4, requires_grad=True) for n in (5, 7))
    for block in (None, 3):
        lse, top = statistics(q, k, 0.5, 2, block=block)
        assert lse.shape == (0, 3, 5) and top.shape == (0, 3, 5, 2)
        (lse.sum() + top.sum()).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_the_streamed_statistics_copy_nothing_of_the_attention_size(monkeypatch):
    """On an attention's permuted bf16 queries and keys, one block: the forward casts q and k once (contiguous, so no
    product copies them again), the backward makes no zero tensor and no copy: the attention kernel takes q and k as
    they came, and the gradients' last sums write them in bf16 (``out=``). Counted as a GPU step counts them; the
    earlier code (seven casts: q and k back to bf16, the weighted queries, the gradients) fails. The LSE from one
    fused log-softmax (a read and a write of the logits, not logsumexp's six passes on CUDA); where CUDA's flash kernel
    gives it (the count's stand-in, the CPU's flash kernel on the same q and k), no pass over the logits at all."""
    from stability.nn import row_statistics as module
    from stability.testing.gpu_model import count

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 9, 3, 2, 8, generator=gen).bfloat16().permute(2, 0, 3, 1, 4)  # timm's (3, B, H, N, d)
    q, k = (x.detach().requires_grad_(True) for x in qkv[:2])
    weights = torch.randn(2, 2, 9, 4, generator=gen)

    def step():
        (top_probabilities_streamed(q, k, 0.25, 4) * weights).sum().backward()

    ops = count(step).ops
    assert ops["_to_copy"] == 2, ops  # the forward's q and k, to float32
    assert not {"clone", "zeros_like", "zeros", "copy_", "empty_like"} & {name for name, n in ops.items() if n}, ops
    assert ops["new_zeros"] == 1 and ops["scatter_add_"] == 1  # the top logits' one sparse block
    assert ops["_log_softmax"] == 1 and not ops["amax"] and not ops["exp_"], ops
    assert ops["_scaled_dot_product_flash_attention_for_cpu"] == 1  # the backward's P·K
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    monkeypatch.setattr(module, "attention_lse", lambda a, b, scale: flash(a, b, b, scale=scale)[1])
    fused = count(step).ops
    assert not fused["_log_softmax"] and fused["_scaled_dot_product_flash_attention_for_cpu"] == 2, fused
    assert fused["_to_copy"] == 2 and fused["maximum"] == 1, fused


def exact_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """The rows' LSE in float64, rounded once to float32: a stand-in for CUDA's flash kernel as exact as it can be."""
    return (scale * q.double() @ k.double().mT).logsumexp(-1).float()


@pytest.mark.parametrize("scale", [0.25, 1 / 32 ** 0.5])
def test_an_lse_from_the_attention_kernel_gives_the_same_statistics_and_gradient(scale, monkeypatch):
    """Where the attention kernel gives the rows' LSE (CUDA's flash kernel; here an exact stand-in), bf16 queries and
    keys give the top probabilities of float64 to float32 rounding, and their gradient within the bf16 bound of the
    log-softmax path (:func:`bf16_gradient_bound`); an LSE off by 1e-4 (a planted error) fails; an LSE below the
    largest logit (rounding in a row that one key dominates) is raised to it: no probability above 1. Float32 and
    float64 values never ask the kernel (their products are IEEE float32 at least, the kernel's are not)."""
    from stability.nn import row_statistics as module

    gen = torch.Generator().manual_seed(2)
    q, k = ((3 * torch.randn(2, 3, 40, 32, generator=gen)).bfloat16() for _ in range(2))
    weights = torch.randn(2, 3, 40, 6, generator=gen)
    reference = top_probabilities(torch.softmax(scale * q.double() @ k.double().mT, dim=-1), 6)

    def run():
        a, b = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        top = top_probabilities_streamed(a, b, scale, 6)
        (top * weights).sum().backward()
        return top.detach(), torch.cat([a.grad.float().flatten(), b.grad.float().flatten()])

    monkeypatch.setattr(module, "attention_lse", exact_lse)
    top, gradient = run()
    torch.testing.assert_close(top.double(), reference, rtol=1e-5, atol=1e-9)
    reference_gradient, bound = bf16_gradient_bound(q, k, weights.double(), scale, 6)
    assert float(((gradient.double() - reference_gradient).abs() / bound).max()) <= 1
    monkeypatch.setattr(module, "attention_lse", lambda a, b, s: exact_lse(a, b, s) + 1e-4)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run()[0].double(), reference, rtol=1e-5, atol=1e-9)
    monkeypatch.setattr(module, "attention_lse", lambda a, b, s: exact_lse(a, b, s) - 1.0)
    assert float(run()[0].max()) <= 1.0

    def refuse(*args):
        raise AssertionError("asked the attention kernel for float32 or float64 values")

    monkeypatch.setattr(module, "attention_lse", refuse)
    for dtype in (torch.float32, torch.float64):
        top_probabilities_streamed(q.to(dtype), k.to(dtype), scale, 6)


@pytest.mark.skipif(not fake_gpu.SUPPORTED, reason="fake CUDA tensors without a GPU need torch >= 2.11")
@pytest.mark.parametrize("flash", [True, False, "changed"])
def test_the_cuda_branch_runs_on_fake_cuda_tensors(flash, monkeypatch):
    """The forward's CUDA branch, run on fake CUDA tensors of a ViT-S layer (no GPU: shapes, dtypes and the private
    operator's signature, which no CPU run reaches otherwise): where SDPA's check takes flash attention (patched:
    the real check asks the card), the LSE is the flash kernel's, float32 (B, H, N), and no log-softmax runs; where
    the check refuses it, or the width is one SDPA pads (60), the log-softmax gives it; where a torch changed the
    private API (a TypeError), a warning says so and the log-softmax gives it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stability.nn import row_statistics as module

    asked, fallbacks = [], []
    original = module._lse_top_and_index
    def check(params, debug=False):
        asked.append(params)
        if flash == "changed":
            raise TypeError("SDPAParams(): incompatible constructor arguments")
        return flash

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", check)
    monkeypatch.setattr(module, "_lse_top_and_index", lambda *a: fallbacks.append(a) or original(*a))
    with fake_gpu.fake_h200(), FakeTensorMode(), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for width in (64, 60):
            q, k = (torch.empty(4, 6, 257, width, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            lse, top = row_statistics(q, k, 0.125, 11)
            assert lse.shape == (4, 6, 257) and lse.dtype == torch.float32 and lse.device.type == "cuda"
            assert top.shape == (4, 6, 257, 11) and top.dtype == torch.float32
            # JaSMin's four columns (the forward: autograd's engine asks a real device for a backward)
            lse, top = row_statistics(q, k, 0.125, 11, columns=(0, 1, 9, 10))
            assert lse.shape == (4, 6, 257) and top.shape == (4, 6, 257, 4) and top.dtype == torch.float32
    assert len(asked) == 2  # the width of 60 is not asked: SDPA pads it before its flash call
    assert len(fallbacks) == (2 if flash is True else 4)
    assert any("flash kernel's log-sum-exp is unavailable" in str(w.message) for w in warned) == (flash == "changed")


def lse_error_in_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of ``got`` against the float64 ``want``, in float32 ulps of max(|LSE|, 1)."""
    ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1))))
    return float(((got.double() - want).abs() / ulp).max())


LSE_ULPS = 8  # float32's logsumexp errs by ≈ 1-2 ulps; a flash kernel's approximate exp2 and log add a few


def bf16_queries_and_keys(spread: float, device: str = "cpu", width: int = 64):
    gen = torch.Generator().manual_seed(3)
    return [(spread * torch.randn(4, 6, 257, width, generator=gen)).bfloat16().to(device) for _ in range(2)]


@pytest.mark.parametrize("spread", [1.0, 3.0])
def test_the_lse_tolerance_passes_float32s_logsumexp_and_fails_the_cpus_flash_kernel(spread):
    """The GPU test's bound on the flash kernel's LSE (below), calibrated here: float32's own logsumexp of the same
    bf16 values is within it; the CPU's flash kernel (2⁻¹⁴ of the LSE on bf16 inputs, which the statistics refuse) and
    an LSE 4e-5 off are not."""
    q, k = bf16_queries_and_keys(spread)
    want = (0.125 * q.double() @ k.double().mT).logsumexp(-1)
    float32 = (0.125 * q.float() @ k.float().mT).logsumexp(-1)
    assert lse_error_in_ulps(float32, want) <= LSE_ULPS
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, scale=0.125)[1]
    assert lse_error_in_ulps(cpu_flash, want) > LSE_ULPS
    assert lse_error_in_ulps(float32 + 4e-5, want) > LSE_ULPS


@pytest.mark.gpu
def test_the_flash_kernels_lse_is_float32s_and_a_wrong_scale_is_not():
    """On CUDA, bf16 queries and keys of a ViT head (64 wide): the flash kernel gives the rows' LSE within
    ``LSE_ULPS`` float32 ulps of float64's of the same values (the bound float32's logsumexp meets and the CPU's flash
    kernel fails, above); with the scale off by 1e-4 or the LSE 4e-5 off (planted errors) it is not. A width SDPA
    would pad (not a multiple of 8) and float32 values are refused (None)."""
    from stability.nn.row_statistics import attention_lse

    for spread in (1.0, 3.0):
        q, k = bf16_queries_and_keys(spread, "cuda")
        want = (0.125 * q.double() @ k.double().mT).logsumexp(-1)
        got = attention_lse(q, k, 0.125)
        assert lse_error_in_ulps(got, want) <= LSE_ULPS
        assert lse_error_in_ulps(got + 4e-5, want) > LSE_ULPS
        assert lse_error_in_ulps(attention_lse(q, k, 0.125 * (1 + 1e-4)), want) > LSE_ULPS
    assert attention_lse(q[..., :60], k[..., :60], 0.125) is None
    assert attention_lse(q.float(), k.float(), 0.125) is None


@pytest.mark.parametrize("k,reduction", [(0, "mean"), (0, "max"), (2, "max"), (3, "mean"), (10, "mean"),
                                         (20, "max")])
def test_streamed_jasmin_equals_the_materialised_loss_and_gradient_on_vit(k, reduction):
    """Same loss and same gradient for every parameter, with the fused attention path kept (k = 20: fewer keys than
    k + 1, its k-th and (k+1)-th probabilities zero)."""
    torch.manual_seed(0)
    net = build_backbone("vit", img_size=8, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2).double()
    images = torch.rand(4, 1, 8, 8, dtype=torch.float64)
    assert supports_query_key_capture(net) and all(s.module.fused_attn for s in attention_sites(net))
    jasmin = JaSMin(lam=1.0, k=k, reduction=reduction)

    with capture_attention(net) as probs:
        net(images)
    materialised = jasmin.regulariser(probs, 4)
    reference = torch.autograd.grad(materialised, list(net.parameters()), allow_unused=True)

    with capture_queries_keys(net) as queries_keys:
        net(images)
    assert len(queries_keys) == 2 and all(s.module.fused_attn for s in attention_sites(net))
    streamed = jasmin.regulariser_streamed(queries_keys, 4)
    grads = torch.autograd.grad(streamed, list(net.parameters()), allow_unused=True)
    assert float(streamed) == pytest.approx(float(materialised), rel=1e-10)
    for got, want in zip(grads, reference):
        if want is None:
            assert got is None or float(got.abs().max()) == 0
        else:
            assert torch.allclose(got, want, rtol=1e-7, atol=1e-10)


def test_the_recomputed_row_statistics_and_their_gradient_equal_the_materialised_logits(monkeypatch):
    """The compiled graph's statistics (recomputed in the backward): the materialised softmax's top probabilities to
    1e-12 in float64 for blocks that do and do not divide N, and the gradient of random weightings of the LSE and
    the top logits equal autograd's through the materialised logits, to 1e-12; a planted error in the
    recomputation (its keys off by 1e-6, the forward's right) fails. (A region under selective checkpointing takes
    one backward, as a training step does: gradcheck's repeated backward is refused.)"""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [(torch.randn(2, 3, 13, generator=gen, dtype=torch.float64),
                torch.randn(2, 3, 13, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]

    def gradient(statistics, on_lse, on_top):
        lse, top = statistics(q, k)
        return torch.cat([g.flatten() for g in torch.autograd.grad((lse * on_lse).sum() + (top * on_top).sum(),
                                                                   (q, k))])

    def materialised(a, b):
        logits = 0.7 * a @ b.transpose(-1, -2)
        return logits.logsumexp(-1), logits.topk(3, dim=-1).values

    probs = torch.softmax(0.7 * q @ k.transpose(-1, -2), dim=-1)
    for block in (1, 5, 64):
        streamed = top_probabilities_streamed(q, k, 0.7, 4, block=block, recomputed=True)
        assert torch.allclose(streamed, top_probabilities(probs, 4), atol=1e-12)
        for on_lse, on_top in weights:
            got = gradient(lambda a, b, n=block: row_statistics_recomputed(a, b, 0.7, 3, block=n), on_lse, on_top)
            torch.testing.assert_close(got, gradient(materialised, on_lse, on_top), rtol=1e-12, atol=1e-12)
    assert torch.allclose(top_probabilities_streamed(q, k, 0.7, 20, recomputed=True), top_probabilities(probs, 20),
                          atol=1e-12)  # more than M: zero-padded
    from stability.nn import row_statistics as module

    calls, statistics = [], module._block_statistics

    def stale_on_recompute(a, b, *args):  # calls 4-6 are the backward's recomputations (three blocks)
        calls.append(1)
        return statistics(a, b + (1e-6 if len(calls) > 3 else 0.0), *args)

    monkeypatch.setattr(module, "_block_statistics", stale_on_recompute)
    got = gradient(lambda a, b: row_statistics_recomputed(a, b, 0.7, 3, block=5), *weights[0])
    monkeypatch.undo()
    assert len(calls) == 6  # three blocks, each run twice
    assert not torch.allclose(got, gradient(materialised, *weights[0]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("k,reduction", [(0, "mean"), (10, "max")])
def test_compiled_jasmin_equals_the_materialised_loss_and_gradient_on_vit(k, reduction, dtype, rtol):
    """JaSMin trained compiled (its statistics one compiled graph, recomputed backward) against the eager
    materialised maps: the same loss and every parameter's gradient, 1e-10 in float64, 1e-5 relative in float32."""
    torch.manual_seed(0)
    net = build_backbone("vit", img_size=8, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2).to(dtype)
    images = torch.rand(4, 1, 8, 8, dtype=dtype)
    jasmin = JaSMin(lam=1.0, k=k, reduction=reduction)
    jasmin.compile_terms()
    with capture_attention(net) as probs:
        net(images)
    materialised = jasmin.regulariser(probs, 4)
    reference = torch.autograd.grad(materialised, list(net.parameters()), allow_unused=True)
    torch._dynamo.reset()
    with capture_queries_keys(net) as queries_keys:
        net(images)
    compiled = jasmin.regulariser_compiled(queries_keys)
    grads = torch.autograd.grad(compiled, list(net.parameters()), allow_unused=True)
    assert compiled.dtype == dtype
    assert float(compiled) == pytest.approx(float(materialised), rel=rtol)
    scale = max(float(g.abs().max()) for g in reference if g is not None)
    for got, want in zip(grads, reference):
        if want is None:
            assert got is None or float(got.abs().max()) == 0
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


def test_the_compiled_statistics_of_float32_values_multiply_in_ieee(monkeypatch):
    """A compiled graph cannot set torch's matmul precision: the compiled statistics are called with IEEE float32
    for float32 queries and keys, and at the run's TF32 setting for bf16 ones (their products exact there)."""
    jasmin = JaSMin(lam=1.0)
    jasmin.compile_terms()
    seen = []
    jasmin._compiled_regulariser = lambda qk: seen.append(torch.get_float32_matmul_precision()) or torch.zeros(())
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # training on a GPU
    try:
        x = torch.randn(2, 2, 5, 4)
        jasmin.regulariser_compiled([(x.bfloat16(), x.bfloat16(), 0.5)])
        jasmin.regulariser_compiled([(x, x, 0.5)])
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == ["high", "highest"]


def test_float32_statistics_compile_only_where_no_product_takes_tf32():
    """A compiled backward runs at the run's precision: float32 queries and keys (an fp32 run, or timm's qk_norm
    under autocast) take the compiled graph only where float32 products are IEEE (the CPU, or highest precision on a
    GPU), else the eager statistics; bf16 pairs always compile, a pair of mixed dtypes counts as float32."""
    from stability.stabilizers.jasmin import exact_in_tf32, tf32_products

    x = torch.zeros(1)
    assert exact_in_tf32([(x.bfloat16(), x.bfloat16()), (x.half(), x.half())])
    assert not exact_in_tf32([(x.bfloat16(), x.bfloat16()), (x, x)])
    assert not exact_in_tf32([(x.bfloat16(), x)])
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert tf32_products("cuda") and not tf32_products("cpu")
        torch.set_float32_matmul_precision("highest")
        assert not tf32_products("cuda")
    finally:
        torch.set_float32_matmul_precision(previous)


def test_row_statistics_choice_follows_the_backbone():
    from stability.models import Network

    def network(backbone, **options):
        return Network(build_backbone(backbone, img_size=8, in_chans=1, num_classes=3, **options), [0.5], [0.5], 8)

    vit = network("vit", embed_dim=16, depth=1, num_heads=2)
    swin = network("swin", embed_dim=16, depths=(1, 1), num_heads=(2, 2), window_size=2)
    auto = JaSMin(lam=1e-2)
    auto.prepare(vit)
    auto.on_device(torch.device("cpu"))  # the CPU: materialised (faster there)
    assert not auto.streamed and auto.needs_attention_probs and not auto.needs_queries_keys
    auto.on_device(torch.device("cuda"))  # CUDA: streamed, fused attention kept
    assert auto.streamed and auto.needs_queries_keys and not auto.needs_attention_probs
    streamed = JaSMin(lam=1e-2, row_statistics="streamed")
    streamed.prepare(vit)
    streamed.on_device(torch.device("cpu"))
    assert streamed.streamed and streamed.needs_queries_keys
    on_swin = JaSMin(lam=1e-2)
    on_swin.prepare(swin)
    on_swin.on_device(torch.device("cuda"))
    assert not on_swin.streamed and on_swin.needs_attention_probs
    forced = JaSMin(lam=1e-2, row_statistics="materialized")
    forced.prepare(vit)
    assert not forced.streamed and forced.needs_attention_probs
    with pytest.raises(ValueError, match="row_statistics='streamed' needs plain ViT attention"):
        JaSMin(lam=1e-2, row_statistics="streamed").prepare(swin)
    with pytest.raises(ValueError, match="row_statistics must be"):
        JaSMin(row_statistics="lazy")
