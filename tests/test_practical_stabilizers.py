"""The practical stabilizers the Lipschitz papers claim to replace — QK norm, σReparam, z-loss, soft-capping —
against their definitions, and the attention signals of the training-stability monitor against the logits
computed by hand."""
import math
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention
from torch import nn

from stability.callbacks import TrainingStability
from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.models import attention_sites, capture_attention, observe_attention_logits, without_dropout
from stability.models.adapters import heads_of
from stability.models.surgery import dot_product_kernels
from stability.nn.precision import ieee_float32
from stability.stabilizers import build_stabilizers
from stability.stabilizers.z_loss import ZLoss
from stability.testing.profiling import dispatched

BACKBONES = {"vit": (8, dict(embed_dim=16, depth=2, num_heads=2)),
             "swin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
             "cswin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2)))}


def build(backbone="vit", stabilizer="none", options=None):
    size, backbone_options = BACKBONES[backbone]
    torch.manual_seed(0)
    return without_dropout(ImageClassifier(backbone=backbone, image_size=size, backbone_options=backbone_options,
                                           stabilizer=stabilizer, stabilizer_options=options))


def images(module, count=4):
    size = module.hparams.image_size
    return torch.rand(count, 1, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("fused", [True, False])
def test_the_installed_dot_product_kernel_computes_the_backbones_own_attention(backbone, fused):
    module = build(backbone).eval()
    x = images(module)
    with torch.no_grad():
        before = module.network(x)
        dot_product_kernels(module.network.backbone, "test")
        for site in attention_sites(module.network.backbone):
            site.module.fused_attn = fused
        after = module.network(x)
    assert torch.allclose(before, after, atol=1e-6)


def test_qk_norm_is_timms_qk_norm():
    """Against timm's own ``Attention(qk_norm=True)`` with the same weights (LayerNorm ε = 1e-6, as timm's ViT)."""
    torch.manual_seed(0)
    reference = Attention(16, num_heads=2, qkv_bias=True, qk_norm=True, norm_layer=partial(nn.LayerNorm, eps=1e-6))
    with torch.no_grad():
        for norm in (reference.q_norm, reference.k_norm):
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.uniform_(-0.5, 0.5)
    module = build("vit", "qk_norm").eval()
    site = attention_sites(module.network.backbone)[0]
    plain = Attention(16, num_heads=2, qkv_bias=True)
    plain.load_state_dict({k: v for k, v in reference.state_dict().items() if "_norm" not in k})
    site.module.qkv, site.module.proj = plain.qkv, plain.proj
    site.module.kernel.q_norm.load_state_dict(reference.q_norm.state_dict())
    site.module.kernel.k_norm.load_state_dict(reference.k_norm.state_dict())
    x = torch.randn(3, 5, 16)
    for fused in (True, False):
        site.module.fused_attn = reference.fused_attn = fused
        assert torch.allclose(site.module(x), reference(x), atol=1e-6)


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_qk_norms_before_a_fused_kernel_run_token_major_with_the_same_values_and_gradients(norm, dtype, tolerance,
                                                                                         monkeypatch):
    """Before SDPA the QK norms run on the token-major views of q and k (dot_attention.token_major): SDPA gets
    token-major queries and keys, and the attention's output comes out token-major, so its merge into the
    projection's (B, N, h·d) input is a view, not a copy. The output and the gradients of the projection's output and
    of the norms' gains and biases equal those of the norms run head-major (the code before, whose output the merge
    copies), relative to each tensor's largest entry."""
    from stability.nn.dot_attention import DotProductKernel, norm_in_dtype

    gen = torch.Generator().manual_seed(0)
    batch, tokens, heads, width = 2, 9, 3, 8
    kernel = DotProductKernel(width ** -0.5, norm(width, eps=1e-6), norm(width, eps=1e-6)).to(dtype)
    with torch.no_grad():
        for p in kernel.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=dtype) + 0.5)
    projected = torch.randn(batch, tokens, 3 * heads * width, generator=gen, dtype=dtype)
    upstream = torch.randn(batch, heads, tokens, width, generator=gen, dtype=dtype)

    def attend(head_major: bool):
        qkv = projected.clone().requires_grad_(True)
        q, k, v = heads_of(qkv, heads, width)  # as KernelAttention makes them
        if head_major:
            out = F.scaled_dot_product_attention(norm_in_dtype(kernel.q_norm, q), norm_in_dtype(kernel.k_norm, k), v,
                                                 scale=kernel.scale)
        else:
            out = kernel(q, k, v, None, nn.Dropout(0.0), True)
        grads = torch.autograd.grad(out, [qkv, *kernel.parameters()], upstream)
        return out, grads

    received = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, _sdpa=F.scaled_dot_product_attention,
                        **kwargs: received.append((q, k)) or _sdpa(q, k, v, **kwargs))
    (out, grads), (want, want_grads) = attend(False), attend(True)
    assert all(t.transpose(1, 2).is_contiguous() for t in received[0])  # the normalised q and k, token-major
    assert out.transpose(1, 2).is_contiguous() and not want.transpose(1, 2).is_contiguous()  # a view, a copy before
    # the gains' and biases' gradients relative to the largest of them (the key bias's is 0 up to rounding: a shift
    # of every key moves a row's logits by one constant, which the softmax ignores)
    largest = max(float(g.abs().max()) for g in want_grads[1:])
    for got, expected in zip((out.detach(), *grads), (want.detach(), *want_grads)):
        scale = float(expected.abs().max()) if expected.dim() > 1 else largest
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * scale)


