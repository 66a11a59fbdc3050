"""Training-step time and memory of every stabilizer as a ratio to the baseline step: same model,
batch, seed and precision, one process, the stabilizers taking turns (interleaved) so machine noise cancels.

    python benchmarks/step_cost.py                       # ViT-Ti, Swin-T, CSwin-T × 64, 256 tokens, batch 64, fp32
    python benchmarks/step_cost.py --device cuda         # batch 256, fp32 and bf16 (autocast, as bf16-mixed)
    python benchmarks/step_cost.py --backbones vit --sizes micro --tokens 64 --repeats 3

Every registered stabilizer has a row (tests/test_benchmarks.py), and timm's own ``qk_norm=True`` one for comparison.
Targets on the CPU: specformer, qk_norm and sigma_reparam ≤ 1.10×, spectral_norm ≤ 1.15× (from the initialisation
and at the cap), lipsformer and softcap ≤ 1.20×, muon soft cap and hard cap ≤ 1.30× over plain Muon, jasmin ≤ 1.25×.
On a GPU (eager, ViT-S at 256 tokens for jasmin): the same, but softcap ≤ 1.15×, plain Muon ≤ 1.15× over AdamW, its
hard cap ≤ 1.20× over plain Muon, jasmin ≤ 1.30×, and the certified losses (gloro, emma, lipschitz_margin) ≤ 1.20×
over their base, the Lipschitz transformer with Muon's hard cap.

``--compiled "LABEL;…"`` also times those rows compiled, as ``--model.compile true`` trains them, against the compiled
baseline (GPU targets: the compiled baseline ≥ 1.3× faster than the eager one, each stabilizer compiled ≤ 1.10× the
compiled baseline, JaSMin ≤ 1.25×); a stabilizer refused compiled says why. ``--profile "LABEL;…"`` adds those rows'
operators by their own device time.

``--count`` times nothing: it counts each row's step on the GPU's code path on the CPU (launches, the bytes of the
non-matrix operators, matrix FLOPs by precision) and predicts its GPU time with the model fitted to a measured GPU
table (stability/testing/gpu_model.py; default: the H200's, results/benchmarks/step_cost_cuda_h200.md), or to
several (``--fit_also COUNTS_JSON=TABLE``: each further table with the counts of the code it measured).
``--count --host`` also times each row's step at a tiny width on the CPU (its kernels do next to nothing): the host's
work a step, and its time per launch, which checks the model's host term (launches × a time per launch).
"spectral_norm project, at the cap" starts from weights with σ₁ = σ_max (every weight is scaled every step:
the steady state of a run whose weights reached the cap); the plain row starts from the initialisation.
Its exact check (every ``check_every`` = 100 steps) is timed on its own and shown amortised per step.
Rows marked "exact" are the SVD / eigensolver versions, for comparison. Memory is measured after a warm-up step.
"""
from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from common import (
    CUT,
    ROOT,
    arguments,
    build_module,
    interleaved,
    markdown,
    memory_label,
    peak_memory,
    setup,
    time_once,
    train_step,
    write,
)

from stability.models.registry import PRESETS
from stability.nn import center_norm
from stability.nn.precision import allow_tf32_training
from stability.testing.gpu_model import (
    FORMS,
    NOMINAL_H200,
    PEAK_H200,
    PRECISIONS,
    GpuModel,
    StepCounts,
    count,
    cuda_path,
    extrapolate,
    fit,
    leave_one_out,
)


@dataclass(frozen=True)
class Case:
    label: str
    stabilizer: str
    options: dict | None = None
    reference: str = "none"           # the case its ratio is taken against
    target: float | None = None    # on CPU; GPU targets in gpu_target
    gpu_target: float | None = None
    vit_only: bool = False
    at_cap: bool = False          # start from weights at the cap (σ₁ = σ_max = 1)
    backbone_options: dict | None = None  # e.g. timm's own qk_norm, for comparison
    stabilizer_options: dict | None = None  # a composition's other stabilizers' options, by name

    def build(self, backbone: str, size: str, *, image_size: int, device: torch.device,
              backbone_options: dict | None = None, compile: bool = False, in_chans: int = 3,
              depth: int | None = None):
        """The case's module and optimizer (:func:`common.build_module`) with every option the case names: its
        stabilizers', its backbone's on top of ``backbone_options``; a counted ``depth`` over all of them. Every table
        builds its rows through this."""
        options = {**(backbone_options or {}), **(self.backbone_options or {})}
        if depth is not None:
            options["depth"] = depth
        return build_module(backbone, size, self.stabilizer, self.options, image_size=image_size, device=device,
                            backbone_options=options, compile=compile, in_chans=in_chans,
                            stabilizer_options=self.stabilizer_options)


