"""What breaks on a GPU, caught on the CPU.

* Device placement: a tensor made without the model's device is a CPU tensor; on a GPU it collides with the
  model's. With the model on the CPU and the code run inside ``with torch.device("meta"):``, such a tensor
  lands on meta and collides the same way — for a training step, the projections, the bounds and every
  measurement, for every registered stabilizer on every backbone it applies to.
* Precision: each stabilizer's loss under CPU bf16 autocast against float32 (its own arithmetic is float32:
  the weight-only terms match to 1e-6, the attention terms within the forward's own bf16 error), JaSMin's
  streamed row statistics at logits as large as training produces, and every measurement, which must not
  depend on the training precision at all.
* Per-step cost: a training step that writes no logs reads nothing back to the host (no ``.item()``,
  ``float()``, ``.cpu()``, ``.tolist()``… from this package) and computes nothing in float64, for the baseline
  and every stabilizer, with the default callbacks.

The tests marked ``gpu`` run the same checks on a CUDA device (skipped without one; ``benchmarks/gpu_check.py``
runs them there), where ``torch.cuda.set_sync_debug_mode("error")`` catches every synchronisation, PyTorch's
and Lightning's included.
"""
import collections
import contextlib
import copy
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils._python_dispatch import TorchDispatchMode

import stability
from stability.callbacks import (
    DivergenceMonitor,
    EpochTimer,
    LipschitzMonitor,
    RobustnessMonitor,
    TensorBoardLayout,
    TrainingStability,
)
from stability.classifier import CROSS_ENTROPY, ImageClassifier
from stability.data import Digits
from stability.models import attention_sites, without_dropout
from stability.nn.row_statistics import top_probabilities_streamed
from stability.nn.softmax_bounds import top_probabilities
from stability.stabilizers import REGISTRY
from stability.stabilizers.muon import NS_COEFFICIENTS, newton_schulz_bound
from stability.testing import parity
from stability.testing.cuda_autocast import cuda_autocast

# heads at least 16 wide everywhere: the narrowest FlexAttention compiles on CUDA (softcap's fused path)
BACKBONES = {"vit": (8, dict(embed_dim=32, depth=2, num_heads=2)),
             "swin": (16, dict(embed_dim=32, depths=(1, 1), num_heads=(2, 2))),
             "cswin": (16, dict(embed_dim=32, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2))),
             "lipcnn": (8, {}), "hybrid": (8, {})}
EVERY = [",".join([*REGISTRY[name].needs, name]) for name in REGISTRY]
CASES = [(s, b) for s in EVERY for b in BACKBONES if all(b in REGISTRY[n].backbones for n in s.split(","))]
# the convolutional anchor certifies on its own: the losses that need a bound beside them run alone there
CASES += [(name, "lipcnn") for name, cls in REGISTRY.items() if cls.needs and "lipcnn" in cls.backbones]
# the per-step sync checks: every stabilizer on the ViT, the anchor alone and with each loss it trains with, and the
# hybrid with each stabilizer that applies to it
STEP_CASES = [(s, "vit") for s in EVERY] + [c for c in CASES if c[1] in ("lipcnn", "hybrid")]


def build(stabilizer: str, backbone: str, options: dict | None = None) -> ImageClassifier:
    size, backbone_options = BACKBONES[backbone]
    torch.manual_seed(0)
    return without_dropout(ImageClassifier(backbone=backbone, image_size=size, backbone_options=backbone_options,
                                           stabilizer=stabilizer, stabilizer_options=options))