def test_the_norms_stay_head_major_where_sdpa_falls_back_to_its_math_path(monkeypatch):
    """Where SDPA runs its math fallback (attention dropout on the CPU; float64 on CUDA; on the CPU a bias that takes
    a gradient, Swin's learned one in training), which copies token-major queries and keys and writes its output
    head-major anyway, qk_norm's and LipsFormer's norms run head-major, as before: the rule
    (dot_attention.keeps_query_layout); both kernels with dropout on the CPU handing SDPA head-major q, token-major
    without; a Swin training step copying as much as with head-major norms (the rule ignoring the bias, planted: four
    copies more), and a Swin forward without gradients, whose bias goes to the flash kernel, copying less."""
    from stability.nn import cosine_attention, dot_attention
    from stability.nn.cosine_attention import ScaledCosineKernel
    from stability.nn.dot_attention import DotProductKernel, keeps_query_layout

    cpu, meta = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8, device="meta")  # meta: as a GPU's tensor
    assert keeps_query_layout(cpu, 0.0, None) and not keeps_query_layout(cpu, 0.1, None)
    assert keeps_query_layout(meta.bfloat16(), 0.1, None) and keeps_query_layout(meta, 0.0, None)
    assert not keeps_query_layout(meta.double(), 0.0, None)
    learned, fixed = torch.zeros(1, 1, 2, 2, requires_grad=True), torch.zeros(1, 1, 2, 2)
    assert not keeps_query_layout(cpu, 0.0, learned) and not keeps_query_layout(meta.bfloat16(), 0.0, learned)
    assert keeps_query_layout(cpu, 0.0, fixed) and keeps_query_layout(meta.bfloat16(), 0.0, fixed.to("meta"))

    monkeypatch.setattr(cosine_attention, "fused_norm_on", lambda device: True)  # LipsFormer's CUDA path
    q, k, v = heads_of(torch.randn(2, 9, 72), 3, 8)  # views of a qkv projection, as KernelAttention's
    for kernel in (DotProductKernel(8 ** -0.5, nn.LayerNorm(8), nn.LayerNorm(8)), ScaledCosineKernel(3)):
        received = []
        with monkeypatch.context() as patch:
            patch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, _sdpa=F.scaled_dot_product_attention,
                          _seen=received, **kwargs: _seen.append(q) or _sdpa(q, k, v, **kwargs))
            kernel.train()(q, k, v, None, nn.Dropout(0.1), True)
            kernel(q, k, v, None, nn.Dropout(0.0), True)
        with_dropout, without = received
        assert with_dropout.is_contiguous() and without.transpose(1, 2).is_contiguous(), type(kernel).__name__

    def copies(stabilizer: str, training: bool = True) -> int:
        module = build("swin", stabilizer).train(training)
        labels = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))

        def step():
            with torch.set_grad_enabled(training), torch.autocast("cpu", torch.bfloat16):
                _, terms = module.losses(images(module), labels)
            if training:
                sum(terms.values()).backward()
        return dispatched(step)["clone"]

    now = {(name, training): copies(name, training) for name in ("qk_norm", "lipsformer") for training in (True, False)}
    monkeypatch.setattr(dot_attention, "token_major", lambda norm, x: norm(x))  # the head-major norms
    monkeypatch.setattr(cosine_attention, "token_major", lambda norm, x: norm(x))
    for name in ("qk_norm", "lipsformer"):
        assert now[name, True] == copies(name), name
        assert now[name, False] < copies(name, training=False), name


