"""Muon-constrained weights: each projection against SVD, the soft cap's guarantee after a Muon
step, and our optimizer set-up against torch.optim.Muon / AdamW on the same weights."""
import copy

import pytest
import torch

from stability.classifier import ImageClassifier
from stability.nn import constraints
from stability.stabilizers.muon import MuonConstrained, constrained_matrices

VIT = dict(embed_dim=16, depth=1, num_heads=2)


def hidden_matrices(network):
    return [p for _, p in constrained_matrices(network, "hidden")]


def random_matrix(m, n, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=gen, dtype=torch.float64) * scale / n ** 0.5


def rms_singular_values(w):
    return torch.linalg.svdvals(w) * (w.shape[1] / w.shape[0]) ** 0.5


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_hard_cap_is_u_min_sigma_beta_vt(shape):
    w = random_matrix(*shape, seed=1)
    beta = 1.2
    scale = (shape[1] / shape[0]) ** 0.5
    u, s, vh = torch.linalg.svd(w * scale, full_matrices=False)
    expected = (u * s.clamp(max=beta)) @ vh / scale
    # the paper's msign formula with an exact msign is U·min(Σ, β)·Vᵀ, and so is the one-SVD form
    torch.testing.assert_close(constraints.hard_cap_msign_formula(w, beta), expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(constraints.hard_cap_svd(w, beta), expected, atol=1e-10, rtol=1e-10)


def spectrum_cases(m, n, seed):
    """Matrices in RMS units with spectra that are hard for an iterative cap: values a hair above and below
    β = 1, all equal to β (a capped matrix), spread to 3β, rank-deficient with zeros, tiny and large."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    k = min(m, n)
    signs = torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0).double()
    spectra = {"near": 1 + torch.logspace(-6, -1, k, dtype=torch.float64) * signs,
               "at": torch.ones(k, dtype=torch.float64), "spread": torch.linspace(0, 3, k, dtype=torch.float64),
               "rank-deficient": torch.cat([torch.full((k // 2,), 1.5), torch.zeros(k - k // 2)]).double(),
               "below": torch.linspace(0.01, 0.999, k, dtype=torch.float64)}
    return {name: (u[:, :k] * s) @ v[:, :k].T / (n / m) ** 0.5 for name, s in spectra.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(24, 24), (16, 48), (48, 16)])
def test_newton_schulz_hard_cap_matches_the_svd_cap(shape, dtype):
    """The per-step hard cap (msign formula, Newton–Schulz msign, matmuls only) is within 5e-5·β of the SVD cap
    in RMS→RMS norm, and never more than 5e-5·β above β, with the a-priori bound (Muon) or without (‖M‖_F)."""
    for name, w in spectrum_cases(*shape, seed=5).items():
        reference = constraints.hard_cap_svd(w, 1.0)
        largest = float(rms_singular_values(w).max())
        for bound in (None, largest * 1.001 if largest > 0 else None):
            capped = constraints.hard_cap(w.to(dtype), 1.0, bound=bound).double()
            error = float(rms_singular_values(capped - reference).max())
            assert error <= 5e-5, (name, bound, error)
            assert float(rms_singular_values(capped).max()) <= 1.0 + 5e-5, (name, bound)


HARD_CAP_STACKS = [(3, 16, 16), (2, 32, 16), (2, 16, 32), (1, 10, 24), (12, 20)]  # tall and wide of one shape


@pytest.mark.parametrize("bounded", [False, True])
def test_hard_caps_batched_across_shapes_equal_each_alone(bounded, monkeypatch):
    """The hard caps of several shapes with their iterations batched (a tall stack turned wide beside a wide one of
    the same shape, every second sign padded with zeros to the largest r) equal each shape's cap alone to 1e-10 in
    float64, and stay within the SVD cap's tolerance. The planted error, a padding that is not zero, fails."""
    gen = torch.Generator().manual_seed(8)
    stacks = [torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.8 for shape in HARD_CAP_STACKS]
    bound = max(float(rms_singular_values(w).max()) for w in stacks) * 1.001 if bounded else None
    alone = [constraints.hard_cap(w, 1.0, bound=bound) for w in stacks]
    together = constraints.hard_caps(stacks, 1.0, bound=bound)
    for w, a, b in zip(stacks, alone, together):
        assert b.shape == w.shape
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)
        error = float(rms_singular_values(b - constraints.hard_cap_svd(w, 1.0)).max())
        assert error <= 5e-5, error
    padding = torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda x, sizes: padding(x, sizes, value=0.01))
    planted = constraints.hard_caps(stacks, 1.0, bound=bound)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(alone, planted))


