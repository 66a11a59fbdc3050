"""The CPU model of a GPU step (stability/testing/gpu_model.py): the counter counts what it says — a matrix
product's FLOPs by the precision it runs in, no launch for a view or an allocation, the other operators' bytes —
the extrapolation over depth and batch is exact, the CUDA path is taken on the CPU, and the fit recovers constants
that made the data (and fails to when the data are made by another form)."""
import math
from collections import Counter

import numpy as np
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.nn.precision import ieee_float32
from stability.testing.fused_rms_norm import counted_as_on_cuda
from stability.testing.gpu_model import (
    GpuModel,
    KernelCounter,
    StepCounts,
    composite_on_cuda,
    count,
    cuda_path,
    extrapolate,
    fit,
    leave_one_out,
    norm_rows,
)


def test_a_matrix_product_is_counted_by_its_precision_and_a_view_launches_nothing():
    a, b = torch.randn(8, 16), torch.randn(16, 4)

    def step():
        (a @ b).t().unsqueeze(0)  # mm, then two views
        a.clone().t_().unsqueeze_(0).squeeze_(0)  # a copy, then three in-place views (metadata: no kernel on CUDA)
        torch.relu(a)  # 8·16 floats in and out
        torch.promote_types(a.dtype, torch.float32), torch.can_cast(a.dtype, torch.int32)  # dtype arithmetic: host

    torch.set_float32_matmul_precision("high")
    try:
        training = count(step)
        with ieee_float32():
            exact = count(step)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert training.launches == 3 and training.ops == {"mm": 1, "relu": 1, "clone": 1}
    assert training.flops["tf32"] == 2 * 8 * 16 * 4 and exact.flops["fp32"] == 2 * 8 * 16 * 4
    assert training.bytes == 2 * (2 * 8 * 16 * 4)  # relu's and clone's 8·16 floats in and out
    with torch.autocast("cpu", torch.bfloat16):
        half = count(lambda: a @ b)
    assert half.flops["bf16"] == 2 * 8 * 16 * 4 and half.ops["_to_copy"] == 2  # autocast's casts are launches


def test_the_fused_attention_is_counted_as_one_kernel_with_its_flops():
    q = k = v = torch.randn(2, 3, 16, 8, requires_grad=True)
    counts = count(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward())
    assert counts.ops["_scaled_dot_product_flash_attention_for_cpu"] == 1
    forward = 4 * 2 * 3 * 16 * 16 * 8  # QKᵀ and PV, 2 FLOPs a multiply-add
    assert counts.flops["fp32"] + counts.flops["tf32"] == pytest.approx(forward * 3.5)  # backward 2.5 × forward