def batch(module: ImageClassifier, count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    size = module.hparams.image_size
    return torch.rand(count, 1, size, size, generator=gen), torch.randint(0, 10, (count,), generator=gen)


def at_a_generic_point(module: ImageClassifier) -> ImageClassifier:
    """Weights where every compared quantity is defined up to rounding: every zero-initialised matrix (the Lipschitz
    transformer's head, W_O and MLP outputs) drawn at random — the logits of a zero head are all equal, and a margin
    between equal logits, a certified radius, is rounding noise; with zero W_O the class token never hears the image,
    the input gradient is rounding noise and so is the direction PGD steps in — and every matrix moved by 1% at random
    — an orthogonal matrix has all its singular values equal, so the gradient of σ₁ (the Lipschitz-margin loss
    differentiates it) is any direction of that subspace, and rounding picks one; and an isometric AOL kernel's Gram
    PᵀP has off-diagonal entries at rounding level, whose |·| (AOL's row sums) has a gradient of rounding's sign."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.network.parameters():
            if p.ndim not in (2, 4):  # matrices and convolution kernels
                continue
            if not p.abs().max() > 0:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            p.add_(torch.randn(p.shape, generator=gen) * 0.01 * float(p.abs().max()))
    return module


def training_step(module, optimizer, images, labels, step: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    _, terms = module.losses(images, labels)
    sum(t for name, t in terms.items() if name != CROSS_ENTROPY).backward()
    optimizer.step()
    module.after_optimizer_step(step)


measure_everything = parity.measurements  # every measurement the monitors take, as they take it


@pytest.mark.parametrize("stabilizer, backbone", CASES)
def test_nothing_is_made_off_the_models_device(stabilizer, backbone):
    module = build(stabilizer, backbone)
    module.train()
    optimizer = module.build_optimizer()
    images, labels = batch(module)
    training_step(module, optimizer, images, labels, 0)  # the optimizer's state exists before meta
    with torch.device("meta"):  # anything made without the model's device lands here and collides
        training_step(module, optimizer, images, labels, 1)
        measure_everything(module, images, labels)


@pytest.mark.parametrize("backbone", [b for b in BACKBONES if b not in ("lipcnn", "hybrid")])
def test_the_gpu_configurations_have_heads_the_flex_kernel_compiles(backbone):
    """What the GPU tests build must run there: every attention head at least 16 wide (Inductor's FlexAttention
    refuses narrower q, k, v; the CPU never shows it)."""
    from stability.nn.flex import MIN_WIDTH

    widths = {site.head_dim for site in attention_sites(build("qk_norm,softcap", backbone).network)}
    assert widths and min(widths) >= MIN_WIDTH, widths


@pytest.mark.parametrize("backbone", ["lipcnn", "hybrid"])
def test_an_aol_network_runs_on_meta_tensors(backbone):
    """The shapes of a step without its arithmetic (meta tensors, as op counts are taken): AOL's exact Gram switches
    autocast off, which raised on ``meta`` (no autocast there); forward and backward reach every weight."""
    stabilizer = "gloro" if backbone == "lipcnn" else "lipschitz_transformer,muon,gloro"
    module = build(stabilizer, backbone).to("meta")
    images = torch.empty(4, 1, module.hparams.image_size, module.hparams.image_size, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = module.network(images)
    assert logits.device.type == "meta" and logits.shape == (4, 10)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "meta"
               for p in module.network.parameters() if p.requires_grad)


def test_the_meta_check_catches_a_tensor_made_without_a_device():
    weight = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="meta"), torch.device("meta"):
        torch.zeros(3) + weight[0]  # the kind of line that crashed the Lipschitz-transformer bound on a GPU


def test_streamed_row_statistics_are_float32_under_bf16_autocast():
    """The case that failed: q, k = 3·randn and 6·randn (logits up to ~±60), the 11 largest probabilities of
    every row against float64 — within 1e-5 (they were 0.07 and 0.25 off when computed in bf16)."""
    gen = torch.Generator().manual_seed(0)
    for scale in (3.0, 6.0):
        q, k = (scale * torch.randn(2, 3, 65, 64, generator=gen) for _ in range(2))
        reference = top_probabilities(torch.softmax((q.double() @ k.double().mT) / 8, dim=-1), 11)
        with torch.autocast("cpu", torch.bfloat16):
            streamed = top_probabilities_streamed(q, k, 1 / 8, 11)
        assert streamed.dtype == torch.float32
        assert float((streamed.double() - reference).abs().max()) < 1e-5, scale


LOSS_TOLERANCE = {"task": 5e-3, CROSS_ENTROPY: 5e-3, "jasmin": 2e-2, "specformer": 1e-6, "z_loss": 1e-2}


@pytest.mark.parametrize("lists", ["cpu", "cuda"])
@pytest.mark.parametrize("stabilizer, backbone", CASES + [("jasmin", "vit-streamed")])
def test_each_stabilizers_loss_under_bf16_autocast_against_float32(stabilizer, backbone, lists):
    """Relative differences: the task loss within 5e-3 (the forward itself runs in bf16); Specformer's penalty,
    which reads only the weights, within 1e-6; JaSMin's within 2e-2 at attention logits up to ~±30 (its own
    arithmetic is float32; the queries, keys and, on the materialised path, the logits are the bf16 forward's
    — measured 9e-3 there, 1e-4 streamed); the margin's bound within 1e-6; the z-loss (float32 log²Z of the bf16
    forward's logits: twice the task's relative error) within 1e-2. Under the CPU's autocast lists and under CUDA's
    (stability/testing/cuda_autocast.py: what a GPU's bf16-mixed training casts, which differs)."""
    streamed = backbone.endswith("-streamed")
    backbone = backbone.removesuffix("-streamed")
    options = {"jasmin": {"lam": 1.0, "k": 10, "row_statistics": "streamed" if streamed else "materialized"}} \
        if stabilizer == "jasmin" else None
    module = build(stabilizer, backbone, options)
    with torch.no_grad():  # logits as large as training produces, and no zero-initialised (constant) output
        for site in attention_sites(module.network):
            site.qkv.weight[: 2 * site.qkv.weight.shape[0] // 3].mul_(4.0)
    with torch.no_grad():
        for p in module.network.parameters():
            if p.ndim == 2 and not p.abs().max() > 0:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    module.train()
    images, labels = batch(module, 8)
    state = copy.deepcopy(module.state_dict())  # the persistent power iterations advance on each call
    _, full = module.losses(images, labels)
    bounds = [s.last_bound for s in module.stabilizers if getattr(s, "last_bound", None) is not None]
    module.load_state_dict(state)
    with cuda_autocast() if lists == "cuda" else contextlib.nullcontext(), torch.autocast("cpu", torch.bfloat16):
        _, mixed = module.losses(images, labels)
    for name, value in full.items():
        relative = abs(float(mixed[name]) - float(value)) / max(abs(float(value)), 1e-12)
        assert relative <= LOSS_TOLERANCE[name], (name, relative)
    for stab, bound in zip([s for s in module.stabilizers if getattr(s, "last_bound", None) is not None], bounds):
        assert float(stab.last_bound) == pytest.approx(float(bound), rel=1e-6)


@pytest.mark.parametrize("lists", ["cpu", "cuda"])
@pytest.mark.parametrize("stabilizer, backbone", [("none", "vit"), ("lipschitz_transformer", "vit"),
                                                  ("lipsformer", "swin"), ("none", "cswin")])
def test_measurements_do_not_depend_on_the_training_precision(stabilizer, backbone, lists):
    """Under bf16 autocast with the CPU's lists, and with CUDA's (what a GPU's bf16-mixed run casts)."""
    module = build(stabilizer, backbone)
    images, labels = batch(module)
    full = measure_everything(module, images, labels)
    with cuda_autocast() if lists == "cuda" else contextlib.nullcontext(), torch.autocast("cpu", torch.bfloat16):
        mixed = measure_everything(module, images, labels)
    torch.testing.assert_close(mixed, full, rtol=0, atol=0)


class _Counting:
    """Counts host reads of tensors called from this package's code, and float64 results of any op, between
    ``start()`` and ``stop()``."""

    READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.reads: collections.Counter = collections.Counter()
        self.float64: collections.Counter = collections.Counter()
        self.on = False
        root = str(Path(stability.__file__).parent)
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if self.on:
                    caller = sys._getframe(1).f_code
                    if caller.co_filename.startswith(root):
                        self.reads[f"{_name} in {Path(caller.co_filename).name}:{caller.co_name}"] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        counting = self

        class Float64(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                        counting.float64[str(func)] += 1
                return out

        self._mode_class, self._mode = Float64, None

    def start(self):
        self.on, self._mode = True, self._mode_class()
        self._mode.__enter__()

    def stop(self):
        self.on = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


class _Window(L.Callback):
    """Counts over the training steps after the first (which sets up the optimizer's state)."""

    def __init__(self, counting, starts: bool):
        self.counting, self.starts = counting, starts

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.starts and batch_idx >= 1:
            self.counting.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.starts:
            self.counting.stop()


@pytest.mark.parametrize("stabilizer, backbone", STEP_CASES)
def test_a_training_step_reads_nothing_back_and_computes_nothing_in_float64(stabilizer, backbone, monkeypatch,
                                                                           tmp_path):
    """A Lightning fit with the default callbacks, logs written every 50 steps, 5 steps: the steps 2–5 read no
    tensor back to the host from this package's code and compute nothing in float64."""
    counting = _Counting(monkeypatch)
    L.seed_everything(0)
    module = build(stabilizer, backbone)
    callbacks = [_Window(counting, True), DivergenceMonitor(), TrainingStability(), EpochTimer(enabled=True),
                 TensorBoardLayout(), LipschitzMonitor(every_n_epochs=0), RobustnessMonitor(every_n_epochs=0),
                 _Window(counting, False)]
    trainer = L.Trainer(max_epochs=1, limit_train_batches=5, limit_val_batches=1, log_every_n_steps=50,
                        logger=TensorBoardLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                        callbacks=callbacks)
    trainer.fit(module, Digits(batch_size=32))
    assert not counting.reads and not counting.float64, (dict(counting.reads), dict(counting.float64))


def test_the_counting_catches_a_host_read_and_float64(monkeypatch, tmp_path):
    """``method: exact`` spectral normalisation reads its bounds back and computes in float64 every step."""
    counting = _Counting(monkeypatch)
    L.seed_everything(0)
    module = build("spectral_norm", "vit", {"spectral_norm": {"method": "exact"}})
    trainer = L.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, callbacks=[_Window(counting, True), _Window(counting, False)])
    trainer.fit(module, Digits(batch_size=32))
    assert counting.reads and counting.float64


@pytest.mark.gpu
@pytest.mark.parametrize("stabilizer, backbone", STEP_CASES)
def test_on_a_gpu_a_training_step_never_synchronises(stabilizer, backbone):
    """CUDA's own check: any synchronisation inside steps 2–4 (a read back, an eigensolver, a pageable copy)
    raises. bf16 autocast as ``--trainer.precision bf16-mixed`` trains."""
    module = build(stabilizer, backbone).cuda().train()
    optimizer = module.build_optimizer()
    images, labels = (t.cuda() for t in batch(module, 16))
    for step in range(4):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", torch.bfloat16):
                _, terms = module.losses(images, labels)
            optimizer.zero_grad(set_to_none=True)
            sum(t for name, t in terms.items() if name != CROSS_ENTROPY).backward()
            optimizer.step()
            module.after_optimizer_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def compare_sides(stabilizer: str, backbone: str, device: str, dtype: torch.dtype) -> list[parity.Difference]:
    """The reference (CPU, float32) against ``device`` in ``dtype``: loss terms, gradients, the weights after one step
    from the same gradients, and the measurements after it (stability/testing/parity.py says what each is relative
    to)."""
    cpu = at_a_generic_point(build(stabilizer, backbone)).train()
    images, labels = batch(cpu, 8)
    differences, other = parity.compare_training_step(cpu, images, labels, device, dtype)
    measured = parity.measurements(cpu, images, labels)
    measured_other = parity.measurements(other, images.to(device=device, dtype=dtype), labels.to(device))
    return differences + parity.compare_measurements(measured, measured_other)


@pytest.mark.parametrize("stabilizer, backbone", CASES)
def test_float64_matches_float32_by_the_device_comparison(stabilizer, backbone):
    """The comparison the GPU runs, on the CPU against float64: rounding of another size, the same definitions. A
    comparison that cannot hold across devices (a parameter with an exact zero gradient stepped by AdamW) fails here
    too (the test below), so this keeps the GPU comparison right without a GPU."""
    differences = compare_sides(stabilizer, backbone, "cpu", torch.float64)
    assert not parity.failures(differences), parity.describe(differences)


def test_on_the_cpu_adamw_moves_a_zero_gradient_parameter_by_the_sign_of_its_rounding_noise():
    """The GPU failure of qk_norm (k_norm.bias, qkv.bias) reproduced on the CPU with float64 as the other side: the key
    bias's exact gradient is 0 (softmax is shift-invariant along a row), each side's is rounding noise, and AdamW's
    first step moves it by lr·g/(|g| + ε) with that noise's sign and size. Compared after each side's own step, as the
    GPU test did, the two disagree beyond its tolerance; the parity comparison (same gradients) agrees."""
    module = build("qk_norm", "vit").train()
    images, labels = batch(module, 8)
    other = copy.deepcopy(module).double()
    for side, x in ((module, images), (other, images.double())):
        optimizer = side.build_optimizer()
        training_step(side, optimizer, x, labels, 0)
    name = next(n for n, _ in module.named_parameters() if n.endswith("k_norm.bias"))
    gradient = dict(module.named_parameters())[name].grad
    largest = max(float(p.grad.abs().max()) for p in module.parameters() if p.grad is not None)
    assert float(gradient.abs().max()) < 1e-5 * largest  # noise: the exact gradient is zero
    own_steps = parity.difference(name, dict(module.named_parameters())[name], dict(other.named_parameters())[name],
                                  1e-5)  # the old GPU test's atol (its rtol adds 1e-4 of a value that starts at 0)
    assert not own_steps.ok, str(own_steps)  # on the H100, where the noise outweighs AdamW's ε, they were ±lr apart
    differences = compare_sides("qk_norm", "vit", "cpu", torch.float64)
    assert not parity.failures(differences), parity.describe(differences)


def newton_schulz(gradient: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (Keller Jordan's quintic) in the gradient's own dtype."""
    a, b, c = NS_COEFFICIENTS
    x = gradient.T if gradient.shape[0] > gradient.shape[1] else gradient
    x = x / x.norm().clamp_min(1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if gradient.shape[0] > gradient.shape[1] else x


def test_muons_update_is_defined_only_in_size_across_devices():
    """Why parity runs Newton–Schulz in float32 for its comparison: on the gradients of a network near
    initialisation, torch.optim.Muon's bfloat16 Newton–Schulz result is O(1) away from the same iteration in float64
    (rounding multiplied by the quintic's slope 3.4 at 0, five times, in the small singular directions), while in
    float32 it agrees to 1e-3; two devices' bf16 results can differ as much, so a bf16 comparison could only hold the
    update to its size — which a skipped step passes (tests/test_parity.py). Each update, bf16 or exact, stays within
    MuonConstrained.step_bounds, the a-priori size each side is also checked against."""
    from torch.optim import _muon

    module = at_a_generic_point(build("lipschitz_transformer,muon", "vit")).train()
    images, labels = batch(module, 8)
    _, terms = module.losses(images, labels)
    sum(t for name, t in terms.items() if name != CROSS_ENTROPY).backward()
    muon = module.stabilizers[1]
    muon.build_optimizer(module.network, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
    bounds = muon.step_bounds()
    worst_bf16 = 0.0
    for p in module.network.parameters():
        if id(p) not in bounds or not p.grad.abs().max() > 0:
            continue
        exact = newton_schulz(p.grad.double())
        bf16 = _muon._zeropower_via_newtonschulz(p.grad, NS_COEFFICIENTS, 5, 1e-7).double()
        float32 = newton_schulz(p.grad.float()).double()
        worst_bf16 = max(worst_bf16, float((bf16 - exact).abs().max() / exact.abs().max()))
        assert float((float32 - exact).abs().max() / exact.abs().max()) < 1e-3
        lr = bounds[id(p)] / (min(p.shape) ** 0.5 * (p.shape[0] / p.shape[1]) ** 0.5 * newton_schulz_bound())
        for update in (bf16, exact):  # each side's update, as torch applies it, within the a-priori size
            size = float(torch.linalg.matrix_norm(update * lr * (p.shape[0] / p.shape[1]) ** 0.5))
            assert size <= bounds[id(p)], (size, bounds[id(p)])
    assert worst_bf16 > 0.1, worst_bf16


@pytest.mark.gpu
@pytest.mark.parametrize("stabilizer, backbone", CASES)
def test_on_a_gpu_losses_projections_and_measurements_match_the_cpu(stabilizer, backbone):
    """The same weights and batch in float32 (TF32 off), compared as stability/testing/parity.py defines: loss terms
    relative to themselves, gradients relative to the network's largest, the weights after one step from the same
    gradients, the measurements relative to their own scale. A failure prints every key over its tolerance, with both
    values."""
    differences = compare_sides(stabilizer, backbone, "cuda", torch.float32)
    assert not parity.failures(differences), parity.describe(differences)