def test_hard_caps_refuse_weights_of_mixed_dtypes_or_devices():
    """Batched, mixed dtypes returned a float32 matrix's cap in float64 (or failed in a product of two shapes), and
    mixed devices cannot be batched: refused, naming what was given; each alone keeps its dtype."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"one dtype and device; got torch.float32 on cpu, torch.float64 on cpu"):
        constraints.hard_caps(weights, 1.0)
    with pytest.raises(ValueError, match=r"got torch.float32 on cpu, torch.float32 on meta"):
        constraints.hard_caps([weights[0], torch.empty(16, 8, device="meta")], 1.0)
    alone = [constraints.hard_caps([w], 1.0)[0] for w in weights]
    assert [a.dtype for a in alone] == [torch.float32, torch.float64]


def test_hard_caps_take_one_first_sign_a_wide_shape_and_one_second_sign(monkeypatch):
    """Newton–Schulz runs once for each shape made wide (16 × 16, 16 × 32, 10 × 24, 12 × 20) and once for every
    second sign, on all nine matrices' r × r inputs padded to 16: five batches where each stack alone takes ten."""
    calls = []
    iterate = constraints.newton_schulz

    def counted(x, growth, polish, split=False):
        calls.append(x.reshape(-1, *x.shape[-2:]).shape)
        return iterate(x, growth, polish, split)

    monkeypatch.setattr(constraints, "newton_schulz", counted)
    gen = torch.Generator().manual_seed(9)
    constraints.hard_caps([torch.randn(*shape, generator=gen) for shape in HARD_CAP_STACKS], 1.0, bound=1.05)
    assert calls == [(3, 16, 16), (4, 16, 32), (1, 10, 24), (1, 12, 20), (9, 16, 16)]


def test_second_signs_of_alike_widths_share_a_batch_and_unlike_ones_run_apart():
    """A ViT's widths (its d, a 49-wide patch embedding, a 10-class head) take one padded batch, already at one block
    (the Lipschitz transformer's ViT-S: six 384-wide matrices, a 48-wide patch embedding, the head), as at any depth:
    the step counts extrapolate from one and two blocks. Swin-T's 768, 384, 192 and 96 lead a batch each (padded to
    768, the 96s would take 512× their products). For any sizes: every stack in one batch, a batch's widths in
    descending order from its lead, each joined width's padding at most PAD_SHARE of its lead's products (so a batch's
    padded products at most its own plus PAD_SHARE of the lead's for each width that joined), and a width leading a
    batch of its own only where joining the batch before would have padded it more."""
    assert constraints.padded_batches([(24, 64), (1, 49), (1, 10)]) == [[0, 1, 2]]
    assert constraints.padded_batches([(1, 48), (4, 384), (2, 384), (1, 10)]) == [[1, 2, 0, 3]]
    assert constraints.padded_batches([(12, 96), (13, 768), (13, 192), (37, 384)]) == [[1], [3], [2], [0]]
    assert constraints.padded_batches([(1, 8), (2, 8)], share=0.0) == [[0, 1]]  # one width: never padded
    assert constraints.padded_batches([(6, 64), (1, 10)], share=0.0) == [[0], [1]]
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(1, 12, (), generator=gen))
        sizes = [(int(g), int(r)) for g, r in zip(torch.randint(1, 20, (n,), generator=gen),
                                                  torch.randint(1, 300, (n,), generator=gen))]
        batches = constraints.padded_batches(sizes)
        assert sorted(i for batch in batches for i in batch) == list(range(n))
        for batch in batches:
            lead = sizes[batch[0]][1]
            lead_products = sum(g * r ** 3 for g, r in sizes if r == lead)
            assert all(sizes[i][1] <= lead for i in batch)
            widths = [sizes[i][1] for i in batch]
            assert widths == sorted(widths, reverse=True)
            for r in set(widths) - {lead}:
                count = sum(g for g, width in sizes if width == r)
                assert count * (lead ** 3 - r ** 3) <= constraints.PAD_SHARE * lead_products
            own = sum(sizes[i][0] * sizes[i][1] ** 3 for i in batch)
            padded = sum(sizes[i][0] for i in batch) * lead ** 3
            assert padded <= own + constraints.PAD_SHARE * (len(set(widths)) - 1) * lead_products
        for previous, batch in zip(batches, batches[1:]):  # a width leads a batch only where it could not join
            lead, r = sizes[previous[0]][1], sizes[batch[0]][1]
            lead_products = sum(g * width ** 3 for g, width in sizes if width == lead)
            count = sum(g for g, width in sizes if width == r)
            assert count * (lead ** 3 - r ** 3) > constraints.PAD_SHARE * lead_products