def _copies_the_profiler_sees(step) -> int:
    """The ``aten::copy_`` that torch's profiler records inside a ``baddbmm`` (its meta function's copy, which every
    device runs) during ``step()``."""
    from torch.profiler import profile

    with profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name == "aten::copy_" and e.cpu_parent is not None
               and e.cpu_parent.name == "aten::baddbmm")


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_a_products_copy_of_its_input_is_counted_where_cuda_makes_it():
    """A ``baddbmm`` or ``addmm`` with β ≠ 0 copies its input into the result inside itself, a kernel no dispatch
    mode sees. baddbmm's copy is in its meta function, which the CPU runs too: the count equals what torch's profiler
    sees, over a Newton–Schulz iteration. addmm's bias in cuBLASLt's epilogue (nn.Linear's) copies nothing on CUDA;
    neither does β = 0 nor a product in place."""
    from stability.nn import constraints

    x = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(0))
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    step = lambda: constraints.newton_schulz(x, 2, 3)  # noqa: E731
    counted = count(step)
    assert counted.ops["baddbmm's copy"] == _copies_the_profiler_sees(step) == 2 * 2 + 3
    assert counted.launches == sum(counted.ops.values())
    a = torch.randn(3, 8, 8)
    assert count(lambda: torch.baddbmm(a, a, a, beta=0)).launches == 1 == _copies_the_profiler_sees(
        lambda: torch.baddbmm(a, a, a, beta=0)) + 1
    assert count(lambda: a.clone().baddbmm_(a, a, beta=0.5)).ops == {"clone": 1, "baddbmm_": 1}
    c = a.clone()
    assert count(lambda: torch.baddbmm(c, a, a, beta=0.5, out=c)).ops["baddbmm's copy"] == 0  # out is the input
    assert count(lambda: torch.baddbmm(c, a, a, beta=0.5, out=torch.empty_like(c))).ops["baddbmm's copy"] == 1
    plain = count(lambda: torch.baddbmm(a, a, a, beta=0.5))
    assert plain.bytes == 2 * a.numel() * 4 and plain.launches == 2  # the input read, the result written
    m, bias = torch.randn(8, 8), torch.randn(8)
    assert count(lambda: torch.nn.functional.linear(torch.randn(4, 5, 8), m, bias)).ops["addmm's copy"] == 0
    assert count(lambda: torch.addmm(m, m, m)).ops["addmm's copy"] == 1  # a 2-D input: no epilogue
    assert count(lambda: torch.addmm(bias, m, m, beta=0.5)).ops["addmm's copy"] == 1  # the epilogue adds β = 1 only
    assert count(lambda: torch.addmm(bias, m[:1], m)).ops["addmm's copy"] == 1  # one row: cuBLASLt refuses it
    assert count(lambda: torch.addmm(torch.randn(16)[::2], m, m)).ops["addmm's copy"] == 1  # a strided bias
    assert count(lambda: torch.addmm(bias, m, m, out=torch.empty(8, 8).mT)).ops["addmm's copy"] == 1  # a strided result
    assert count(lambda: torch.addmm(bias, m, m, out=torch.empty(8, 8))).ops["addmm's copy"] == 0


def test_logsumexp_is_counted_as_the_kernels_cuda_runs_and_keeps_its_value():
    """torch's logsumexp has no CUDA kernel: CUDA runs its composite (amax, x − max, exp_, sum, …), six passes over the
    input where a dispatch mode sees one operator reading it once. The counter counts the parts, and the value is
    torch's, infinite and empty rows included."""
    assert composite_on_cuda(torch.ops.aten.logsumexp.default)  # a torch with a CUDA kernel for it fails here
    x = torch.randn(64, 257, generator=torch.Generator().manual_seed(0))
    x[0, 3], x[1] = math.inf, -math.inf
    counts = count(lambda: x.logsumexp(-1))
    assert counts.launches == 9 and counts.ops["amax"] == counts.ops["exp_"] == counts.ops["sum"] == 1
    assert 5 * x.numel() * 4 <= counts.bytes < 5.1 * x.numel() * 4  # read by amax, sub (and its write), exp_, sum
    assert count(lambda: x.log_softmax(-1)).launches == 1  # a fused kernel stays one
    for tensor, dim, keepdim in ((x, -1, False), (x, (0, 1), True), (x, [0], False), (torch.empty(0, 3), -1, False),
                                 (torch.empty(3, 0), -1, True),  # no rows; no keys (−∞, as ATen's own branch)
                                 (torch.arange(6).view(2, 3), -1, False)):  # integers: cast, as ATen does
        with KernelCounter():
            counted = tensor.logsumexp(dim, keepdim)
        assert torch.equal(counted, tensor.logsumexp(dim, keepdim))


def test_a_gather_moves_its_index_and_what_it_picks_not_its_whole_input():
    """CUDA's gather and index_select read one input element per output element: a row's largest logit picked from an
    N × N map moves N indices and 2N values, not the map."""
    logits = torch.randn(6, 257, 257, generator=torch.Generator().manual_seed(0))
    index = logits.argmax(-1, keepdim=True)
    assert count(lambda: logits.gather(-1, index)).bytes == index.numel() * (8 + 2 * 4)
    rows = torch.tensor([3, 1, 4])
    assert count(lambda: logits[0].index_select(0, rows)).bytes == 3 * 8 + 2 * 3 * 257 * 4
    assert count(lambda: logits.exp()).bytes == 2 * logits.numel() * 4  # any other operator: its tensors whole


