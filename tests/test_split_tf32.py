"""The hard cap's float32 products as three TF32 products each (``constraints.tf32_parts``), the path a GPU with TF32
units takes: float32's cap, where one TF32 product a step is ~1e-3·β off. TF32 is emulated on the CPU
(``stability.testing.tf32``) under both roundings a tensor core may apply."""
import pytest
import torch
from test_muon import VIT, _set_grads, rms_singular_values, spectrum_cases

from stability.classifier import ImageClassifier
from stability.nn import constraints
from stability.nn.precision import tf32_matmuls
from stability.testing.gpu_model import count
from stability.testing.tf32 import ROUNDINGS, emulated_tf32, to_tf32

IEEE_PARTS = constraints.tf32_parts


def wrong_mask_parts(x):
    """A planted error: hi keeps 12 mantissa bits, two more than TF32 holds, so a TF32 unit rounds it."""
    hi = (x.view(torch.int32) & -(1 << 11)).view(torch.float32)
    return hi, x - hi


def no_low_parts(x):
    """A planted error: the low parts dropped (one TF32 product, three times over)."""
    hi, lo = IEEE_PARTS(x)
    return hi, torch.zeros_like(lo)


def test_tf32_parts_sum_to_x_exactly_with_hi_exact_in_tf32():
    """hi + lo = X bit for bit, hi has TF32's 10 mantissa bits (unchanged by either TF32 rounding) and |lo| ≤ 2⁻¹⁰|X|
    for normal values, over signs, zero, subnormals and large values."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-40, 30, 4096, dtype=torch.float64)
    x = torch.cat([torch.randn(4096, generator=gen, dtype=torch.float64) * magnitudes,
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -3e-39, 3e38])]).float()
    hi, lo = constraints.tf32_parts(x)
    assert torch.equal(hi + lo, x)
    for rounding in ROUNDINGS:
        assert torch.equal(to_tf32(hi, rounding), hi)
    normal = x.abs() >= torch.finfo(torch.float32).tiny  # a subnormal has fewer bits: TF32's are all it has
    assert bool((lo[normal].abs() <= x[normal].abs() * 2.0 ** -10).all())
    assert not torch.equal(to_tf32(x), x)  # the rounding does something to these values


def test_emulated_tf32_rounds_products_only_where_torch_allows_tf32():
    """Inside the emulation, a float32 product is IEEE under ``highest`` and on TF32-rounded operands under
    ``high``, in place and with ``out=`` as well; float64 is never touched; an unknown rounding is refused, naming
    the choices."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 16, 32, generator=gen), torch.randn(2, 32, 8, generator=gen)
    with emulated_tf32():
        ieee = torch.bmm(a, b)
        with tf32_matmuls():
            rounded = torch.bmm(a, b)
            wide = torch.bmm(a.double(), b.double())
    torch.testing.assert_close(ieee, torch.bmm(a, b), rtol=0, atol=0)
    torch.testing.assert_close(rounded, torch.bmm(to_tf32(a), to_tf32(b)), rtol=0, atol=0)
    c = torch.zeros(2, 16, 8)
    with emulated_tf32(), tf32_matmuls():  # in place and with out= too (the split product accumulates in place)
        in_place = c.clone().baddbmm_(a, b)
        written = torch.bmm(a, b, out=torch.empty(2, 16, 8))
    torch.testing.assert_close(in_place, rounded, rtol=0, atol=0)
    torch.testing.assert_close(written, rounded, rtol=0, atol=0)
    assert not torch.equal(rounded, ieee)
    torch.testing.assert_close(wide, torch.bmm(a.double(), b.double()), rtol=0, atol=0)
    assert torch.get_float32_matmul_precision() == "highest"  # restored
    with pytest.raises(ValueError, match=r"rounding='down'; choose one of nearest, truncate"):
        with emulated_tf32("down"):
            pass


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_split_product_is_the_float32_product_under_tf32(rounding, monkeypatch):
    """β·C + α·(A @ B) from three TF32 products in one is within 1e-6 (relative, Frobenius) of the float64 product
    under emulated TF32, as close as the IEEE float32 product; one TF32 product is ~1e-4 off, and so are the planted
    errors (hi with 12 bits; the low parts dropped)."""
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(*shape, generator=gen) for shape in ((3, 24, 40), (3, 40, 16), (3, 24, 16)))
    exact = 0.5 * c.double() - 1.5 * torch.bmm(a.double(), b.double())

    def error(split):
        with emulated_tf32(rounding), tf32_matmuls():
            out = constraints._bmm(a, b, split, out=c, beta=0.5, alpha=-1.5)
        return float(torch.linalg.norm(out.double() - exact) / torch.linalg.norm(exact))

    assert error(True) <= 1e-6
    assert error(False) > 1e-4
    with emulated_tf32(rounding), tf32_matmuls():  # a @ b alone, split
        alone = constraints._bmm(a, b, True)
    product = a.double() @ b.double()
    assert float(torch.linalg.norm(alone.double() - product) / torch.linalg.norm(product)) <= 1e-6
    with pytest.raises(ValueError, match=r"alpha=2.0 needs an out"):
        constraints._bmm(a, b, True, alpha=2.0)
    for planted in (wrong_mask_parts, no_low_parts):
        monkeypatch.setattr(constraints, "tf32_parts", planted)
        assert error(True) > 1e-5, planted.__name__
        monkeypatch.undo()


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("shape", [(24, 24), (16, 48), (48, 16)])
def test_split_hard_cap_under_tf32_matches_the_svd_cap_as_ieee_does(shape, rounding, monkeypatch):
    """Under emulated TF32 the split cap passes the IEEE cap's test (within 5e-5·β of the SVD cap in RMS→RMS norm,
    never more than 5e-5 above β) on every hard spectrum, with and without Muon's bound, and is within 1e-5·β of the
    IEEE float32 cap. One TF32 product a step is off by up to ~2e-3·β on these spectra, and so are the planted errors:
    each fails the first test."""
    cases = []
    for name, w in spectrum_cases(*shape, seed=5).items():
        largest = float(rms_singular_values(w).max())
        cases += [(name, w, bound) for bound in (None, largest * 1.001 if largest > 0 else None)]

    def worst(split):
        """The largest distance to the SVD cap, to the IEEE cap, and of a capped value above β."""
        errors = []
        for _, w, bound in cases:
            with emulated_tf32(rounding), tf32_matmuls():
                capped = constraints.hard_cap(w.float(), 1.0, bound=bound, split=split).double()
            ieee = constraints.hard_cap(w.float(), 1.0, bound=bound).double()
            errors.append((float(rms_singular_values(capped - constraints.hard_cap_svd(w, 1.0)).max()),
                           float(rms_singular_values(capped - ieee).max()),
                           float(rms_singular_values(capped).max()) - 1.0))
        return tuple(max(e[i] for e in errors) for i in range(3))

    to_svd, to_ieee, above = worst(True)
    assert to_svd <= 5e-5 and to_ieee <= 1e-5 and above <= 5e-5, (to_svd, to_ieee, above)
    assert worst(False)[0] > 2e-4
    for planted in (wrong_mask_parts, no_low_parts):
        monkeypatch.setattr(constraints, "tf32_parts", planted)
        assert worst(True)[0] > 5e-5, planted.__name__
        monkeypatch.undo()