def test_hard_caps_of_unlike_widths_take_each_width_s_products_and_equal_each_alone(monkeypatch):
    """Stacks of widths 8 and 32 (tall and wide among them), capped together: equal to each alone to 1e-10 in
    float64, in two second-sign batches (the 32s first: results filed back by index), with the matrix-product FLOPs
    of capping each alone (torch's FlopCounterMode). The planted error, every second sign in one batch padded to 32
    (the batching before this test), takes 2.2× the products and fails the count."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(4)
    stacks = [torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.8
              for shape in [(6, 8, 8), (2, 20, 8), (2, 32, 32), (1, 64, 32)]]  # the batches in another order
    bound = max(float(rms_singular_values(w).max()) for w in stacks) * 1.001

    def flops(call):
        with FlopCounterMode(display=False) as counter:
            result = call()
        return result, counter.get_total_flops()

    alone = [flops(lambda w=w: constraints.hard_cap(w, 1.0, bound=bound)) for w in stacks]
    calls = []
    iterate = constraints.newton_schulz
    monkeypatch.setattr(constraints, "newton_schulz", lambda x, *args: calls.append(x.shape) or iterate(x, *args))
    together, batched = flops(lambda: constraints.hard_caps(stacks, 1.0, bound=bound))
    assert [tuple(shape) for shape in calls[-2:]] == [(3, 32, 32), (8, 8, 8)]
    for (a, _), b in zip(alone, together):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)
    own = sum(f for _, f in alone)
    assert batched <= own, (batched, own)
    monkeypatch.setattr(constraints, "padded_batches", lambda sizes: [list(range(len(sizes)))])
    _, planted = flops(lambda: constraints.hard_caps(stacks, 1.0, bound=bound))
    assert planted > 1.5 * own, (planted, own)


def test_newton_schulz_msign_matches_the_svd_and_its_quintic_stays_bounded():
    x = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    a, b, c = constraints.JORDAN_QUINTIC
    for _ in range(12):  # the growth steps keep [0, 1] inside [0, 1.21] ⊂ [0, √3): the cubic steps converge after them
        x = a * x + b * x ** 3 + c * x ** 5
        assert float(x.min()) >= 0 and float(x.max()) <= 1.21
    for name, w in spectrum_cases(20, 36, seed=6).items():
        scale = float(w.norm())
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        kept = s >= 1e-3 * scale  # values above 1e-3 of ‖M‖_F come out within 1e-5 of 1
        got = constraints.msign(w)
        projected = u[:, kept].T @ got @ vh[kept].T  # the sign restricted to the kept directions: the identity
        torch.testing.assert_close(projected, torch.eye(int(kept.sum()), dtype=w.dtype), atol=1e-5, rtol=0,
                                   msg=name)
        assert float(torch.linalg.matrix_norm(got, ord=2)) <= 1 + 1e-9, name  # never above 1


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_hammer_sets_the_top_singular_value_and_keeps_the_rest(shape):
    w = random_matrix(*shape, seed=2)
    before = rms_singular_values(w)
    after = rms_singular_values(constraints.hammer(w, 0.9))
    assert float(before[0]) > 0.9
    assert float(after.max()) == pytest.approx(max(0.9, float(before[1])), rel=1e-10)
    assert torch.isclose(after, torch.tensor(0.9, dtype=after.dtype)).any()
    for sigma in before[1:]:
        assert torch.isclose(after, sigma).any()


def test_normalise_divides_only_when_above_the_target():
    w = random_matrix(6, 10, seed=3)
    assert constraints.rms_norm(constraints.normalise(w, 0.5)) == pytest.approx(0.5, rel=1e-10)
    small = w * 1e-3
    assert torch.equal(constraints.normalise(small, 0.5), small)


@pytest.mark.parametrize("k,sigma_max", [(1.05, 1.0), (1.2, 1.0), (3.0, 2.5)])
def test_soft_cap_alpha_maps_k_to_sigma_max_and_the_polynomial_matches_svd(k, sigma_max):
    alpha = constraints.soft_cap_alpha(k, sigma_max)
    assert alpha > 0
    capped_k = constraints.soft_cap_polynomial(torch.tensor(k, dtype=torch.float64), alpha)
    assert float(capped_k) == pytest.approx(sigma_max)
    w = random_matrix(6, 10, seed=4)
    w = w / constraints.rms_norm(w) * k  # top RMS singular value exactly k
    capped = constraints.soft_cap(w, alpha)
    expected = constraints.soft_cap_polynomial(rms_singular_values(w), alpha)
    torch.testing.assert_close(rms_singular_values(capped), expected.sort(descending=True).values)
    assert constraints.rms_norm(capped) == pytest.approx(sigma_max, rel=1e-8)
    assert constraints.soft_cap_alpha(0.9, 1.0) == 0.0


def _module(constraint, **options):
    return ImageClassifier(backbone_options=VIT, stabilizer="muon", lr=1e-3, weight_decay=0.05,
                           stabilizer_options={"muon": {"constraint": constraint, **options}})


def _set_grads(module, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def torch_has_spectral_unclamped() -> bool:
    """torch.optim.Muon accepts ``adjust_lr_fn="spectral_unclamped"`` (releases after 2.12 only)."""
    try:
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 3))], adjust_lr_fn="spectral_unclamped")
    except ValueError:
        return False
    return True


def reference_muon_steps(matrices, gradients, lr, momentum):
    """torch.optim.Muon's own steps at the paper's rate lr·√(fan_out/fan_in), as each torch release allows it:
    ``spectral_unclamped`` where it exists; else ``original`` (lr·√max(1, A/B)) with each matrix's total change
    rescaled by √(A/B)/√max(1, A/B) — without weight decay a Muon update does not depend on the weights, so the
    change is linear in lr."""
    if torch_has_spectral_unclamped():
        optimizer = torch.optim.Muon(matrices, lr=lr, momentum=momentum, weight_decay=0.0,
                                     adjust_lr_fn="spectral_unclamped")
        for grads in gradients:
            for p, g in zip(matrices, grads):
                p.grad = g
            optimizer.step()
        return
    start = [p.detach().clone() for p in matrices]
    optimizer = torch.optim.Muon(matrices, lr=lr, momentum=momentum, weight_decay=0.0, adjust_lr_fn="original")
    for grads in gradients:
        for p, g in zip(matrices, grads):
            p.grad = g
        optimizer.step()
    with torch.no_grad():
        for p, w in zip(matrices, start):
            a, b = p.shape
            p.copy_(w + (p - w) * (a / b) ** 0.5 / max(1.0, a / b) ** 0.5)


def test_optimizer_matches_torch_muon_and_adamw_on_the_same_weights():
    """Wide matrices (fc1: 64 × 16 tall, fc2: 16 × 64 wide, q/k/v/proj square) each step by lr·√(fan_out/fan_in)
    on every supported torch; the other parameters step as torch's AdamW."""
    module = _module("none", lr=0.05, momentum=0.9)
    reference = copy.deepcopy(module)
    stab = module.stabilizers[0]
    ours = stab.build_optimizer(module.network, lambda named: torch.optim.AdamW(
        [{"params": [p for _, p in named], "weight_decay": 0.05}], lr=1e-3))
    matrices = hidden_matrices(reference.network)
    assert {p.shape[0] < p.shape[1] for p in matrices} == {True, False}  # both kinds of shape are tested
    ids = {id(p) for p in matrices}
    torch_adamw = torch.optim.AdamW([p for p in reference.network.parameters() if id(p) not in ids], lr=1e-3,
                                    weight_decay=0.05)
    gradients = []
    for seed in range(3):
        _set_grads(module, seed), _set_grads(reference, seed)
        gradients.append([p.grad.clone() for p in matrices])
        ours.step(), torch_adamw.step()
        stab.after_optimizer_step(module.network)
    reference_muon_steps(matrices, gradients, lr=0.05, momentum=0.9)
    for (name, a), b in zip(module.network.named_parameters(), reference.network.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    # the RMS→RMS size of a Muon update is lr, up to Newton–Schulz's inflation (≈ 0.7–1.2)
    before = [p.detach().clone() for p in hidden_matrices(module.network)]
    _set_grads(module, 9)
    ours.step()
    sizes = [constraints.rms_norm((p - b).double()) / 0.05 for p, b in zip(hidden_matrices(module.network), before)]
    assert all(0.5 < s < 1.3 for s in sizes), sizes


@pytest.mark.parametrize("constraint", ["normalise", "hammer", "hard_cap", "soft_cap"])
def test_every_constraint_keeps_weights_at_sigma_max_over_muon_steps(constraint):
    module = _module(constraint, lr=0.02, sigma_max=1.0, weight_decay=0.1)
    stab = module.stabilizers[0]
    optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    assert max(constraints.rms_norm(p.double()) for p in hidden_matrices(module.network)) <= 1.0 + 1e-5
    for seed in range(15):
        _set_grads(module, seed)
        optimizer.step()
        stab.after_optimizer_step(module.network)
        norms = [constraints.rms_norm(p.double()) for p in hidden_matrices(module.network)]
        assert max(norms) <= 1.0 + 1e-4, (seed, norms)
    if constraint == "soft_cap":
        assert stab.last_alpha > 0


@pytest.mark.parametrize("constraint", ["hard_cap", "soft_cap", "spectral_wd"])
def test_compiled_constraints_equal_the_eager_ones_over_muon_steps(constraint, monkeypatch):
    """Trained compiled, each shape group's constraint runs as a compiled graph (inside the float32 context, through
    AOTAutograd as Inductor takes it): after six Muon steps at a decaying rate, whose α (soft cap, measured updates)
    and step bound (hard cap) change every step, every weight equals the eager run's to float32 rounding; at most
    four compilations a shape group, not one a step: the first takes α and the bound as constants, the second, once
    they change, as inputs, and the hard cap's first sign changes its iteration count as the rate falls (once or
    twice here). The planted error (α frozen at its first value) fails the comparison."""
    from torch._dynamo.testing import CompileCounterWithBackend

    real_compile = torch.compile
    counters = {}

    def counted(function, mode=None, **options):
        counters[getattr(function, "__name__", "")] = CompileCounterWithBackend("aot_eager")
        return real_compile(function, backend=counters[getattr(function, "__name__", "")], **options)

    measured = {"update_norm": "measured"} if constraint == "soft_cap" else {}  # α from each step's own update

    def run(compile: bool, frozen_alpha: bool = False):
        torch.manual_seed(0)
        module = ImageClassifier(backbone_options=VIT, stabilizer="muon", lr=1e-3, compile=compile,
                                 stabilizer_options={"muon": {"constraint": constraint, "lr": 0.05, "sigma_max": 1.0,
                                                              "weight_decay": 0.1, **measured}})
        stab = module.stabilizers[0]
        if frozen_alpha:
            constrain, first = torch.compile(stab._constrain, fullgraph=True), []

            def frozen(group, largest, exact, alpha):
                first.append(alpha)
                return constrain(group, largest, exact, first[0])

            stab._compiled_constraint = frozen
        optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
        alphas = []
        for seed in range(6):
            _set_grads(module, seed)
            for group in stab._muon.param_groups:  # a decaying rate: the hard cap's step bound changes too
                group["lr"] *= 0.6
            optimizer.step()
            stab.after_optimizer_step(module.network)
            alphas.append(stab.last_alpha)
        return module, alphas

    eager, alphas = run(False)
    monkeypatch.setattr(torch, "compile", counted)
    torch._dynamo.reset()
    compiled, _ = run(True)
    constraint_counter = counters["_cap_all" if constraint == "hard_cap" else "_constrain"]
    for (name, a), b in zip(eager.network.named_parameters(), compiled.network.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    shapes = {tuple(p.shape) for p in hidden_matrices(compiled.network)}
    assert 1 <= constraint_counter.frame_count <= 4 * len(shapes) < 6 * len(shapes)
    if constraint == "hard_cap":  # one graph for every shape: two entries and the first sign's iteration counts
        assert constraint_counter.frame_count <= 4
    if constraint == "soft_cap":
        assert len(set(alphas)) > 1  # α changed between steps: one graph took every value
        torch._dynamo.reset()
        stale, _ = run(True, frozen_alpha=True)
        assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                       for a, b in zip(eager.network.parameters(), stale.network.parameters()))


def test_weight_decay_only_uses_the_current_lr():
    """W ← (1 − λη)W with the nominal η on every matrix, wide ones (whose group lr carries the shape factor) too."""
    module = _module("none", lr=0.1, weight_decay=0.5)
    stab = module.stabilizers[0]
    optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
    matrices = hidden_matrices(module.network)
    assert any(p.shape[0] < p.shape[1] for p in matrices)
    before = [w.detach().clone() for w in matrices]
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradient: Muon's update is zero, only the decay acts
    stab.after_optimizer_step(module.network)
    for w, b in zip(matrices, before):
        torch.testing.assert_close(w.detach(), b * (1 - 0.1 * 0.5))


def test_weight_decay_on_bf16_weights_keeps_its_factor_unrounded():
    """The decay W ← (1 − λη)W takes one multi-tensor launch on float32 weights; on bf16 weights, where a multi-tensor
    multiply would round the factor to bf16 on the CPU (0.998 → 0.996: twice the decay), each matrix takes torch's
    own ``mul_`` with the exact factor."""
    module = _module("none", lr=0.02, weight_decay=0.1).to(torch.bfloat16)
    stab = module.stabilizers[0]
    stab.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
    matrices = hidden_matrices(module.network)
    start = [w.detach().clone() for w in matrices]
    expected = [w.clone().mul_(1 - 0.1 * 0.02) for w in start]
    stab._before_update()
    for w, e in zip(matrices, expected):
        assert torch.equal(w.detach(), e)
    planted = [w.clone() for w in start]  # the planted error: the multi-tensor multiply on bf16 weights
    torch._foreach_mul_(planted, [1 - 0.1 * 0.02] * len(planted))
    assert not all(torch.equal(a, b) for a, b in zip(planted, expected))


def test_bad_options():
    with pytest.raises(ValueError, match="constraint must be one of"):
        MuonConstrained(constraint="clip")
    with pytest.raises(ValueError, match="optimizer must be 'muon' or 'adamw'"):
        MuonConstrained(optimizer="sgd")


@pytest.mark.parametrize("name", ["normalise", "hammer", "spectral_wd", "hard_cap", "soft_cap"])
def test_constraints_on_a_stack_equal_each_matrix_alone(name):
    """The stabilizers project all matrices of one shape in one batched call."""
    gen = torch.Generator().manual_seed(3)
    stack = torch.randn(4, 6, 9, generator=gen, dtype=torch.float64) * torch.tensor([0.2, 0.5, 1.5, 3.0],
                                                                                     dtype=torch.float64)[:, None, None]
    apply = {"normalise": lambda w: constraints.normalise(w, 1.0), "hammer": lambda w: constraints.hammer(w, 1.0),
             "spectral_wd": lambda w: constraints.spectral_weight_decay(w, 0.3),
             "hard_cap": lambda w: constraints.hard_cap(w, 1.0),
             "soft_cap": lambda w: constraints.soft_cap(w, 0.05)}[name]
    batched = apply(stack)
    for i in range(4):
        assert torch.allclose(batched[i], apply(stack[i]), atol=1e-10), i


def test_batched_spectral_norms_equal_the_svd():
    from stability.nn.spectral import spectral_norms

    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(*shape, generator=gen) for shape in [(5, 7), (7, 5), (5, 7), (3, 3), (1, 4)]]
    exact = torch.tensor([float(torch.linalg.matrix_norm(w.double(), ord=2)) for w in weights], dtype=torch.float64)
    assert torch.allclose(spectral_norms(weights), exact, rtol=1e-10)