def test_qk_norm_rmsnorm_normalises_each_heads_queries_and_keys():
    module = build("vit", "qk_norm", {"qk_norm": {"norm": "rmsnorm"}}).eval()
    site = attention_sites(module.network.backbone)[0]
    x = torch.randn(2, 5, 16)
    seen = []
    with observe_attention_logits(module.network.backbone, lambda name, logits: seen.append(logits)):
        site.module(x)
    q, k, _ = site.module.qkv(x).reshape(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # noqa: E731 (the definition)
    assert torch.allclose(seen[0], rms(q) @ rms(k).transpose(-2, -1) / math.sqrt(8), atol=1e-5)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_softcap_bounds_the_attention_and_final_logits_by_their_caps(backbone):
    module = build(backbone, "softcap", {"softcap": {"attention": 5.0, "logits": 3.0}}).eval()
    with torch.no_grad():  # weights large enough that the uncapped logits are far beyond the caps
        for site in attention_sites(module.network.backbone):
            site.qkv.weight.mul_(30.0)
        head = module.network.backbone.head
        (head.fc if hasattr(head, "fc") else head).weight.mul_(100.0)
    seen = []
    with torch.no_grad(), observe_attention_logits(module.network.backbone, lambda name, t: seen.append(t)):
        logits = module.network(images(module))
    if backbone == "swin":  # the relative-position bias and the shift mask are added after the cap
        assert max(float(t.amax()) for t in seen) > 4.0
    else:
        assert 4.0 < max(float(t.abs().amax()) for t in seen) <= 5.0
    module.network.logit_cap = None
    with torch.no_grad():
        uncapped = module.network(images(module))
    assert float(uncapped.abs().amax()) > 10.0
    assert torch.allclose(logits, 3.0 * torch.tanh(uncapped / 3.0), atol=1e-6)


def qk_norm_and_softcap_kernel(device: str = "cpu"):
    """A soft-capped kernel with QK norms of random gains, the kind ``qk_norm,softcap`` installs."""
    torch.manual_seed(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=32, depth=1, num_heads=2),  # heads 16 wide
                             stabilizer="qk_norm,softcap", stabilizer_options={"softcap": {"attention": 2.0,
                                                                                          "logits": None}})
    kernel = attention_sites(module.network.backbone)[0].module.kernel.to(device)
    with torch.no_grad():
        for norm in (kernel.q_norm, kernel.k_norm):
            norm.weight.uniform_(2.0, 4.0)  # logits well past the cap
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 17, 16, generator=gen).to(device) for _ in range(3))  # 16 wide: what flex compiles
    return kernel, q, k, v


def test_softcapped_flex_attention_computes_the_explicit_kernel_on_the_cpu():
    """FlexAttention with the tanh score_mod (the CUDA path) against the explicit softmax(c·tanh(s/c))·V, forward
    only (FlexAttention has no CPU backward; the GPU test below compares gradients); the CPU keeps the explicit path."""
    from stability.nn.dot_attention import norm_in_dtype
    from stability.nn.flex import softcapped_attention

    kernel, q, k, v = qk_norm_and_softcap_kernel()
    explicit = kernel(q, k, v, None, nn.Dropout(0.0), fused=True)
    with torch.no_grad():
        flex = softcapped_attention(norm_in_dtype(kernel.q_norm, q), norm_in_dtype(kernel.k_norm, k), v, kernel.scale,
                                    kernel.logit_cap, compiled=False)
    torch.testing.assert_close(flex, explicit.detach(), rtol=1e-5, atol=1e-6)
    assert not kernel.uses_flex(q, k, v, None, nn.Dropout(0.0), fused=True)  # on the CPU: explicit (it can train)


@pytest.mark.gpu
def test_on_a_gpu_softcap_runs_on_flex_attention_with_the_explicit_kernels_values_and_gradients():
    kernel, q, k, v = qk_norm_and_softcap_kernel("cuda")
    assert kernel.uses_flex(q, k, v, None, nn.Dropout(0.0), fused=True)
    outs, grads = [], []
    for fused in (True, False):  # fused: FlexAttention (compiled); not fused: the explicit path
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        with ieee_float32():
            out = kernel(*inputs, None, nn.Dropout(0.0), fused=fused)
            outs.append(out.detach())
            grads.append(torch.autograd.grad((out * torch.cos(out)).sum(), [*inputs, kernel.q_norm.weight]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))