def test_a_scatter_moves_what_it_writes_and_a_fill_reads_nothing():
    """An in-place scatter moves its index, its source and one destination element per index entry (written, or read
    and written where it adds), not the N × N destination; ``zeros_like`` and ``new_zeros`` take a tensor for its shape
    only: their output is all they move. Charging the whole destination or the template (the counter before) fails."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 257, 257, generator=gen)
    index = logits.topk(11, dim=-1).indices
    weights = torch.randn(6, 257, 11, generator=gen)
    sparse = torch.zeros_like(logits)
    assert count(lambda: sparse.scatter_add_(-1, index, weights)).bytes == index.numel() * (8 + 4 + 2 * 4)
    assert count(lambda: sparse.scatter_(-1, index, weights)).bytes == index.numel() * (8 + 4 + 4)
    assert count(lambda: sparse.scatter_(-1, index, 1.0)).bytes == index.numel() * (8 + 4)
    assert count(lambda: torch.zeros_like(logits)).bytes == logits.numel() * 4
    assert count(lambda: weights.new_zeros(6, 257, 257)).bytes == logits.numel() * 4
    assert count(lambda: sparse.add_(1.0)).bytes == logits.numel() * 4  # any other in-place operator: its tensor once


def test_depth_and_batch_extrapolate_exactly():
    """Counts made bilinear in depth and batch are recovered anywhere from the four corners."""
    def made(depth, batch):
        return StepCounts(10 + 7 * depth, {"bf16": 3 + 5 * depth * batch + 2 * batch, "tf32": 0.0, "fp32": depth},
                          11 * batch + 13 * depth * batch + (depth - 1) * batch, 0.0,
                          norm_rows=17 * batch + 19 * depth * batch,
                          op_bytes=+Counter(add=11 * batch, mul=13 * depth * batch, div=(depth - 1) * batch))

    corners = {(d, b): made(d, b) for d in (1, 2) for b in (2, 4)}
    far = extrapolate(corners, 12, 256)
    assert far.launches == made(12, 256).launches and far.bytes == made(12, 256).bytes
    assert far.flops == made(12, 256).flops and far.norm_rows == made(12, 256).norm_rows
    assert far.op_bytes == made(12, 256).op_bytes
    corners[1, 4] = StepCounts(18, {"bf16": 0.0, "tf32": 0.0, "fp32": 0.0}, 0.0, 0.0)  # one launch more at batch 4
    with pytest.raises(ValueError, match="launches changed with the batch"):
        extrapolate(corners, 12, 256)


def test_norm_rows_count_the_blocks_of_cudas_norm_kernels_one_per_normalised_row():
    """CUDA's LayerNorm and RMSNorm launch a thread block per row of the normalised width, forward and for the input's
    gradient (not for the weights' alone): the counter counts those rows, whatever the layout of the input (a strided
    view of a projection, as an attention's q)."""
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    weight, bias = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    both_ways = count(lambda: torch.nn.functional.layer_norm(x, (8,), weight, bias).sum().backward())
    assert both_ways.norm_rows == 2 * (2 * 3 * 5)
    over_two = count(lambda: torch.nn.functional.layer_norm(x, (5, 8), weight.new_ones(5, 8)).sum().backward())
    assert over_two.norm_rows == 2 * (2 * 3)  # a row is the normalised shape, here 5 × 8
    frozen = x.detach()  # the weights' gradients only: the backward launches no per-row kernel
    assert count(lambda: torch.nn.functional.layer_norm(frozen, (8,), weight, bias).sum().backward()).norm_rows == 30
    strided = torch.randn(2, 5, 3, 3, 8).permute(2, 0, 3, 1, 4)[0].requires_grad_()  # q of a (B, N, 3, h, d) qkv
    assert count(lambda: torch.nn.functional.layer_norm(strided, (8,)).sum().backward()).norm_rows == 2 * 30
    with counted_as_on_cuda():  # RMSNorm as CUDA's fused kernels (the stand-ins the counted step takes)
        assert count(lambda: torch.nn.functional.rms_norm(x, (8,), weight).sum().backward()).norm_rows == 60
        weights_only = count(lambda: torch.nn.functional.rms_norm(frozen, (8,), weight).sum().backward())
    assert weights_only.norm_rows == 30 and "fused_rms_norm_backward" not in weights_only.ops  # no input gradient
    assert weights_only.ops["fused_rms_norm_weight_partials"] == 1
    aten = torch.ops.aten  # CUDA's own operators, as a step counted on a GPU meets them
    rstd = torch.ones(2, 3, 5, 1)
    assert norm_rows(aten._fused_rms_norm.default, (x, [8], weight, None), {}) == 30
    assert norm_rows(aten._fused_rms_norm_backward.default, (x, x, [8], rstd, weight, [True, True]), {}) == 30
    assert norm_rows(aten._fused_rms_norm_backward.default, (x, x, [8], rstd, weight, [False, True]), {}) == 0
    assert count(lambda: torch.nn.functional.softmax(x, -1)).norm_rows == 0  # CUDA's softmax takes rows by the warp


def test_a_norms_copies_of_strided_tensors_are_counted_where_cuda_makes_them():
    """CUDA's LayerNorm copies a strided input in its forward and again in its backward (kernels inside the
    operator): a QK norm's q, a strided view of the projection, costs two copies of itself; a contiguous input none.
    A strided incoming gradient is not counted (its layout is the previous kernel's, which differs between the CPU's
    flash attention and CUDA's)."""
    weight, bias = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    strided = torch.randn(2, 5, 3, 3, 8).permute(2, 0, 3, 1, 4)[0].requires_grad_()  # q of a (B, N, 3, h, d) qkv
    contiguous = strided.detach().contiguous().requires_grad_()
    gradient = torch.randn(strided.shape)

    def step(x, g):
        weight.grad = bias.grad = x.grad = None  # no accumulation into an earlier call's gradients
        return lambda: torch.autograd.backward(torch.nn.functional.layer_norm(x, (8,), weight, bias), g)

    size = 2 * strided.numel() * 4  # a copy reads and writes the tensor once
    plain, copied = count(step(contiguous, gradient)), count(step(strided, gradient))
    assert "native_layer_norm's copy" not in plain.ops and "native_layer_norm_backward's copy" not in plain.ops
    assert copied.ops["native_layer_norm's copy"] == 1 and copied.ops["native_layer_norm_backward's copy"] == 1
    assert copied.launches == plain.launches + 2 and copied.bytes == plain.bytes + 2 * size
    both = count(step(strided, gradient.transpose(1, 2).contiguous().transpose(1, 2)))  # a strided gradient too
    assert both.ops == copied.ops and both.bytes == copied.bytes


def test_a_fit_with_norm_rows_recovers_their_time_and_refuses_counts_without_them():
    """Data made with a time per norm row: the fit that prices rows recovers it (and the step times); one that does
    not leaves errors. Counts kept before rows were counted (NaN) are refused where rows are priced, and priced as
    before where they are not."""
    truth = GpuModel(8e-6, 3e12, {"bf16": 3e14, "tf32": 1.5e14, "fp32": 4e13}, "additive", row_s=1e-9)
    counts = synthetic(truth, seed=5)
    rng = np.random.default_rng(6)
    for c in counts:
        c.norm_rows = float(rng.uniform(1e6, 3e7))
    seconds = [truth.seconds(c) for c in counts]
    fixed = {"tf32_flops_per_s": 1.5e14}
    priced = fit(counts, seconds, "additive", fixed, rows=True)
    assert priced.row_s == pytest.approx(1e-9, rel=1e-3)
    assert max(abs(priced.seconds(c) / s - 1) for c, s in zip(counts, seconds)) < 1e-6
    blind = fit(counts, seconds, "additive", fixed)
    assert blind.row_s == 0 and max(abs(blind.seconds(c) / s - 1) for c, s in zip(counts, seconds)) > 1e-2
    assert max(abs(e) for e in leave_one_out(counts, seconds, "additive", fixed, rows=True)) < 1e-4
    old = StepCounts.from_dict({k: v for k, v in counts[0].to_dict().items() if k != "norm_rows"})
    assert math.isnan(old.norm_rows) and blind.seconds(old) > 0
    with pytest.raises(ValueError, match="predate norm_rows"):
        priced.seconds(old)
    with pytest.raises(ValueError, match="predate norm_rows"):
        fit([old, *counts[1:]], seconds, "additive", fixed, rows=True)
    with pytest.raises(ValueError, match="a fixed row_s prices norm rows; give rows=True"):
        fit(counts, seconds, "additive", {**fixed, "row_s": 1e-9})


def test_the_cuda_path_takes_the_gpus_decisions_on_the_cpu():
    module = ImageClassifier(image_size=8, backbone_options=dict(embed_dim=32, depth=1, num_heads=2),
                             stabilizer="jasmin")
    with cuda_path(module):
        optimizer = module.build_optimizer()
        assert module.stabilizers[0].streamed  # JaSMin's auto choice on CUDA
        assert optimizer.defaults.get("fused") or all(g.get("fused") for g in optimizer.param_groups)
    assert not ImageClassifier(image_size=8).build_optimizer().param_groups[0].get("fused")  # restored after
    module.losses(torch.rand(2, 1, 8, 8), torch.tensor([0, 1]))  # after it, a forward on the CPU takes the CPU's
    assert not module.stabilizers[0].streamed


def synthetic(model: GpuModel, rows: int = 12, seed: int = 0) -> list[StepCounts]:
    rng = np.random.default_rng(seed)
    return [StepCounts(float(rng.integers(500, 10000)), {"bf16": float(rng.uniform(5e12, 2e13)), "tf32": 0.0,
                                                         "fp32": float(rng.uniform(0, 1e12))},
                       float(rng.uniform(5e10, 5e11)), 0.0) for _ in range(rows)]


@pytest.mark.parametrize("form", ["additive", "overlap"])
def test_the_fit_recovers_the_constants_that_made_the_data(form):
    truth = GpuModel(8e-6, 3e12, {"bf16": 3e14, "tf32": 1.5e14, "fp32": 4e13}, form)
    counts = synthetic(truth)
    seconds = [truth.seconds(c) for c in counts]
    fitted = fit(counts, seconds, form, fixed={"tf32_flops_per_s": 1.5e14})
    assert max(abs(fitted.seconds(c) / s - 1) for c, s in zip(counts, seconds)) < 1e-6
    errors = leave_one_out(counts, seconds, form, fixed={"tf32_flops_per_s": 1.5e14})
    # overlapping: a row that alone shows a constant (the only host-bound one) is predicted less well without it
    assert max(abs(e) for e in errors) < (1e-4 if form == "additive" else 5e-2)


def test_the_wrong_form_leaves_errors_the_right_one_does_not():
    """Data made by host and device overlapping cannot be fitted to the last bits by adding them (a planted
    misfit): the check above can fail."""
    truth = GpuModel(2e-5, 3e12, {"bf16": 3e14, "tf32": 1.5e14, "fp32": 4e13}, "overlap")
    counts = synthetic(truth, seed=1)
    seconds = [truth.seconds(c) for c in counts]
    wrong = fit(counts, seconds, "additive", fixed={"tf32_flops_per_s": 1.5e14})
    assert max(abs(wrong.seconds(c) / s - 1) for c, s in zip(counts, seconds)) > 1e-3


def test_a_stabilizer_measured_twice_is_left_out_whole():
    """Rows measured in two GPU runs: grouped by stabilizer, each row's leave-one-out error is that of the data
    without twins (its twin, left in, would predict it: the ungrouped error is far smaller)."""
    truth = GpuModel(2e-5, 3e12, {"bf16": 3e14, "tf32": 1.5e14, "fp32": 4e13}, "additive")
    counts = synthetic(truth, seed=2)
    rng = np.random.default_rng(3)
    seconds = [truth.seconds(c) * float(rng.uniform(0.8, 1.25)) for c in counts]  # the model misses every row
    fixed = {"tf32_flops_per_s": 1.5e14, "kernel_s": 1e-12}
    alone = leave_one_out(counts, seconds, "additive", fixed)
    twice = leave_one_out(counts * 2, seconds * 2, "additive", fixed, groups=list(range(len(counts))) * 2)
    np.testing.assert_allclose(twice, alone * 2, rtol=1e-4, atol=1e-4)
    ungrouped = leave_one_out(counts * 2, seconds * 2, "additive", fixed)
    assert np.median(np.abs(ungrouped)) < 0.8 * np.median(np.abs(alone))


def test_a_fitted_rate_stays_under_its_ceiling():
    """Data made with float32 products faster than the data sheet allows: unbounded, the fit recovers that rate;
    with the data sheet's peak as its ceiling, it stops there (and the rows are then fitted less well)."""
    truth = GpuModel(2e-5, 3e12, {"bf16": 3e14, "tf32": 1.5e14, "fp32": 2e14}, "additive")
    counts = synthetic(truth, seed=4)
    seconds = [truth.seconds(c) for c in counts]
    fixed = {"tf32_flops_per_s": 1.5e14, "kernel_s": 1e-12}
    free = fit(counts, seconds, "additive", fixed)
    assert free.flops_per_s["fp32"] == pytest.approx(2e14, rel=1e-3)
    capped = fit(counts, seconds, "additive", fixed, ceilings={"fp32_flops_per_s": 1e14})
    assert capped.flops_per_s["fp32"] == pytest.approx(1e14, rel=1e-5)

    def worst(model):
        return max(abs(model.seconds(c) / s - 1) for c, s in zip(counts, seconds))

    clipped = GpuModel(free.launch_s, free.bytes_per_s, {**free.flops_per_s, "fp32": 1e14}, "additive", free.kernel_s)
    assert 1e-3 < worst(capped) < 0.5 * worst(clipped)  # the other constants refitted under the ceiling
    low = fit(counts, seconds, "additive", fixed, ceilings={"fp32_flops_per_s": 3e13})  # below where the fit starts
    assert low.flops_per_s["fp32"] == pytest.approx(3e13, rel=1e-5)
    with pytest.raises(ValueError, match="a ceiling bounds a rate"):
        fit(counts, seconds, "additive", fixed, ceilings={"launch_s": 1e-5})


def test_a_product_in_place_is_counted_as_a_product():
    """``baddbmm_`` and ``addmm_`` (not in torch's FLOP counter) count their out-of-place twin's FLOPs in the product's
    precision and no bytes (a product's operands are in its FLOP term); a planted miss would count them as bytes."""
    a, m = torch.randn(3, 8, 8), torch.randn(8, 8)
    c = a.clone()
    in_place = count(lambda: c.baddbmm_(a, a, beta=0.5))
    assert in_place.flops["fp32"] == count(lambda: torch.baddbmm(a, a, a, beta=0.5)).flops["fp32"] == 2 * 3 * 8 ** 3
    assert in_place.bytes == 0 and in_place.launches == 1
    n = m.clone()
    assert count(lambda: n.addmm_(m, m)).flops["fp32"] == 2 * 8 ** 3


def test_bytes_by_operator_sum_to_the_steps_bytes_and_survive_the_json():
    """``op_bytes`` splits ``bytes`` by the operators of ``ops`` (a matrix product's hidden copy its own entry, the
    product itself none: its bytes are not priced), sums to it exactly after extrapolation too, and is kept by
    ``to_dict`` / ``from_dict``; counts kept before it existed read as empty."""
    x = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(5, 8, requires_grad=True)

    stack = torch.randn(2, 3, 3)

    def step(batch):
        torch.baddbmm(stack, stack, stack)  # out of place with β = 1: CUDA copies the input into the result first
        h = torch.nn.functional.linear(x[:batch], weight)
        torch.nn.functional.gelu(h).mul(2.0).sum().backward()

    counts = count(lambda: step(6))
    assert counts.bytes > 0 and sum(counts.op_bytes.values()) == counts.bytes
    assert set(counts.op_bytes) <= set(counts.ops) and counts.op_bytes["gelu"] == 2 * 6 * 5 * 4
    assert counts.op_bytes["baddbmm's copy"] == 2 * stack.numel() * 4 and not any(
        name in counts.op_bytes for name in ("mm", "baddbmm"))
    corners = {(d, b): count(lambda b=b: step(b)) for d in (1, 2) for b in (2, 4)}
    far = extrapolate(corners, 3, 6)
    assert sum(far.op_bytes.values()) == pytest.approx(far.bytes, rel=1e-12)
    again = StepCounts.from_dict(counts.to_dict())
    assert again.op_bytes == counts.op_bytes and again.bytes == counts.bytes
    old = counts.to_dict()
    del old["op_bytes"]
    assert StepCounts.from_dict(old).op_bytes == Counter()
