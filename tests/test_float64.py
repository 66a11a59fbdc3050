"""Float64 stays float64: a float64 network computes every training forward, loss term, gradient and projection in
float64 — no op of this package rounds through float32 (accumulate in at least float32 *and* the input's dtype) — and
its kernels agree with float64 references written from the papers' formulas.

A certificate is computed on a float64 copy of the network (stability/robustness/certified.py): a forward pass that
drops to float32 anywhere weakens what the certificate may claim."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stability.classifier import CROSS_ENTROPY, ImageClassifier
from stability.models import attention_sites, without_dropout
from stability.nn.cosine_attention import ScaledCosineKernel
from stability.stabilizers import REGISTRY

BACKBONES = {"vit": (8, dict(embed_dim=16, depth=2, num_heads=2)),
             "swin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
             "cswin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2))),
             "lipcnn": (8, {}), "hybrid": (8, {})}
EVERY = [",".join([*REGISTRY[name].needs, name]) for name in REGISTRY]
CASES = [(s, b) for s in EVERY for b in BACKBONES if all(b in REGISTRY[n].backbones for n in s.split(","))]
# the convolutional anchor certifies on its own: the losses that need a bound beside them run alone there
CASES += [(name, "lipcnn") for name, cls in REGISTRY.items() if cls.needs and "lipcnn" in cls.backbones]
NARROW = (torch.float32, torch.float16, torch.bfloat16)


class NarrowResults(TorchDispatchMode):
    """Records every op whose floating result is narrower than float64 while it is active."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in NARROW:
                self.found.append(f"{func} → {t.dtype}")
        return out


def float64_module(stabilizer: str, backbone: str) -> ImageClassifier:
    size, options = BACKBONES[backbone]
    torch.manual_seed(0)
    module = without_dropout(ImageClassifier(backbone=backbone, image_size=size, backbone_options=options,
                                             stabilizer=stabilizer))
    with torch.no_grad():  # no zero-initialised head: the loss terms then depend on every layer
        for p in module.network.parameters():
            if p.ndim == 2 and not p.abs().max() > 0:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return module.double()


@pytest.mark.parametrize("stabilizer, backbone", CASES)
def test_a_float64_training_step_never_rounds_through_float32(stabilizer, backbone):
    """The forward, every loss term, the backward and the stabilizers' projections (the optimizer's own step is
    torch's: Muon's Newton–Schulz runs in bfloat16 by design)."""
    module = float64_module(stabilizer, backbone)
    module.train()
    optimizer = module.build_optimizer()
    size = module.hparams.image_size
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(4, 1, size, size, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 10, (4,), generator=gen)
    with NarrowResults() as recorder:
        _, terms = module.losses(images, labels)
        sum(t for name, t in terms.items() if name != CROSS_ENTROPY).backward()
    optimizer.step()
    with NarrowResults() as projections:
        module.after_optimizer_step(0)
    assert not recorder.found and not projections.found, (recorder.found + projections.found)[:10]
    assert all(t.dtype == torch.float64 for t in terms.values())


def test_the_recorder_catches_a_float32_sum_of_a_float64_tensor():
    """The planted error: the line that made float64 LipsFormer compute ‖x‖² in float32."""
    x = torch.randn(3, 4, dtype=torch.float64)
    with NarrowResults() as recorder:
        (x * x).sum(-1, keepdim=True, dtype=torch.float32)
    assert recorder.found


def scsa_reference(x, w_q, w_k, w_v, heads, tau, nu, eps):
    """LipsFormer's SCSA (Eq. 6) written from the paper: q̂ = q/√(‖q‖² + ε) (k, v alike), ν·softmax(τ·q̂k̂ᵀ)·v̂ per
    head, heads concatenated and scaled by 1/K — float64 throughout."""
    n, _ = x.shape
    d = w_q.shape[0] // heads
    outs = []
    for h in range(heads):
        rows = slice(h * d, (h + 1) * d)
        q, k, v = x @ w_q[rows].T, x @ w_k[rows].T, x @ w_v[rows].T
        q, k, v = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps) for t in (q, k, v))
        outs.append(nu * torch.softmax(tau * q @ k.T, dim=-1) @ v)
    return torch.cat(outs, dim=-1) / heads


@pytest.mark.parametrize("fused_norm", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_scaled_cosine_attention_in_float64_matches_the_papers_formula(fused, fused_norm, monkeypatch):
    """To 1e-12: with ‖x‖² summed in float32 the two differed by 1e-7 to 2e-6. On either normalisation: CUDA's
    (``fused_norm``: RMSNorm with ε/d, the scales as its weight) and the CPU's (spelled out)."""
    from stability.nn import cosine_attention

    monkeypatch.setattr(cosine_attention, "fused_norm_on", lambda device: fused_norm)
    gen = torch.Generator().manual_seed(0)
    heads, d_model, n, tau, nu, eps = 2, 8, 5, 10.0, 1.3, 1e-6
    w_q, w_k, w_v = (torch.randn(d_model, d_model, generator=gen, dtype=torch.float64) for _ in range(3))
    x = 3 * torch.randn(n, d_model, generator=gen, dtype=torch.float64)
    kernel = ScaledCosineKernel(heads, tau, nu, eps).double()
    split = [(x @ w.T).view(1, n, heads, d_model // heads).transpose(1, 2) for w in (w_q, w_k, w_v)]
    out = kernel(*split, None, torch.nn.Dropout(0.0), fused)  # (1, H, N, d)
    out = out.transpose(1, 2).reshape(n, d_model)
    # τ and ν as the kernel holds them (learned parameters, created in float32: 1.3 is 1.2999999523… there)
    reference = scsa_reference(x, w_q, w_k, w_v, heads, float(kernel.tau), float(kernel.nu), eps)
    assert float((out - reference).abs().max()) < 1e-12


def test_lipsformer_vit_in_float64_agrees_between_its_fused_and_explicit_paths():
    module = float64_module("lipsformer", "vit")
    module.eval()
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fused = module.network(x)
    for site in attention_sites(module.network):
        site.module.fused_attn = False
    explicit = module.network(x)
    assert float((fused - explicit).abs().max()) < 1e-12 * max(1.0, float(fused.abs().max()))
    assert math.isfinite(float(fused.sum()))