def test_on_cuda_softcap_takes_flex_attention_only_where_its_kernel_compiles(monkeypatch):
    """The decision that avoids the CUDA-only failure: Inductor's FlexAttention refuses q, k, v narrower than 16, so
    narrower heads stay on the explicit path; a bias, attention dropout or the unfused path keep it too."""
    import stability.nn.dot_attention as dot_attention

    monkeypatch.setattr(dot_attention, "flex_trains_on", lambda device: True)  # as on a GPU
    kernel, q, k, v = qk_norm_and_softcap_kernel()
    off = nn.Dropout(0.0)
    assert kernel.uses_flex(q, k, v, None, off, fused=True)
    narrow = q[..., :8]
    assert not kernel.uses_flex(narrow, k[..., :8], v[..., :8], None, off, fused=True)
    assert not kernel.uses_flex(q, k, v[..., :15], None, off, fused=True)
    assert not kernel.uses_flex(q, k, v, torch.zeros(17, 17), off, fused=True)
    assert not kernel.uses_flex(q, k, v, None, off, fused=False)
    kernel.train()
    assert not kernel.uses_flex(q, k, v, None, nn.Dropout(0.1), fused=True)


def test_compiled_flex_attention_compiles_once_across_batch_sizes():
    """The last batch of an epoch and AutoAttack's shrinking batches change the batch size: one compile serves them
    all (counted by a compile-counting backend; a static compile counted 4 here)."""
    from torch._dynamo.testing import CompileCounter

    from stability.nn.flex import softcapped_attention

    counter = CompileCounter()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch in (4, 3, 7, 5):
            q, k, v = (torch.randn(batch, 2, 17, 16, generator=gen) for _ in range(3))
            out = softcapped_attention(q, k, v, 0.25, 2.0, backend=counter)
            reference = softcapped_attention(q, k, v, 0.25, 2.0, compiled=False)
            torch.testing.assert_close(out, reference)
    assert counter.frame_count == 1, counter.frame_count


def test_softcapped_flex_attention_inside_a_compiled_network_leaves_the_shapes_to_the_outer_graph():
    """A network compiled whole (--model.compile true) calls the capped kernel while dynamo traces it: the batch is
    not marked dynamic there (maybe_mark_dynamic may not be traced), FlexAttention is traced as part of the graph."""
    from stability.nn.flex import softcapped_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 17, 16, generator=gen) for _ in range(3))
    compiled = torch.compile(lambda a, b, c: softcapped_attention(a, b, c, 0.25, 2.0), backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), softcapped_attention(q, k, v, 0.25, 2.0, compiled=False))


def test_softcap_is_the_identity_near_zero():
    from stability.nn.dot_attention import soft_cap

    x = torch.linspace(-0.01, 0.01, 11)
    assert torch.allclose(soft_cap(x, 30.0), x, atol=1e-9)


def test_z_loss_is_lambda_times_the_mean_squared_log_normaliser():
    logits = torch.randn(6, 10) * 5 + 3
    step = type("Step", (), {"logits": logits})()
    expected = 1e-4 * (logits.double().exp().sum(-1).log() ** 2).mean()
    assert abs(float(ZLoss().loss(step)) - float(expected)) < 1e-9
    with torch.autocast("cpu", torch.bfloat16):
        assert ZLoss(lam=1.0).loss(type("Step", (), {"logits": logits.bfloat16()})()).dtype == torch.float32


def test_sigma_reparam_keeps_the_function_at_init_and_keeps_gamma_as_the_spectral_norm():
    plain = build("vit").eval()
    module = build("vit", "sigma_reparam").eval()
    x = images(module)
    with torch.no_grad():
        assert torch.allclose(plain.network(x), module.network(x), atol=1e-5)
    stab = module.stabilizers[0]
    linear = module.network.backbone.blocks[0].attn.qkv
    para = linear.parametrizations.weight[0]
    assert len(stab._parametrizations) == sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in plain.network.modules())
    with torch.no_grad():
        linear.parametrizations.weight.original.add_(0.3 * torch.randn_like(linear.weight))
        para.gamma.fill_(2.5)
        module.train()
        for _ in range(200):  # one power-iteration step per training forward
            linear(torch.zeros(1, 16))
        module.eval()
        effective = torch.linalg.matrix_norm(linear.weight.double(), ord=2)
        raw = torch.linalg.matrix_norm(linear.parametrizations.weight.original.double(), ord=2)
    assert abs(float(effective) - 2.5) < 1e-4 and abs(float(para.sigma) - float(raw)) < 1e-4 * float(raw)
    u = para.u.clone()
    with torch.no_grad():
        linear(torch.zeros(1, 16))  # evaluation mode: u stays
    assert torch.equal(u, para.u)