CERTIFIED_BASE = "lipschitz_transformer + muon hard_cap"  # the certified losses' cost is taken over it
# the Lipschitz transformer's weight constraints as configs/stabilizer/lipschitz_transformer*.yaml set them (muon's own
# defaults are the soft cap on the hidden matrices)
EVERY_MATRIX_CAPPED = {"muon": {"constraint": "hard_cap", "layers": "all"}}
CASES = [
    Case("none", "none"),
    Case("jasmin k=10", "jasmin", {"lam": 1e-2, "k": 10}, target=1.25, gpu_target=1.3),
    Case("jasmin k=10, streamed", "jasmin", {"lam": 1e-2, "k": 10, "row_statistics": "streamed"}, vit_only=True),
    Case("jasmin k=10, materialized", "jasmin", {"lam": 1e-2, "k": 10, "row_statistics": "materialized"},
         vit_only=True),
    Case("specformer", "specformer", {"lam_q": 1e-2, "lam_k": 1e-2, "lam_v": 1e-2}, target=1.10, gpu_target=1.10),
    Case("spectral_norm project", "spectral_norm", {"mode": "project"}, target=1.15, gpu_target=1.15),
    Case("spectral_norm project, at the cap", "spectral_norm", {"mode": "project"}, target=1.15, gpu_target=1.15,
         at_cap=True),
    Case("spectral_norm project, exact", "spectral_norm", {"mode": "project", "method": "exact"}),
    Case("spectral_norm project, exact, at the cap", "spectral_norm", {"mode": "project", "method": "exact"},
         at_cap=True),
    Case("spectral_norm parametrize", "spectral_norm", {"mode": "parametrize"}, target=1.15, gpu_target=1.15),
    Case("lipsformer", "lipsformer", target=1.20, gpu_target=1.20),
    Case("muon (no constraint)", "muon", {"constraint": "none"}, gpu_target=1.15),  # over AdamW
    Case("muon soft_cap", "muon", {"constraint": "soft_cap"}, reference="muon (no constraint)", target=1.30,
         gpu_target=1.30),
    Case("muon soft_cap, measured update", "muon", {"constraint": "soft_cap", "update_norm": "measured"},
         reference="muon (no constraint)"),
    Case("muon hard_cap", "muon", {"constraint": "hard_cap"}, reference="muon (no constraint)", target=1.30,
         gpu_target=1.20),
    Case("muon hard_cap, tf32x3", "muon", {"constraint": "hard_cap", "cap_products": "tf32x3"},
         reference="muon (no constraint)", gpu_target=1.20),
    Case("muon hard_cap, exact", "muon", {"constraint": "hard_cap", "method": "exact"},
         reference="muon (no constraint)"),
    Case("qk_norm", "qk_norm", target=1.10, gpu_target=1.10),
    Case("timm qk_norm=True", "none", vit_only=True, backbone_options={"qk_norm": True}),
    Case("softcap", "softcap", target=1.20, gpu_target=1.15),
    Case("sigma_reparam", "sigma_reparam", target=1.10, gpu_target=1.10),
    Case("z_loss", "z_loss"),
    Case("tau_ce", "tau_ce"),
    Case("lipschitz_transformer + muon hard_cap", "lipschitz_transformer,muon", stabilizer_options=EVERY_MATRIX_CAPPED,
         vit_only=True),
    Case("lipschitz_transformer + muon + lipschitz_margin", "lipschitz_transformer,muon,lipschitz_margin",
         reference=CERTIFIED_BASE, gpu_target=1.20, stabilizer_options=EVERY_MATRIX_CAPPED, vit_only=True),
    Case("lipschitz_transformer + muon + gloro", "lipschitz_transformer,muon,gloro", reference=CERTIFIED_BASE,
         gpu_target=1.20, stabilizer_options=EVERY_MATRIX_CAPPED, vit_only=True),
    Case("lipschitz_transformer + muon + emma", "lipschitz_transformer,muon,emma", reference=CERTIFIED_BASE,
         gpu_target=1.20, stabilizer_options=EVERY_MATRIX_CAPPED, vit_only=True),
]
CHECK_EVERY = 100  # spectral_norm's default check_every


def label_list(text: str | None) -> tuple[str, ...]:
    """Row labels given as ``"a;b"`` (an option's value; None or empty: none)."""
    return tuple(label for label in (text or "").split(";") if label)


def case_labels(text: str | None, option: str) -> tuple[str, ...]:
    """:func:`label_list` of ``--option``'s value, every label a row of :data:`CASES` (a typo fails naming the rows)."""
    labels = label_list(text)
    if unknown := [label for label in labels if label not in {c.label for c in CASES}]:
        raise SystemExit(f"--{option} {unknown}: choose from {[c.label for c in CASES]}")
    return labels


def selected(cases: list[Case], only: tuple[str, ...], compiled: tuple[str, ...] = ()) -> list[Case]:
    """``cases`` restricted to ``only`` (all where empty) and the compiled rows, with the rows their ratios are taken
    against (references of references included)."""
    if not only:
        return cases
    wanted = set(only) | set(compiled) | {"none"}
    while not {c.reference for c in cases if c.label in wanted} <= wanted:
        wanted |= {c.reference for c in cases if c.label in wanted}
    return [c for c in cases if c.label in wanted]


def check_shape(backbone: str, size: str, tokens: int) -> int:
    """The side of the patch grid of ``tokens`` first-stage tokens of a transformer preset (a model with patches);
    anything else is refused by name (SystemExit), before anything is measured."""
    if "patch_size" not in PRESETS.get(backbone, {}).get(size, {}):
        choices = ", ".join(f"{name}:{preset}" for name, presets in PRESETS.items() for preset, options in
                            presets.items() if "patch_size" in options)
        raise SystemExit(f"no transformer preset {backbone}:{size}; choose one of {choices}")
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise SystemExit(f"--tokens {tokens}: need a square number of tokens")
    return side