def test_split_is_float32_only_and_the_same_value_where_tf32_is_off():
    """Split float64 is refused (TF32 is a float32 format); with TF32 off the split cap is the IEEE cap to float32
    rounding; a sign step's launches (counted as on a GPU) are those of its three or two products, their splits and
    concatenations."""
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5 / 32 ** 0.5
    with pytest.raises(ValueError, match=r"split=True splits float32 products for TF32 units; got torch.float64"):
        constraints.hard_caps([w], 1.0, split=True)
    bound = float(rms_singular_values(w).max()) * 1.001
    torch.testing.assert_close(constraints.hard_cap(w.float(), 1.0, bound=bound, split=True),
                               constraints.hard_cap(w.float(), 1.0, bound=bound), rtol=0, atol=1e-6)
    x = w.float()[None] / 5
    # a quintic step: three splits (X, G, bG + cG²: a bitwise and and a subtraction each) and three products of three
    # each; bG + cG² written into G, and from the second step on aX + (·)X into X (the first X is the caller's, which
    # baddbmm copies): 16 launches, then 15, against 5; a cubic step: two splits, two products of three: 11, then 10
    assert count(lambda: constraints.newton_schulz(x, 2, 0, split=True)).launches == 16 + 15
    assert count(lambda: constraints.newton_schulz(x, 0, 2, split=True)).launches == 11 + 10
    before = x.clone()
    constraints.newton_schulz(x, 2, 2, split=True)
    assert torch.equal(x, before)  # the caller's matrix is not written


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_muon_hard_cap_with_tf32x3_splits_where_a_gpu_has_tf32_and_projects_as_ieee(rounding, monkeypatch):
    """``cap_products: tf32x3`` on a device with TF32 units (``split_products_on``, forced here) runs the hard cap's
    products split with TF32 on and, under emulated TF32, projects every matrix as the IEEE path does (1e-5); TF32
    is off again after the projection. The default (``float32``) never splits, nor ``tf32x3`` on a device without
    TF32 units. With the low parts dropped (planted) the weights differ."""
    seen = []
    cap_all = constraints.hard_caps

    def recorded(*args, **kwargs):
        seen.append((kwargs.get("split"), torch.get_float32_matmul_precision()))
        return cap_all(*args, **kwargs)

    monkeypatch.setattr(constraints, "hard_caps", recorded)

    def trained(products: str, tf32_units: bool):
        monkeypatch.setattr(constraints, "split_products_on", lambda device: tf32_units)
        torch.manual_seed(0)
        module = ImageClassifier(backbone_options=VIT, stabilizer="muon", lr=1e-3, stabilizer_options={
            "muon": {"constraint": "hard_cap", "lr": 0.2, "sigma_max": 1.0, "cap_products": products}})
        stab = module.stabilizers[0]
        optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
        with emulated_tf32(rounding):
            for seed in range(3):
                _set_grads(module, seed)
                optimizer.step()
                stab.after_optimizer_step(module.network)
        splits = set(seen)
        seen.clear()
        return [p.detach().clone() for p in stab._matrices], splits

    ieee, splits = trained("float32", True)
    assert splits == {(False, "highest")}
    assert trained("tf32x3", False)[1] == {(False, "highest")}
    split, splits = trained("tf32x3", True)
    assert splits == {(True, "high")}
    assert torch.get_float32_matmul_precision() == "highest"
    for a, b in zip(ieee, split):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(constraints, "tf32_parts", no_low_parts)
    planted, _ = trained("tf32x3", True)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(ieee, planted))
    with pytest.raises(ValueError, match=r"cap_products must be one of \('float32', 'tf32x3'\), got 'tf32'"):
        ImageClassifier(backbone_options=VIT, stabilizer="muon", stabilizer_options={"muon": {"cap_products": "tf32"}})