def test_sigma_reparam_trains_gamma_and_computes_sigma_in_float32_under_autocast():
    module = build("vit", "sigma_reparam").train()
    linear = module.network.backbone.blocks[0].mlp.fc1
    with torch.autocast("cpu", torch.bfloat16):
        loss = module.network(images(module)).float().square().mean()
    loss.backward()
    para = linear.parametrizations.weight[0]
    assert para.gamma.grad is not None and float(para.gamma.grad.abs()) > 0
    assert para.u.dtype == torch.float32 and para.sigma.dtype == torch.float32


@pytest.mark.parametrize("spec, options, message", [
    ("sigma_reparam,muon", None, "cannot be combined"),
    ("spectral_norm,sigma_reparam", None, "cannot be combined"),
    ("softcap", {"softcap": {"attention": None, "logits": None}}, "nothing would be capped"),
    ("softcap", {"softcap": {"attention": -1.0}}, "must be > 0"),
    ("qk_norm", {"qk_norm": {"norm": "batchnorm"}}, "layernorm"),
])
def test_bad_combinations_and_options_say_why(spec, options, message):
    with pytest.raises(ValueError, match=message):
        build_stabilizers(spec, options)


@pytest.mark.parametrize("spec, options", [
    ("lipsformer,qk_norm", None), ("lipschitz_transformer,softcap", None), ("qk_norm,lipsformer", None),
    ("softcap,lipschitz_transformer", None),
    ("qk_norm,lipschitz_transformer", {"lipschitz_transformer": {"attention": "l2"}}),
])
def test_changing_a_replaced_attention_kernel_names_the_conflict(spec, options):
    with pytest.raises(ValueError, match="computes its heads with|not a dot product|not a dot-product"):
        build("vit", spec, options)


def test_jasmin_sees_the_attention_qk_norm_leaves_whatever_the_order():
    for spec in ("jasmin,qk_norm", "qk_norm,jasmin"):
        jasmin = next(s for s in build("vit", spec).stabilizers if s.name == "jasmin")
        assert jasmin._supported is False, spec  # no plain timm attention left: materialised maps


def test_qk_norm_composes_with_softcap_and_dot_product_lipsformer():
    module = build("vit", "lipsformer,qk_norm,softcap", {"lipsformer": {"attention": "dot"}})
    kernel = attention_sites(module.network.backbone)[0].module.kernel
    assert isinstance(kernel.q_norm, nn.LayerNorm) and kernel.logit_cap == 50.0 and module.network.logit_cap == 30.0


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("stabilizer", ["none", "qk_norm", "softcap", "lipsformer"])
def test_the_observed_logits_are_those_of_the_softmax(backbone, stabilizer):
    """softmax(observed logits) = the attention probabilities the forward used (explicit path), call by call."""
    module = build(backbone, stabilizer).eval()
    x = images(module)
    seen = []
    with torch.no_grad():
        with observe_attention_logits(module.network.backbone, lambda name, t: seen.append((name, t))) as missing:
            observed_out = module.network(x)
        with capture_attention(module.network.backbone) as probs:
            explicit_out = module.network(x)
    assert not missing and len(seen) == len(probs) > 0
    assert torch.allclose(observed_out, explicit_out, atol=1e-5)
    for (_, logits), p in zip(seen, probs):
        assert torch.allclose(logits.softmax(-1), p, atol=1e-5)


def test_the_monitor_logs_attention_logits_entropy_and_log_z_on_logging_steps_only():
    L.seed_everything(0)
    module = build("vit")
    logged = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stability/")
                           and ("attn" in k or "log_z" in k)})

    trainer = L.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=2, callbacks=[TrainingStability(log_every_n_steps=2), Spy()])
    trainer.fit(module, Digits(image_size=8, batch_size=16))
    names = [site.name for site in attention_sites(module.network.backbone)]
    assert not logged[0] and set(logged[1]) == ({f"stability/attn_logit_max/{n}" for n in names}
                                               | {f"stability/attn_entropy/{n}" for n in names} | {"stability/log_z"})
    for n in names:  # 17 tokens: the entropy lies in [0, log 17]
        assert 0.0 <= logged[1][f"stability/attn_entropy/{n}"] <= math.log(17) + 1e-5
    assert all(math.isfinite(v) for v in logged[1].values())