def geometry(backbone: str, size: str, tokens: int) -> tuple[int, dict]:
    """Image size giving ``tokens`` first-stage tokens, and window / stripe options that fit it."""
    side = check_shape(backbone, size, tokens)
    image_size = side * PRESETS[backbone][size]["patch_size"]
    options = {}
    if backbone == "swin":
        options["window_size"] = min(8, side // 2)
    return image_size, options


@torch.no_grad()
def put_weights_at_the_cap(module) -> None:
    """Scale every Linear weight to σ₁ = 1 (the spectral_norm cap): each step then scales every weight."""
    stab = module.stabilizers[0]
    for m in module.network.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.mul_(1.0 / float(torch.linalg.matrix_norm(m.weight.double(), ord=2)))
    stab._previous = None  # method exact: its certified bounds are stale now


def verdict(ratio: float, target: float | None) -> str:
    if target is None or math.isnan(ratio):
        return ""
    return "met" if ratio <= target else f"missed by {100 * (ratio / target - 1):.1f}%"


def operator_table(step, device: torch.device, top: int = 15) -> str:
    """The ``top`` operators of one step (after a warm-up step) by their own time on the device (CUDA: the kernels'
    time; the CPU: host time), with their calls and share of the step: where a row's time goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize(device)  # the warm-up step's kernels stay out of the profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = profiler.key_averages()
    # the operators (host-side events) carry the device time of the kernels they launch; the kernels are listed again
    # as device events, which alone make the total (as torch's own table sums it)
    events = [e for e in averages if e.device_type == DeviceType.CPU and getattr(e, key) > 0]
    total = (sum(e.self_device_time_total for e in averages
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
             if cuda else sum(getattr(e, key) for e in events))
    rows = [[e.key[:80], e.count, getattr(e, key) / 1e3, f"{100 * getattr(e, key) / total:.1f}%"]
            for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]]
    return markdown(["operator", "calls", f"ms ({'device' if cuda else 'host'}, own)", "share"], rows)


COMPILED_BASELINE = 1.3  # the compiled baseline's speed-up over the eager one (GPU target)


def compiled_target(label: str, device: torch.device) -> float | None:
    """A stabilizer compiled, over the compiled baseline: ≤ 1.10×, JaSMin ≤ 1.25× (GPU targets)."""
    if device.type != "cuda" or label == "none":
        return None
    return 1.25 if label.startswith("jasmin") else 1.10


def measure(backbone: str, size: str, tokens: int, batch: int, device: torch.device, repeats: int,
            precision: str, profiled: tuple[str, ...] = (), sections: list[str] | None = None,
            compiled: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> list[list]:
    """The rows of one model shape (``only``: those rows, with the rows their ratios are taken against)."""
    image_size, options = geometry(backbone, size, tokens)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, image_size, image_size, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    cases = selected([c for c in CASES if backbone == "vit" or not c.vit_only], only, compiled)
    def step_of(case: Case, compile: bool = False):
        """The case's module and its training step (as ``--model.compile true`` trains it where ``compile``)."""
        module, optimizer = case.build(backbone, size, image_size=image_size, device=device, backbone_options=options,
                                       compile=compile)
        if case.at_cap:
            put_weights_at_the_cap(module)
        counter = iter(range(1, 10 ** 9))  # step indices: the timed steps are never check steps (1, 2, …, < 99)
        return module, lambda: train_step(module, optimizer, images, labels, precision, next(counter) % CHECK_EVERY)

    steps, memory, modules = {}, {}, {}
    for case in cases:
        modules[case.label], steps[case.label] = step_of(case)
        memory[case.label] = peak_memory(steps[case.label], device)
    refused = {}
    for case in [c for c in cases if c.label in compiled]:  # as --model.compile true: each its own compilation
        label = f"{case.label}, compiled"
        try:
            _, steps[label] = step_of(case, compile=True)
        except ValueError as refusal:
            if "cannot train compiled" not in str(refusal):
                raise
            refused[case.label] = str(refusal)
            continue
        steps[label]()  # compiles
        memory[label] = peak_memory(steps[label], device) if device.type == "cuda" else float("nan")
    print(f"{backbone}:{size}, {tokens} tokens, {precision}: timing {len(steps)} steps over {repeats} rounds",
          flush=True)
    seconds = interleaved(steps, device, repeats, keep_cut_rounds=True)
    for label in profiled:
        if label in steps and sections is not None:
            sections.append(f"### {label}: {backbone}:{size}, {tokens} tokens, {precision}\n\n"
                            + operator_table(steps[label], device))
    if "spectral_norm project, at the cap" in modules:
        capped = modules["spectral_norm project, at the cap"].stabilizers[0]
        check = sorted(time_once(lambda: capped.check(capped._weights()), device) for _ in range(3))[1]
    rows = []
    for case in cases:
        rows.append(row(backbone, size, tokens, precision, case.label, seconds[case.label], seconds[case.reference],
                        case.reference, target_of(case, device, tokens), memory[case.label], memory[case.reference]))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
        if case.label == "spectral_norm project, at the cap":  # with its exact check, amortised over check_every steps
            amortised = seconds[case.label] + check / CHECK_EVERY
            rows.append(row(backbone, size, tokens, precision, f"{case.label} + exact check every {CHECK_EVERY} steps "
                            f"({1000 * check:.0f} ms each)", amortised, seconds["none"], "none",
                            target_of(case, device, tokens), memory[case.label], memory["none"]))
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    for case in [c for c in cases if c.label in compiled]:
        label = f"{case.label}, compiled"
        if case.label in refused:
            rows.append([backbone, size, tokens, precision, label, float("nan"), "refused", "", refused[case.label],
                         float("nan"), ""])
        elif case.label == "none":  # the compiled baseline against the eager one
            speedup = seconds["none"] / seconds[label]
            target = COMPILED_BASELINE if device.type == "cuda" else None
            rows.append([backbone, size, tokens, precision, label, 1000 * seconds[label],
                         f"{seconds[label] / seconds['none']:.2f}× (none): {speedup:.2f}× faster",
                         f"≥ {target:.2f}× faster" if target else "",
                         "" if target is None else ("met" if speedup >= target else
                                                    f"missed by {100 * (1 - speedup / target):.1f}%"),
                         memory[label] / 2 ** 20, ""])
        else:
            rows.append(row(backbone, size, tokens, precision, label, seconds[label], seconds["none, compiled"],
                            "none, compiled", compiled_target(case.label, device), memory[label],
                            memory["none, compiled"]))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def target_of(case: Case, device: torch.device, tokens: int) -> float | None:
    target = case.gpu_target if device.type == "cuda" else case.target
    if case.label.startswith("jasmin k=10") and device.type == "cuda" and tokens < 256:
        return None  # the GPU target is stated at 256 tokens
    return target


def row(backbone, size, tokens, precision, label, seconds, reference_seconds, reference, target, memory,
        reference_memory) -> list:
    ratio = seconds / reference_seconds
    return [backbone, size, tokens, precision, label, 1000 * seconds,
            f"{ratio:.2f}× " + ("" if reference == "none" else f"({reference})"),
            f"≤ {target:.2f}×" if target else "", verdict(ratio, target),
            memory / 2 ** 20, "" if math.isnan(memory) else f"{memory / reference_memory:.2f}×"]


# ------------------------------------------------------------------------------------ the CPU model of the GPU step
H200_TABLE = ROOT / "results" / "benchmarks" / "step_cost_cuda_h200.md"
NOT_MODELLED = {  # rows whose time the counts cannot carry, and why
    "spectral_norm project, exact": "an SVD per matrix (cuSOLVER): no FLOP formula",
    "spectral_norm project, exact, at the cap": "an SVD per matrix (cuSOLVER): no FLOP formula",
    "muon hard_cap, exact": "an SVD per matrix in float64 (cuSOLVER): no FLOP formula",
    "muon soft_cap, measured update": "an eigensolver and a host sync per step",
}
COUNT_DEPTHS, COUNT_BATCHES = (1, 2), (2, 4)  # batch 1 takes special paths (one launch fewer)


def step_inputs(case: Case, backbone: str, size: str, image_size: int, options: dict, batch: int,
                depth: int | None = None):
    """The case's module on the CPU (its weights at the cap where the case starts there) and a seeded batch of
    ``batch`` images and labels: what a counted or host-timed step runs on."""
    module, _ = case.build(backbone, size, image_size=image_size, device=torch.device("cpu"),
                           backbone_options=options, depth=depth)
    if case.at_cap:
        put_weights_at_the_cap(module)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    return module, images, labels


def counted(case: Case, backbone: str, size: str, tokens: int, batch: int, precision: str) -> StepCounts:
    """The case's step counted on the GPU's code path (stability/testing/gpu_model.py), at the preset's depth and
    ``batch``, from steps of 1 and 2 blocks at batch 2 and 4."""
    image_size, options = geometry(backbone, size, tokens)
    counts = {}
    for depth in COUNT_DEPTHS:
        for images_per_step in COUNT_BATCHES:
            module, images, labels = step_inputs(case, backbone, size, image_size, options, images_per_step, depth)
            with cuda_path(module), center_norm.sized_as(batch / images_per_step):  # the batch-`batch` step's path
                optimizer = module.build_optimizer()  # fused Adam(W), as on CUDA
                train_step(module, optimizer, images, labels, precision, 1)  # the optimizer's state exists after it
                counts[depth, images_per_step] = count(partial(train_step, module, optimizer, images, labels,
                                                               precision, 2))
    return extrapolate(counts, PRESETS[backbone][size]["depth"], batch)


# per head; a step whose kernels do next to nothing, with tokens enough for every row's own path (JaSMin's k + 1 = 11
# top probabilities of each row: fewer keys would clip and pad them)
HOST_WIDTH, HOST_TOKENS, HOST_BATCH = 4, 16, 2
HOST_ROUNDS, HOST_STEPS = 7, 5  # the fastest round is the host's time


def host_time(case: Case, backbone: str, size: str, precision: str, rounds: int = HOST_ROUNDS,
              steps: int = HOST_STEPS, stands_for: tuple[int, int] | None = None) -> tuple[float, float]:
    """Seconds per step and launches of the case's step at the preset's depth but a tiny width (``HOST_WIDTH`` per
    head, ``HOST_TOKENS`` tokens, batch ``HOST_BATCH``), on the GPU's code path on the CPU: its kernels do next to
    nothing, so the time is what the step costs the host (Python, the dispatcher, each operator's call). The model's
    host term is launches × a time per launch; a row whose time per launch here stands out from the baseline's has
    host work the counts do not carry (hooks, parametrizations, Python loops). The fastest of ``rounds`` rounds of
    ``steps`` steps after three warm-up steps (as ``timeit`` reports: other work on the machine only adds time).
    ``stands_for`` (tokens, batch): the full-width step whose size decisions (CenterNorm's backward) it takes, its
    norms judged (its tokens·batch·width)/(HOST_TOKENS·HOST_BATCH·tiny width) times larger than the tiny step's
    (patch tokens: a class token makes the ratio 6% high at 16 tokens, which moves no decision at ViT-S's 101 MB)."""
    image_size, options = geometry(backbone, size, HOST_TOKENS)
    options["embed_dim"] = HOST_WIDTH * PRESETS[backbone][size]["num_heads"]
    module, images, labels = step_inputs(case, backbone, size, image_size, options, HOST_BATCH)
    index = (i for i in itertools.count(1) if i % CHECK_EVERY)  # never a check step
    scale = 1.0 if stands_for is None else (stands_for[0] * stands_for[1] * PRESETS[backbone][size]["embed_dim"]
                                            / (HOST_TOKENS * HOST_BATCH * options["embed_dim"]))
    with cuda_path(module), center_norm.sized_as(scale):
        optimizer = module.build_optimizer()
        for _ in range(3):
            train_step(module, optimizer, images, labels, precision, next(index))
        launches = count(partial(train_step, module, optimizer, images, labels, precision, next(index))).launches
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(steps):
                train_step(module, optimizer, images, labels, precision, next(index))
            seconds.append((time.perf_counter() - start) / steps)
    return min(seconds), launches


def measured_table(path: Path) -> dict[str, float]:
    """{stabilizer label: ms / step} of a step_cost.py table."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] in ("vit", "swin", "cswin"):
            rows[cells[4]] = float(cells[5])
    return rows


def modelled_rows(labels, measured: dict[str, float]) -> list[str]:
    """The rows of ``labels`` a GPU table fits the model to: those it measured, less the ones the model does not
    model (``NOT_MODELLED``)."""
    return [label for label in labels if label in measured and label not in NOT_MODELLED]


def fit_forms(data: list[StepCounts], seconds: list[float], groups: list[str], names: list[str],
              norm_rows: bool = False) -> tuple[str, dict]:
    """Each form of the model fitted to the rows, with its leave-one-out errors (by ``names``; the rows of one group
    left out together), and the form whose median error is the lower: ``(form, {form: (model, errors, fitted
    precisions, fixed rates, precisions held)})``. A precision's throughput is fitted only where its FLOPs differ
    between rows by ≥ 5% of a step's: otherwise the table cannot tell it from the constant part of every step, and it
    stays at the data sheet's value × 0.6; so does one that the fit drives to the data sheet's peak (the rows would
    have it faster: they do not determine it). ``norm_rows``: each form with a time per norm row as well
    (``gpu_model.norm_rows``)."""
    total = sum(c.total_flops() for c in data) / len(data)
    used = [p for p in PRECISIONS if max(c.flops.get(p, 0.0) for c in data) - min(c.flops.get(p, 0.0) for c in data)
            >= 0.05 * total]
    results = {}
    for form in FORMS:
        fitted_here, held = list(used), []
        while True:  # one rate held at a time: the others, refitted, may come off their peaks
            fixed = {f"{p}_flops_per_s": NOMINAL_H200[p] for p in PRECISIONS if p not in fitted_here}
            model = fit(data, seconds, form, fixed, PEAK_H200, norm_rows)
            at_peak = [p for p in fitted_here if model.flops_per_s[p] >= 0.999 * PEAK_H200[f"{p}_flops_per_s"]]
            if not at_peak:
                break
            fitted_here.remove(at_peak[0])
            held.append(at_peak[0])
        errors = dict(zip(names, leave_one_out(data, seconds, form, fixed, groups, PEAK_H200, norm_rows)))
        results[form] = (model, errors, fitted_here, fixed, held)
    form = min(FORMS, key=lambda f: sorted(abs(e) for e in results[f][1].values())[len(names) // 2])
    return form, results


def table_model(counts: dict[str, StepCounts], measured: dict[str, float], norm_rows: bool = False) -> GpuModel:
    """The model fitted to one GPU table (``measured``, ms by row) and the counts of the code it measured, as
    :func:`model_rows` fits it: what ``gpu_model.FITTED`` ships for the first H200 table (``norm_rows``: with a time
    per norm row, which it leaves out)."""
    labels = modelled_rows(counts, measured)
    form, results = fit_forms([counts[label] for label in labels], [measured[label] / 1000 for label in labels],
                              labels, labels, norm_rows)
    return results[form][0]


def model_rows(labels: list[str], counts: dict[str, StepCounts], measured: dict[str, float],
               as_measured: dict[str, StepCounts] | None = None,
               also: list[tuple[str, dict[str, StepCounts], dict[str, float]]] = (),
               norm_rows: bool = False) -> tuple[list, str]:
    """The table of counts, measured and predicted times and ratios, and a paragraph on the fit. The model is fitted
    to ``as_measured`` (the counts of the code the GPU table measured) where given, else to ``counts``; and to the
    rows of each further GPU table in ``also`` (its name, the counts of the code it measured, its times), a
    stabilizer's rows of every table left out together in the leave-one-out error. ``norm_rows``: the model prices
    CUDA's norm kernels by their rows as well (a column of them)."""
    rows_of_fit = labels if as_measured is None else list(as_measured)  # every row the GPU table has counts for
    as_measured = as_measured or counts
    fitted = modelled_rows(rows_of_fit, measured)
    data = [as_measured[label] for label in fitted]
    seconds = [measured[label] / 1000 for label in fitted]
    names, groups, tables = list(fitted), list(fitted), [None] * len(fitted)  # tables: None for the first
    for name, more_counts, more_measured in also:
        for label in modelled_rows(more_counts, more_measured):
            data.append(more_counts[label])
            seconds.append(more_measured[label] / 1000)
            names.append(f"{label} ({name})")
            groups.append(label)
            tables.append(name)
    form, results = fit_forms(data, seconds, groups, names, norm_rows)
    model, errors, used, fixed, held = results[form]
    blind = None
    if norm_rows:  # beside it, the model without the rows' term, fitted alike (the model of record's form)
        blind_form, blind_results = fit_forms(data, seconds, groups, names)
        blind, blind_errors = blind_results[blind_form][:2]
    reference = {case.label: case.reference for case in CASES}
    table = []
    for label in labels:
        c = counts[label]
        predicted = 1000 * model.seconds(c)
        ref = reference.get(label, "none")
        ratio = predicted / (1000 * model.seconds(counts[ref]))
        without = [] if blind is None else [
            f"{blind.seconds(c) / blind.seconds(counts[ref]):.2f}×",
            f"{100 * blind_errors[label]:+.0f}%" if label in blind_errors else ""]
        measured_ratio = (f"{measured[label] / measured[ref]:.2f}×" if label in measured else "—") + \
            ("" if ref == "none" else f" ({ref})")
        note = NOT_MODELLED.get(label, "") if label not in errors else f"{100 * errors[label]:+.0f}%"
        before = as_measured.get(label)
        if before is not None and (before.launches, round(before.bytes)) != (c.launches, round(c.bytes)):
            note += (f"; changed since the GPU run (then {before.launches:.0f} launches, {before.bytes / 1e9:.0f} GB: "
                     f"{1000 * model.seconds(before):.0f} ms predicted)")
        table.append([label, int(c.launches), c.bytes / 1e9, c.flops["bf16"] / 1e12, c.flops["tf32"] / 1e12,
                      c.flops["fp32"] / 1e12, *([c.norm_rows / 1e6] if norm_rows else []),
                      measured.get(label, float("nan")), predicted, measured_ratio, f"{ratio:.2f}×", note, *without])
    constants = model.constants()
    median = sorted(abs(e) for e in errors.values())[len(errors) // 2]
    worst = max(errors, key=lambda k: abs(errors[k]))
    other = [f for f in FORMS if f != form][0]
    other_median = sorted(abs(e) for e in results[other][1].values())[len(names) // 2]
    text = (f"Model: `{form}` (host {constants['launch_s'] * 1e6:.1f} µs per launch; device "
            + (f"{constants['kernel_s'] * 1e6:.1f} µs per kernel, " if form == "overlap" else "") +
            f"{constants['bytes_per_s'] / 1e12:.2f} TB/s for the non-matrix operators"
            + "".join(f", {p} {constants[f'{p}_flops_per_s'] / 1e12:.0f} TFLOP/s" for p in used)
            + (f", {model.row_s * 1e9:.2f} ns per norm row (a thread block of CUDA's LayerNorm or RMSNorm kernels)"
               if norm_rows else "")
            + (f"; {', '.join(f'{p} fixed at {NOMINAL_H200[p] / 1e12:.0f}' for p in PRECISIONS if p not in used)} "
               f"(0.6 × the H200's dense peak: the table does not determine it"
               + "".join(f"; {p} held there, the fit drove it to the peak" for p in held) + ")" if fixed else "")
            + f"), fitted to {len(names)} rows of "
            + (f"the H200 tables ({len(fitted)} of the first, "
               + ", ".join(f"{tables.count(name)} of {name}" for name, _, _ in also) + ")"
               if also else "the H200 table")
            + " by relative least squares. Leave-one-out error (each row predicted by the model fitted to the "
            f"{'other stabilizers' if also else 'others'}): median {100 * median:.0f}%, worst "
            f"{100 * errors[worst]:+.0f}% ({worst}); the `{other}` form's median is {100 * other_median:.0f}%.")
    for name, _, _ in also:
        theirs = {label: errors[n] for n, label, table in zip(names, groups, tables) if table == name}
        text += (f" The rows of {name}: " + ", ".join(f"{label} {100 * e:+.0f}%" for label, e in theirs.items())
                 + f" (median {100 * sorted(abs(e) for e in theirs.values())[len(theirs) // 2]:.0f}%).")
    return table, text


def kept_counts(path: Path) -> dict[str, StepCounts]:
    """The counts ``--count`` kept in ``path`` (an <out>.json), by row label."""
    return {label: StepCounts.from_dict(value) for label, value in json.loads(path.read_text())["counts"].items()}


def fit_also_pairs(option: str | None) -> list[tuple[str, str]]:
    """``--fit_also``'s (COUNTS_JSON, TABLE) pairs, each file checked to exist."""
    pairs = []
    for pair in filter(None, (option or "").split(";")):
        counts_path, sign, table = pair.partition("=")
        if not sign or not counts_path or not table:
            raise SystemExit(f"--fit_also {pair!r}: expected COUNTS_JSON=TABLE (pairs separated by ';')")
        missing = [path for path in (counts_path, table) if not Path(path).is_file()]
        if missing:
            raise SystemExit(f"--fit_also {pair!r}: no such file {', '.join(missing)}")
        pairs.append((counts_path, table))
    return pairs


def count_main(args, precision: str) -> None:
    backbone, _, size = args.backbones.partition(":")
    size = size or args.sizes.split(",")[0]
    if backbone != "vit":
        raise SystemExit("--count: the model is counted on the ViT (the H200 table's backbone)")
    tokens = int(args.tokens.split(",")[0])
    check_shape(backbone, size, tokens)
    cases = selected(CASES, label_list(args.cases))
    cache = Path(args.out).with_suffix(".json") if args.out else None
    key = f"{backbone}:{size}:{tokens}:{args.batch}:{precision}"
    saved = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    saved = saved if saved.get("key") == key else {"key": key, "counts": {}}
    measured = measured_table(Path(args.measured))
    as_measured = None
    if args.fit_counts:
        as_measured = kept_counts(Path(args.fit_counts))
    also = [(Path(table).name, kept_counts(Path(counts_path)), measured_table(Path(table)))
            for counts_path, table in fit_also_pairs(args.fit_also)]
    kept = {case.label: StepCounts.from_dict(saved["counts"][case.label]) for case in cases
            if case.label in saved["counts"] and not args.recount}
    if args.norm_rows:  # every count must carry its rows: counts kept before they were counted cannot be priced
        sources = [("--out's cache", kept), ("--fit_counts", as_measured or {}), *((n, c) for n, c, _ in also)]
        stale = [f"{source} ({label})" for source, by_label in sources for label, c in by_label.items()
                 if math.isnan(c.norm_rows)]
        if stale:
            raise SystemExit(f"--norm_rows: counts kept before norm rows were counted: {', '.join(stale[:4])}"
                             f"{' …' if len(stale) > 4 else ''}; count them again (--recount; for --fit_counts and "
                             f"--fit_also, in a checkout of the code the GPU table measured)")
    counts = {}
    for case in cases:
        if case.label in kept:
            counts[case.label] = kept[case.label]
        else:
            counts[case.label] = counted(case, backbone, size, tokens, args.batch, precision)
            saved["counts"][case.label] = counts[case.label].to_dict()
            if cache is not None:  # kept as it goes: the counts are deterministic, an interrupted run resumes
                cache.write_text(json.dumps(saved, indent=1) + "\n")
        c = counts[case.label]
        print(f"{case.label}: {c.launches:.0f} launches, {c.bytes / 1e9:.2f} GB, "
              + ", ".join(f"{p} {c.flops[p] / 1e12:.3f} TFLOP" for p in PRECISIONS), flush=True)
    rows, text = model_rows([c.label for c in cases], counts, measured, as_measured, also, args.norm_rows)
    header = ["stabilizer", "launches", "GB (non-matrix ops)", "bf16 TFLOP", "tf32 TFLOP", "fp32 TFLOP",
              *(["norm rows (M)"] if args.norm_rows else []), "H200 ms", "predicted ms", "H200 ratio",
              "predicted ratio", "leave-one-out error",
              *(["predicted ratio without rows", "leave-one-out error without rows"] if args.norm_rows else [])]
    if args.host:  # timed, not counted: never kept in <out>.json
        header += ["host ms (tiny width)", "launches (tiny width)", "host µs per launch"]
        for case, row_cells in zip(cases, rows):
            seconds, launches = host_time(case, backbone, size, precision, stands_for=(tokens, args.batch))
            row_cells += [1000 * seconds, int(launches), 1e6 * seconds / launches]
            print(f"{case.label}: host {1000 * seconds:.2f} ms a step at width {HOST_WIDTH} a head, "
                  f"{launches:.0f} launches", flush=True)
        text += (f"\n\nHost columns (`--host`): each row's step timed on this CPU at the preset's depth but "
                 f"{HOST_WIDTH} dimensions a head, {HOST_TOKENS} tokens, batch {HOST_BATCH}, on the GPU's code path "
                 f"(the fastest of {HOST_ROUNDS} rounds of {HOST_STEPS} steps): its kernels do next to nothing, "
                 f"so the time is the host's "
                 f"work, and its time per launch (counted at that shape) checks the model's host term, launches × a "
                 f"time per launch: a row far above the baseline's has host work its launches do not carry.")
    body = (f"{backbone}:{size}, {tokens} tokens, batch {args.batch}, {precision}: one training step counted on "
            f"the CPU on the GPU's code path (fused AdamW, JaSMin's streamed statistics, a fused attention kernel "
            f"where softcap uses FlexAttention), from steps of {COUNT_DEPTHS} blocks at batch {COUNT_BATCHES} "
            f"(stability/testing/gpu_model.py). Measured: `{Path(args.measured).relative_to(ROOT)}`"
            + (f", the model fitted to the counts of the code it measured (`{args.fit_counts}`)" if args.fit_counts
               else "") + f".\n\n{text}\n\n"
            + markdown(header, rows))
    write("step_model", args, torch.device("cpu"), "The GPU step predicted from CPU counts", body)


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--backbones", default="vit,swin,cswin",
                   help="comma-separated BACKBONE or BACKBONE:SIZE (e.g. vit:small,swin:tiny); without a size, --sizes")
    p.add_argument("--sizes", default="tiny")
    p.add_argument("--tokens", default="64,256", help="first-stage tokens (square numbers)")
    p.add_argument("--batch", type=int, default=None, help="default 64 on the CPU, 256 on CUDA")
    p.add_argument("--precision", default=None, help="fp32, bf16 or both (fp32,bf16); default: fp32 on the CPU, "
                                                      "both on CUDA")
    p.add_argument("--count", action="store_true",
                   help="no timing: count each case's step on the GPU's code path on the CPU and predict its GPU time "
                        "from the model fitted to --measured (default: the H200 table; at its shapes)")
    p.add_argument("--measured", default=str(H200_TABLE), help="a step_cost.py table of GPU times to fit the model to")
    p.add_argument("--cases", default=None, help="only these rows (labels separated by ';'), with the rows their "
                                                  "ratios are taken against")
    p.add_argument("--compiled", default="", help="rows (labels separated by ';') also timed compiled, as "
                                                  "--model.compile true, against the compiled baseline (always added)")
    p.add_argument("--profile", default="", help="rows (labels separated by ';') whose step is also profiled: its "
                                                 "operators by their own device time (host time on the CPU)")
    p.add_argument("--recount", action="store_true", help="--count: count again the rows kept in <out>.json")
    p.add_argument("--host", action="store_true", help="--count: also time each row's step at a tiny width on the "
                                                       "CPU (the host's work a step) and its time per launch")
    p.add_argument("--fit_also", default=None, help="--count: ';'-separated COUNTS_JSON=TABLE pairs, more GPU tables "
                                                    "to fit the model to, each with the counts of the code it measured")
    p.add_argument("--norm_rows", action="store_true",
                   help="--count: the model also prices CUDA's norm kernels by their thread blocks, a time per "
                        "normalised row, fitted with the rest (counts kept before it was counted need --recount)")
    p.add_argument("--fit_counts", default=None, help="--count: fit the model to these counts (a <out>.json of the "
                                                      "code the GPU table measured) and predict the current code's")
    args = p.parse_args()
    for option in ("cases", "compiled", "profile"):  # before the device: a typo fails here, not on the GPU
        case_labels(getattr(args, option), option)
    if args.norm_rows and not args.count:
        raise SystemExit("--norm_rows prices --count's counts: give --count too")
    if args.host and not args.count:
        raise SystemExit("--host times the host's work beside --count's counts: give --count too")
    if args.count:
        setup(args)
        args.backbones = args.backbones if args.backbones != "vit,swin,cswin" else "vit:small"
        args.tokens = args.tokens if args.tokens != "64,256" else "256"
        args.batch = args.batch or 256
        allow_tf32_training()  # the float32 matmuls a GPU run makes outside the exact blocks: TF32
        count_main(args, (args.precision or "bf16").split(",")[0])
        return
    device = setup(args)
    if args.batch is None:
        args.batch = 256 if device.type == "cuda" else 64
    if args.precision is None:
        args.precision = "fp32,bf16" if device.type == "cuda" else "fp32"
    precisions = args.precision.split(",")
    unknown = [p for p in precisions if p not in ("fp32", "bf16")]
    if unknown:
        raise SystemExit(f"--precision {unknown}: choose fp32, bf16 or both")
    if args.quick:
        args.backbones, args.sizes, args.tokens, args.batch, args.repeats = "vit:micro", "micro", "16", 2, 1
    rows, sections = [], []
    profiled, only = label_list(args.profile), label_list(args.cases)
    compiled = tuple(dict.fromkeys(("none", *label_list(args.compiled)))) \
        if args.compiled else ()
    if compiled:  # every compiled row is the network's forward compiled again: never fall back to eager silently
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    models = [(entry.partition(":")[0], size) for entry in args.backbones.split(",")
              for size in ([entry.partition(":")[2]] if ":" in entry else args.sizes.split(","))]
    shapes = [(precision, backbone, size, int(tokens)) for precision in precisions for backbone, size in models
              for tokens in args.tokens.split(",")]
    for _, backbone, size, tokens in shapes:  # every shape before any is measured: a typo loses no finished row
        check_shape(backbone, size, tokens)
    for done, (precision, backbone, size, tokens) in enumerate(shapes):
        shape, notes, profiles = f"{backbone}:{size}, {tokens} tokens, {precision}", len(CUT), len(sections)
        try:
            rows += measure(backbone, size, tokens, args.batch, device, args.repeats, precision, profiled,
                            sections, compiled, only)
        except KeyboardInterrupt:  # cut before its rows were complete: the shape is dropped
            CUT.append(f"interrupted while measuring {shape}, before its rows were complete (no row of it)")
            del sections[profiles:]
        CUT[notes:] = [note if shape in note else f"{shape}: {note}" for note in CUT[notes:]]
        if CUT:  # the time limit came: write what finished, name what did not
            left = [f"{b}:{z}, {t} tokens, {p}" for p, b, z, t in shapes[done + 1:]]
            if left:
                CUT.append("not measured: " + "; ".join(left))
            break
    header = ["backbone", "size", "tokens", "precision", "stabilizer", "ms / step", "time ratio", "target", "verdict",
              f"memory MiB ({memory_label(device)})", "memory ratio"]
    body = (f"Batch {args.batch}, median of {args.repeats} interleaved steps after 2 warm-up rounds; ratios to the "
            f"baseline step of the same model, batch and precision (muon's constraints: to plain Muon); bf16: the "
            f"forward under bf16 autocast, as `--trainer.precision bf16-mixed`. Memory: {memory_label(device)} during "
            f"one step after a warm-up step"
            + ("." if device.type == "cuda" else " (CPU keeps no allocator peak), each storage once.")
            + "\n\n" + markdown(header, rows)
            + ("\n\n## Where the profiled rows' time goes\n\n" + "\n\n".join(sections) if sections else ""))
    if not rows:
        raise SystemExit("step_cost: interrupted before any row was measured; nothing written")
    write("step_cost", args, device, "Training-step cost per stabilizer", body)
    if CUT:
        raise SystemExit(130)  # the table holds what finished; the exit status says it was cut


if __name__ == "__main__":
    main()