def test_newton_schulz_bound_holds_for_torch_muons_orthogonalisation():
    """The a-priori bound B ≥ σ₁ of torch.optim.Muon's Newton–Schulz output (bfloat16), over shapes and
    spectra from flat to very ill-conditioned, and NS_COEFFICIENTS are torch's."""
    from torch.optim import _muon

    from stability.stabilizers.muon import NS_COEFFICIENTS, newton_schulz_bound

    assert NS_COEFFICIENTS == (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    bound = newton_schulz_bound(5)
    gen = torch.Generator().manual_seed(0)
    largest = 0.0
    for trial in range(60):
        m, n = [(64, 64), (64, 16), (16, 64), (192, 64), (10, 64), (4, 64)][trial % 6]
        u = torch.linalg.qr(torch.randn(m, m, generator=gen))[0]
        v = torch.linalg.qr(torch.randn(n, n, generator=gen))[0]
        k = min(m, n)
        spectrum = torch.rand(k, generator=gen) ** (trial % 5 + 1) * 10
        update = _muon._zeropower_via_newtonschulz((u[:, :k] * spectrum) @ v[:, :k].T, NS_COEFFICIENTS, 5, 1e-7)
        largest = max(largest, float(torch.linalg.matrix_norm(update.float(), ord=2)))
    assert 1.15 < largest <= bound


@pytest.mark.parametrize("update_norm", ["bound", "measured"])
def test_soft_cap_holds_sigma_max_over_many_muon_steps_with_either_update_norm(update_norm):
    module = _module("soft_cap", lr=0.05, sigma_max=1.0, update_norm=update_norm)
    stab = module.stabilizers[0]
    optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    for seed in range(40):
        _set_grads(module, seed)
        optimizer.step()
        stab.after_optimizer_step(module.network)
        assert max(constraints.rms_norm(p.double()) for p in hidden_matrices(module.network)) <= 1.0 + 1e-5
    assert stab.last_alpha > 0


def written_out_newton_schulz(x: torch.Tensor, growth: int, polish: int, coefficients=constraints.JORDAN_QUINTIC):
    """The reference: the iteration as its polynomials, one operator at a time."""
    a, b, c = coefficients
    for _ in range(growth):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    for _ in range(polish):
        x = 1.5 * x - 0.5 * ((x @ x.mT) @ x)
    return x


@pytest.mark.parametrize("shape", [(8, 12), (3, 8, 12), (2, 3, 8, 12)])
def test_newton_schulz_on_fused_products_is_the_written_out_iteration_in_five_and_three_kernels_a_step(shape):
    """Each step's scalings and sums ride on its batched products: the same iterates in float64 (to 1e-12), any
    number of leading dimensions, three operators a quintic step and two a cubic one, and each baddbmm's copy of its
    input (five and three kernels); a wrong coefficient fails."""
    from stability.testing.gpu_model import count

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    fused = constraints.newton_schulz(x, 5, 3)
    torch.testing.assert_close(fused, written_out_newton_schulz(x, 5, 3), atol=1e-12, rtol=0)
    a, b, c = constraints.JORDAN_QUINTIC
    assert float((fused - written_out_newton_schulz(x, 5, 3, (a, b * 1.001, c))).abs().max()) > 1e-6
    assert count(lambda: constraints.newton_schulz(x, 5, 0)).launches == 25
    assert count(lambda: constraints.newton_schulz(x, 0, 3)).launches == 9
