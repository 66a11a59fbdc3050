"""Weight constraints of "Training Transformers with Enforced Lipschitz Constants"
(Newhouse et al. 2025; docs/methods.md#muon-and-weight-constraints), applied after every optimizer step.

All act on M = sqrt(d_in/d_out)·W, whose spectral norm is the RMS→RMS norm of W, and take a
target σ_max in those units. Each returns the new W; all accept a stack of matrices (..., m, n).

Per training step they use matmuls only — no SVD, no eigensolver, no host sync — and run in the
weights' own precision (float32; callers switch autocast and TF32 off, :mod:`stability.nn.precision`, or, for the hard
cap with ``split``, take each product as three TF32 products that give float32's: :func:`tf32_parts`):

* :func:`msign` (U Vᵀ) by Newton–Schulz iterations and the exact :func:`hard_cap` U·min(Σ, β)·Vᵀ from
  it by the msign formula;
* :func:`normalise`, :func:`hammer` and :func:`spectral_weight_decay` from the top singular triplet
  (σ, u, v) a persistent power iteration gives (:class:`~stability.nn.spectral.PowerIteration`);
* :func:`soft_cap`, a fixed polynomial.

The exact forms (one SVD each, for tests and for ``method: exact``) are :func:`msign_svd`,
:func:`hard_cap_svd`, and the three power-iteration functions called without a triplet.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .spectral import rms_scale

# Growth phase of Newton–Schulz: the quintic x ↦ ax + bx³ + cx⁵ of Keller Jordan's Muon. It multiplies
# small singular values by a = 3.4445 per step and keeps [0, 1] inside [0, 1.21] (checked in the tests).
JORDAN_QUINTIC = (3.4445, -4.7750, 2.0315)


def _wide(matrix: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The matrix with at most as many rows as columns (transposed if need be), and whether it was."""
    tall = matrix.shape[-2] > matrix.shape[-1]
    return (matrix.mT if tall else matrix), tall


# TF32 keeps float32's sign, exponent and top 10 of its 23 mantissa bits: masking the other 13 rounds towards zero
TF32_MASK = -(1 << 13)


def tf32_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 X as hi + lo, exactly: hi its value with TF32's 10 mantissa bits (the low 13 masked off), lo = X − hi
    (at most 2⁻¹⁰|X|, exact in float32). A product of two such sums taken as hi·hi + hi·lo + lo·hi on TF32 units
    (which round their inputs to 10 bits) is the float32 product to ~2⁻²⁰ relative: hi is exact in TF32, lo's rounding
    costs 2⁻¹⁰ of lo, and the dropped lo·lo is 2⁻²⁰ of the product (NVIDIA's "3xTF32" emulation of float32 on tensor
    cores; CUTLASS rounds hi to the nearest TF32 value, which halves hi's share of the error, where a mask truncates
    it in one kernel)."""
    hi = (x.view(torch.int32) & TF32_MASK).view(torch.float32)
    return hi, x - hi


def _bmm(a: torch.Tensor, b: torch.Tensor, split: bool, out: torch.Tensor | None = None, beta: float = 0.0,
         alpha: float = 1.0, a_parts: tuple | None = None, b_parts: tuple | None = None,
         reuse_out: bool = False) -> torch.Tensor:
    """β·out + α·(a @ b) for stacks (G, m, k) and (G, k, n); a @ b where ``out`` is None. ``split``: as three TF32
    products, the small ones first (lo·hi, hi·lo, then hi·hi, each accumulated in place: no copy), the float32
    product to ~2⁻²⁰ where TF32 is on (:func:`tf32_parts`; ``a_parts``/``b_parts``: those of a and b, where already
    split), and the same value as one IEEE product, to float32 rounding, where it is off. ``reuse_out``: split, the
    result is written into ``out`` (a tensor of the caller's own that it no longer needs; the products read only the
    parts), which saves CUDA's copy of it."""
    if out is None and alpha != 1.0:
        raise ValueError(f"_bmm: alpha={alpha} needs an out (a @ b alone is taken with alpha 1)")
    if not split:
        return torch.bmm(a, b) if out is None else torch.baddbmm(out, a, b, beta=beta, alpha=alpha)
    (a_hi, a_lo), (b_hi, b_lo) = a_parts or tf32_parts(a), b_parts or tf32_parts(b)
    if out is None:
        result = torch.bmm(a_lo, b_hi)
    elif reuse_out:
        result = out.baddbmm_(a_lo, b_hi, beta=beta, alpha=alpha)
    else:
        result = torch.baddbmm(out, a_lo, b_hi, beta=beta, alpha=alpha)
    return result.baddbmm_(a_hi, b_lo, alpha=alpha).baddbmm_(a_hi, b_hi, alpha=alpha)