def test_split_hard_caps_compile_in_one_graph():
    """Compiled (as ``--model.compile`` takes the projection), the split caps are one graph without a break and give
    the eager values."""
    gen = torch.Generator().manual_seed(4)
    stacks = [torch.randn(2, 16, 16, generator=gen) * 0.5 / 4, torch.randn(2, 16, 32, generator=gen) * 0.5 / 32 ** 0.5]
    torch._dynamo.reset()
    compiled = torch.compile(lambda s: constraints.hard_caps(s, 1.0, bound=1.3, split=True), fullgraph=True)
    for a, b in zip(constraints.hard_caps(stacks, 1.0, bound=1.3, split=True), compiled(stacks)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_the_split_hard_cap_with_tf32_on_matches_the_svd_cap():
    """CUDA with TF32 on: the split cap is within 5e-5·β of the float64 SVD cap on every hard spectrum, and one TF32
    product a step (the same call with split off) is not: TF32 is really on, and the split really needed."""
    unsplit = []
    with tf32_matmuls():
        for name, w in spectrum_cases(48, 16, seed=5).items():
            reference = constraints.hard_cap_svd(w, 1.0)
            for split in (True, False):
                capped = constraints.hard_cap(w.float().cuda(), 1.0, split=split).double().cpu()
                error = float(rms_singular_values(capped - reference).max())
                if split:
                    assert error <= 5e-5, (name, error)
                else:
                    unsplit.append(error)
    assert max(unsplit) > 2e-4


@pytest.mark.gpu
def test_on_a_gpu_muon_with_tf32x3_projects_as_with_ieee_products():
    """CUDA: MuonConstrained's hard cap with ``cap_products: tf32x3`` (split, TF32 really on) gives the weights the
    IEEE products give, to 1e-5 over three steps, and TF32 is set back afterwards."""
    def trained(products: str):
        torch.manual_seed(0)
        module = ImageClassifier(backbone_options=VIT, stabilizer="muon", lr=1e-3, stabilizer_options={
            "muon": {"constraint": "hard_cap", "lr": 0.2, "sigma_max": 1.0, "cap_products": products}}).cuda()
        stab = module.stabilizers[0]
        optimizer = stab.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in module.parameters():
                p.grad = torch.randn(p.shape, generator=gen).cuda()
            optimizer.step()
            stab.after_optimizer_step(module.network)
        return [p.detach().cpu() for p in stab._matrices]

    precision = torch.get_float32_matmul_precision()
    for a, b in zip(trained("float32"), trained("tf32x3")):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.get_float32_matmul_precision() == precision