def _transposed(parts: tuple[torch.Tensor, torch.Tensor] | None) -> tuple | None:
    return None if parts is None else (parts[0].mT, parts[1].mT)


def split_products_on(device: torch.device) -> bool:
    """Whether the hard cap takes its float32 products as three TF32 products each (:func:`tf32_parts`): on a CUDA
    GPU with TF32 tensor cores (compute capability 8.0 on; not ROCm, where torch's setting does not turn TF32 on by
    default), where the three may take less time than one IEEE float32 product (an H200: 495 against 67 TFLOP/s
    dense). Elsewhere one IEEE product each."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 8


def newton_schulz(x: torch.Tensor, growth: int, polish: int, split: bool = False) -> torch.Tensor:
    """``growth`` quintic steps, then ``polish`` cubic steps X ← 1.5X − 0.5XXᵀX, on a wide X with
    σ₁ ≤ 1. Each step maps every singular value s by a scalar polynomial and keeps the singular
    vectors; the cubic converges quadratically to 1 from (0, √3) and never exceeds 1, so after at least
    one cubic step every value is in [0, 1]. The scalings and sums ride on the products (``baddbmm``): a quintic
    step is three operators, a cubic one two, where the written-out form took eight and five (on a GPU each ``baddbmm``
    with β ≠ 0 also copies its input first: five and three kernels). ``split``: every product as three TF32 products
    (:func:`_bmm`), for float32 on a GPU with TF32 on: X split once a step."""
    a, b, c = JORDAN_QUINTIC
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # a stack (G, m, n): each step is three (quintic) or two (cubic) batched products
    ours = False  # whether x is an iterate of this call (split, it is then updated in place), not the caller's input
    for _ in range(growth):
        parts = tf32_parts(x) if split else None
        gram = _bmm(x, x.mT, split, a_parts=parts, b_parts=_transposed(parts))
        gram_parts = tf32_parts(gram) if split else None
        poly = _bmm(gram, gram, split, out=gram, beta=b, alpha=c, a_parts=gram_parts, b_parts=gram_parts,
                    reuse_out=True)  # bG + cG²
        x = _bmm(poly, x, split, out=x, beta=a, b_parts=parts, reuse_out=ours)  # aX + (bG + cG²)X
        ours = True
    for _ in range(polish):
        parts = tf32_parts(x) if split else None
        gram = _bmm(x, x.mT, split, a_parts=parts, b_parts=_transposed(parts))
        x = _bmm(gram, x, split, out=x, beta=1.5, alpha=-0.5, b_parts=parts, reuse_out=ours)  # 1.5X − 0.5(XXᵀ)X
        ours = True
    return x.reshape(shape)


@functools.lru_cache(maxsize=256)
def cubic_steps(start: float, tolerance: float = 1e-7, most: int = 12) -> int:
    """How many cubic steps x ← 1.5x − 0.5x³ take every x in [start, 1] to within ``tolerance`` of 1 (the
    map is increasing on [0, 1], so the smallest x is the slowest); host arithmetic."""
    x = start
    for steps in range(most + 1):
        if 1 - x <= tolerance:
            return steps
        x = 1.5 * x - 0.5 * x ** 3
    return most


def msign(matrix: torch.Tensor, growth: int = 6, polish: int = 4,
          scale: float | torch.Tensor | None = None, split: bool = False) -> torch.Tensor:
    """Matrix sign U Vᵀ of M = U Σ Vᵀ by Newton–Schulz, matmuls only (Newhouse et al. 2025, after Muon).

    M is divided by ``scale`` (an upper bound of σ₁; by default ‖M‖_F) so that every singular value is in
    [0, 1]; singular values s ≥ 1e-3·scale then come out within 1e-5 of 1 with the defaults (tests), smaller
    ones lower (0 stays 0). With a ``scale`` close to σ₁, the top values need no growth steps. ``split``: its
    products as three TF32 products each (:func:`newton_schulz`)."""
    x, tall = _wide(matrix)
    if scale is None:
        scale = x.flatten(-2).norm(dim=-1)[..., None, None]
    elif isinstance(scale, torch.Tensor):
        scale = scale[..., None, None]
    # a float scale is floored by a comparison, not max(): compiled, a bound that changes every step stays a graph
    # input (a max of it is a node that AOTAutograd cannot turn into a tensor, and it would recompile each step)
    x = x / (scale + torch.finfo(x.dtype).tiny if isinstance(scale, torch.Tensor) else
             scale if scale > 1e-30 else 1e-30)
    x = newton_schulz(x, growth, polish, split)
    return x.mT if tall else x


def msign_svd(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix sign U Vᵀ of M = U Σ Vᵀ (exact, by SVD; zero singular values map to zero)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    keep = (s > s.amax(-1, keepdim=True) * 1e-12).to(matrix.dtype) if s.numel() else s
    return (u * keep.unsqueeze(-2)) @ vh


def hard_cap(weight: torch.Tensor, sigma_max: float, bound: float | None = None, sign_growth: int = 8,
             sign_polish: int = 4, split: bool = False) -> torch.Tensor:
    """Spectral hard cap W ↦ U·min(Σ, β)·Vᵀ in RMS units (β = σ_max), by the msign formula, matmuls only:

        cap(M; β) = ½[β f(M) + M − f(βI − f(M)Mᵀ)(β f(M) − M)],   f = msign          (Newhouse et al. 2025)

    On singular directions: with p = f's value at σ (≤ 1) and q = f's value at β − pσ, the result is
    ½[βp + σ − q(βp − σ)]: σ where q = 1 (σ < β), βp where q = −1 (σ > β). Only values of M at or above β
    need p ≈ 1, and q errs only where β − σ is tiny, where the error ½(1 − |q|)|β − σ| is tiny too.

    ``bound``: an a-priori upper bound of ‖M‖ (RMS units) that scales f's input instead of ‖M‖_F, so
    the values at β start near 1 and four cubic steps suffice (Muon's step bound). The second sign
    is taken on the small side (r × r, r = min(d_in, d_out)), its input scaled by max(β, ub − β) ≥ its
    spectral norm; ``sign_growth`` quintic steps resolve β − σ down to ~3e-5·β, ``sign_polish`` cubic steps
    finish it. Matches the SVD cap to ~1e-5·β (tests, float32).

    ``split``: every product as three TF32 products (:func:`tf32_parts`), for float32 weights where TF32 is
    on (a GPU: :func:`split_products_on`): the same cap to float32's tolerance at tensor-core speed, where one TF32
    product a step (10-bit mantissas) leaves the cap ~1e-3·β off (tests, with TF32 emulated on the CPU)."""
    return hard_caps([weight], sigma_max, bound, sign_growth, sign_polish, split)[0]


def hard_caps(weights: list[torch.Tensor], sigma_max: float, bound: float | None = None, sign_growth: int = 8,
              sign_polish: int = 4, split: bool = False) -> list[torch.Tensor]:
    """:func:`hard_cap` of each matrix or stack (…, m, n) in ``weights``, their iterations batched: the stacks that
    have one shape once made wide (a tall one transposed, e.g. an MLP's two matrices) take one first sign, and the
    second signs (r × r) run in as few Newton–Schulz batches as keep the padding small (:func:`padded_batches`: one
    batch where the widths are alike, as in a ViT, a batch a stage width on Swin), each padded with zeros to its
    largest r. This changes no value beyond rounding: each step maps a block-diagonal matrix block by block, and
    zero rows and columns stay zero. On a GPU it is the launches of one shape's iterations instead of one per shape
    and orientation. All of ``weights`` share one dtype and device (batched, mixed dtypes promoted a float32 matrix's
    result to float64, or failed in a product of two). ``split``: as in :func:`hard_cap` (float32 only)."""
    if split and weights[0].dtype != torch.float32:
        raise ValueError(f"hard_caps: split=True splits float32 products for TF32 units; got {weights[0].dtype}")
    if any(w.dtype != weights[0].dtype or w.device != weights[0].device for w in weights[1:]):
        kinds = sorted({f"{w.dtype} on {w.device}" for w in weights})
        raise ValueError(f"hard_caps: the weights are batched together and must share one dtype and device; got "
                         f"{', '.join(kinds)} (cap each group separately)")
    scales = [rms_scale(w) for w in weights]
    wide = [_wide(w * scale) for w, scale in zip(weights, scales)]
    flat = [m.reshape(-1, *m.shape[-2:]) for m, _ in wide]
    shapes = list(dict.fromkeys(tuple(m.shape[-2:]) for m in flat))  # first-seen order
    members = [[i for i, m in enumerate(flat) if tuple(m.shape[-2:]) == shape] for shape in shapes]
    merged = [flat[group[0]] if len(group) == 1 else torch.cat([flat[i] for i in group]) for group in members]
    signs, sign_inputs = [], []
    for m in merged:
        if bound is not None:  # values at β start at β/bound: cubic steps alone take them to 1 when it is near 1
            near = bound <= 1.5 * sigma_max
            f = msign(m, growth=0 if near else 6, polish=cubic_steps(sigma_max / bound) if near else 4, scale=bound,
                      split=split)
            upper = bound
        else:
            f = msign(m, split=split)
            upper = m.flatten(-2).norm(dim=-1)[..., None, None]  # ‖M‖_F ≥ σ₁
        eye = torch.eye(m.shape[-2], dtype=m.dtype, device=m.device)
        sign_input = _bmm(f, m.mT, split, out=eye, beta=sigma_max, alpha=-1.0)  # (r, r): eigenvalues in [β − ub, β]
        sign_scale = torch.clamp(upper - sigma_max, min=sigma_max) if isinstance(upper, torch.Tensor) else \
            upper - sigma_max if upper - sigma_max > sigma_max else sigma_max  # (no max(): as in msign)
        signs.append(f)
        sign_inputs.append(sign_input / sign_scale)
    second: list[torch.Tensor | None] = [None] * len(sign_inputs)  # each stack's second sign, (G, r, r) or padded
    for batch in padded_batches([(len(x), x.shape[-1]) for x in sign_inputs]):
        largest = max(sign_inputs[i].shape[-1] for i in batch)
        padded = [x if x.shape[-1] == largest else torch.nn.functional.pad(x, (0, largest - x.shape[-1]) * 2)
                  for x in (sign_inputs[i] for i in batch)]
        together = newton_schulz(padded[0] if len(padded) == 1 else torch.cat(padded), sign_growth, sign_polish,
                                 split)
        for i, q in zip(batch, together.split([len(x) for x in padded])):
            second[i] = q
    results: list[torch.Tensor | None] = [None] * len(weights)
    for m, f, x, q, group in zip(merged, signs, sign_inputs, second, members):
        r = x.shape[-1]
        capped = _bmm(q[:, :r, :r], sigma_max * f - m, split, out=sigma_max * f + m, beta=0.5, alpha=-0.5,
                      reuse_out=True)
        for i, part in zip(group, capped.split([len(flat[i]) for i in group])):
            tall = wide[i][1]
            part = part.reshape(wide[i][0].shape)
            results[i] = (part.mT if tall else part) / scales[i]
    return results


# A width joins the batch of a larger one while padding its second signs to that width adds at most this share of the
# larger width's own products. One batch padded to the largest r made Swin-T's hard cap 14× plain Muon's step on the
# CPU (its 96-wide signs padded to 768: 512× their products); a batch a stage width takes about 5×.
PAD_SHARE = 0.25


def padded_batches(sizes: list[tuple[int, int]], share: float | None = None) -> list[list[int]]:
    """The indices of ``sizes`` — (count, r) of each stack of r × r second-sign inputs — grouped into the Newton–Schulz
    batches :func:`hard_caps` runs, each padded to the r of its lead: whole widths, largest first, a width joining the
    batch led by a larger one while the padding of its own signs, count × (r_lead³ − r³), is at most ``share``
    (default ``PAD_SHARE``) of the lead width's products (its count × r_lead³), else leading a batch of its own. A
    batch saves launches (a GPU's time for small matrices: a ViT's head and patch embedding join its blocks' width);
    padding a small r to a much larger one multiplies its products by (r_lead / r)³ (Swin's stage widths lead a batch
    each). A batch's padded products are at most 1 + ``share`` × (the widths that joined it) times its members' own.
    Judged against the lead width alone, so that where a model's blocks lead (several matrices a block, against one
    head and one patch embedding: a ViT) the batches are the same at one block as at any depth (the step counts,
    ``benchmarks/step_cost.py``, extrapolate from one and two blocks, tested). Host arithmetic on shapes: the batches
    are fixed for a model (one compiled graph)."""
    share = PAD_SHARE if share is None else share
    by_size: dict[int, list[int]] = {}
    for i, (_, r) in enumerate(sizes):
        by_size.setdefault(r, []).append(i)
    batches: list[list[int]] = []
    lead = lead_count = 0
    for r in sorted(by_size, reverse=True):
        members = by_size[r]
        count = sum(sizes[i][0] for i in members)
        if batches and count * (lead ** 3 - r ** 3) <= share * lead_count * lead ** 3:
            batches[-1] += members
        else:
            batches.append(list(members))
            lead, lead_count = r, count
    return batches


def hard_cap_svd(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """The same cap from one SVD: U·min(Σ, β)·Vᵀ in RMS units (exact; for ``method: exact`` and tests)."""
    scale = rms_scale(weight)
    u, s, vh = torch.linalg.svd(weight * scale, full_matrices=False)
    return (u * s.clamp_max(sigma_max).unsqueeze(-2)) @ vh / scale


def hard_cap_msign_formula(weight: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """The msign formula with the exact (SVD) msign: the reference the tests hold both caps to."""
    scale = rms_scale(weight)
    m = weight * scale
    f = msign_svd(m)
    eye = torch.eye(m.shape[-2], dtype=m.dtype, device=m.device)
    capped = 0.5 * (sigma_max * f + m - msign_svd(sigma_max * eye - f @ m.mT) @ (sigma_max * f - m))
    return capped / scale


def soft_cap_alpha(k: float, sigma_max: float) -> float:
    """Smallest α ≥ 0 with p_α(k) = σ_max, i.e. root of −k⁹α⁴ + 3k⁷α³ − 3k⁵α² + (k − σ_max) = 0.

    k bounds the norm a weight can reach in one step; 0 when k ≤ σ_max (nothing to cap). Host
    arithmetic on plain numbers (k comes from the learning rate, not from the weights)."""
    if k <= sigma_max:
        return 0.0
    roots = np.roots([-k ** 9, 3 * k ** 7, -3 * k ** 5, 0.0, k - sigma_max])
    real = sorted(r.real for r in roots if abs(r.imag) < 1e-9 * max(1.0, abs(r)) and r.real >= 0)
    if not real:
        raise ValueError(f"soft cap: no real α ≥ 0 for k={k}, sigma_max={sigma_max}")
    return float(real[0])


def soft_cap(weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """M ← M(I − αMᵀM), then M ← M(I + αMᵀM): σ ↦ σ − 3α²σ⁵ + 3α³σ⁷ − α⁴σ⁹ (matmuls only)."""
    if alpha == 0:
        return weight
    scale = rms_scale(weight)
    m, tall = _wide(weight * scale)
    m = m - alpha * (m @ m.mT) @ m
    m = m + alpha * (m @ m.mT) @ m
    return (m.mT if tall else m) / scale


def soft_cap_polynomial(sigma: torch.Tensor, alpha: float) -> torch.Tensor:
    return sigma - 3 * alpha ** 2 * sigma ** 5 + 3 * alpha ** 3 * sigma ** 7 - alpha ** 4 * sigma ** 9


def _top_triplet(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(σ₁, u₁, v₁) of W by SVD: σ (...,), u (..., m), v (..., n)."""
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    return s[..., 0], u[..., :, 0], vh[..., 0, :]


def _outer(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return u.unsqueeze(-1) * v.unsqueeze(-2)


def hammer(weight: torch.Tensor, sigma_max: float,
           top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Spectral hammer: W ← W + (σ_max − σ₁) u₁v₁ᵀ in RMS units — the top singular value is *set* to
    σ_max, raised when below it (Newhouse et al. 2025). The others are untouched, so one above σ_max
    stays above it: the hammer was made for Adam's small steps, it is no cap.

    ``top`` = (σ₁, u₁, v₁) of W (not of M), e.g. from a persistent power iteration; None: exact, by SVD."""
    sigma, u, v = _top_triplet(weight) if top is None else top
    scale = rms_scale(weight)
    change = sigma_max / scale - sigma  # in W's units
    return weight + change[..., None, None] * _outer(u, v)


def spectral_weight_decay(weight: torch.Tensor, strength: float,
                          top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Spectral weight decay: W ← W − λ·σ₁u₁v₁ᵀ, the top singular value shrunk by (1 − λ) and nothing
    else (the reference code's fifth method; per step, not scaled by the learning rate). ``top`` as in
    :func:`hammer`."""
    sigma, u, v = _top_triplet(weight) if top is None else top
    return weight - strength * sigma[..., None, None] * _outer(u, v)


def normalise(weight: torch.Tensor, sigma_max: float, sigma: torch.Tensor | None = None) -> torch.Tensor:
    """Spectral normalisation: W ← W / max(1, ‖W‖_RMS / σ_max). ``sigma``: σ₁ of W per matrix (e.g. a
    power-iteration estimate, which lies below σ₁); None: exact."""
    if sigma is None:
        sigma = torch.linalg.matrix_norm(weight, ord=2)  # one per matrix of a stack
    return weight / (sigma * rms_scale(weight) / sigma_max).clamp_min(1.0)[..., None, None]


@torch.no_grad()
def orthogonal_rms_(weight: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Initialise in place to a random (semi-)orthogonal matrix scaled so that every RMS→RMS singular
    value is 1, i.e. ‖W‖_RMS = 1 (the reference Lipschitz transformer's initialisation)."""
    m, n = weight.shape
    gaussian = torch.randn(max(m, n), min(m, n), generator=generator, dtype=torch.float64, device="cpu")
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # uniform over orthogonal matrices
    q = q if m >= n else q.T
    return weight.copy_(q * (m / n) ** 0.5)


def rms_norm(weight: torch.Tensor) -> float:
    """‖W‖_RMS→RMS = sqrt(d_in/d_out)·σ₁(W) (exact; for tests and reports, not for per-step paths)."""
    return float(torch.linalg.matrix_norm(weight.detach(), ord=2)) * rms_scale(weight)


__all__ = ["JORDAN_QUINTIC", "cubic_steps", "hammer", "hard_cap", "hard_cap_msign_formula", "hard_cap_svd", "msign",
           "msign_svd", "newton_schulz", "normalise", "orthogonal_rms_", "rms_norm", "soft_cap", "soft_cap_alpha",
           "soft_cap_polynomial", "spectral_weight_decay"]
