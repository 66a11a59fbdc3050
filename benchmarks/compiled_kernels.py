"""The compiled step's launches, counted on the CPU: the proxy for ``step_cost.py``'s compiled column.

    python benchmarks/compiled_kernels.py                 # ViT-S (12 blocks), bf16, every ViT row of step_cost
    python benchmarks/compiled_kernels.py --cases "none;qk_norm;jasmin k=10"

``--model.compile true`` compiles the network: its forward and backward become the statements of Inductor's
generated code that launch — its own kernels and the library calls it keeps (matrix products, fused attention),
counted in the code itself (:func:`wrapper_launches`). The code counted is the Triton program Inductor writes for an
H200, generated here without a GPU (:mod:`stability.testing.fake_gpu`: the graphs Inductor lowers, copied onto a fake
CUDA device); beside it, the C++ the CPU runs, as its loop nests and as its functions, which bracket a GPU's count
from above and below (a LayerNorm is two nests and one Triton kernel; the CPU writes nodes it cannot fuse into one
function). The optimizer, the projections and
most stabilizers' terms stay eager; a term that compiles whole (``Stabilizer.compiles_whole_term``: Specformer's
penalty, JaSMin's statistics) is counted the same way, from the code generated for its forward and backward. So a
compiled step launches

    the compiled network's launches + the compiled terms' + (the eager step's launches − the eager network's
    − the eager launches of the terms that compile − the eager launches of the power iterations, Muon's
    constraints and the certified losses' bound composition + the launches of their compiled graphs)

counted, as ``step_cost.py --count`` counts, on the GPU's code path (stability/testing/gpu_model.py), at the preset's
depth: the generated code is not affine in depth (a stack of more than 8 weights of a shape, σReparam's, compiles to
a kernel a weight where 2 or 3 fuse into their consumers), so nothing is extrapolated. The kernels do not depend on
the batch; the eager counts take the size decisions of the step they stand for (``--stands_for``, step_cost.py's
ViT-S step at 256 tokens and batch 256: CenterNorm's written-out backward, :func:`stands_for_scale`). Where a GPU is
host-bound, as small models are,
launches set the time: the ratio to the compiled baseline is then the compiled column's ratio. Where the GPU is busy
it is not: bytes and FLOPs change little by compiling.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch._inductor.config as inductor_config
from common import arguments, build_module, markdown, setup, train_step, write
from step_cost import CASES, case_labels, check_shape, geometry, put_weights_at_the_cap, selected
from torch._inductor.graph import GraphLowering

from stability.lipschitz import training_bound
from stability.models import capture_queries_keys
from stability.models.registry import PRESETS
from stability.nn import center_norm
from stability.nn.precision import float32_math
from stability.nn.spectral import SubspaceIteration
from stability.stabilizers.base import ForwardStep
from stability.stabilizers.muon import MuonConstrained
from stability.testing.fake_gpu import triton_code
from stability.testing.gpu_model import count, cuda_path

BATCH = 4
# a statement of Inductor's generated wrapper that calls something: `f(…)`, `buf = f(…)`, `(buf1, ) = f(…)`
CALL = re.compile(r"^[ \t]*(?:[\w \t,()\[\]]+=[ \t]*)?([\w.]+)\(", re.M)
KERNEL = re.compile(r"^(\w+) = async_compile\.", re.M)  # a kernel the module generates (C++, Triton, a template)
NO_LAUNCH = ("aten.view", "aten.reshape", "aten.as_strided", "aten.permute", "aten.expand")
# a library product that copies its input into the result first (gpu_model.hidden_copy): its first argument and β
COPYING = re.compile(r"^[ \t]*(?:[\w \t,()\[\]]+=[ \t]*)?extern_kernels\.(baddbmm|addmm|bias_addmm|addmv)\("
                     r"(reinterpret_tensor\(\w+, \(([^)]*)\)|\w+)(.*)$", re.M)
# a buffer's sizes where the code gives them: an input's assertion, an allocation, a reinterpretation
SIZES = re.compile(r"(?:assert_size_stride\((\w+), |(\w+) = (?:empty_strided_\w+\(|reinterpret_tensor\(\w+, ))"
                   r"\(([^)]*)\)")
BETA = re.compile(r"\bbeta=([-+\w.]+)")


# a C++ kernel and its code (a raw string since torch 2.11, a plain one before)
CPP_KERNEL = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(.*?r?\'\'\'(.*?)\'\'\'\)", re.M | re.S)
LOOP_NEST = re.compile(r"^    \{$", re.M)  # a loop nest of a C++ kernel: a block at the function body's own level


def loop_nests(code: str) -> int:
    """The loop nests of one of Inductor's C++ kernels: a block at the function body's own level each."""
    return max(1, len(LOOP_NEST.findall(code)))


def hidden_copies(body: str) -> int:
    """The copies the ``call`` function's library products make inside themselves (a kernel each on a GPU, that no
    statement shows; :func:`stability.testing.gpu_model.hidden_copy`): a ``baddbmm``, ``addmm`` or ``addmv`` with
    β ≠ 0 (Inductor always passes ``out``, never the input), except an ``addmm`` whose input is a 1-D bias with β = 1
    (cuBLASLt's epilogue; ``bias_addmm`` passes a 1-D bias). The ranks are read from the code's static sizes; an
    input whose sizes it does not show is taken as a bias (the count is then a lower bound)."""
    def rank(sizes: str) -> int:  # of a sizes tuple as the code writes it, "64, 64" or "64, "
        return len([d for d in sizes.split(",") if d.strip()])

    ranks = {a or b: rank(sizes) for a, b, sizes in SIZES.findall(body)}
    copies = 0
    for name, first, reinterpreted, rest in COPYING.findall(body):
        beta = BETA.search(rest)
        beta = float(beta.group(1)) if beta else 1.0
        rank_of_input = rank(reinterpreted) if reinterpreted else ranks.get(first, 1)
        rank_of_input = 1 if name == "bias_addmm" else rank_of_input
        copies += beta != 0 and not (name in ("addmm", "bias_addmm") and beta == 1 and rank_of_input == 1)
    return copies


def wrapper_launches(source: str) -> np.ndarray:
    """The launches of the ``call`` function of one of Inductor's generated modules — its own kernels (whatever their
    names), library calls (``extern_kernels.*``, with the copies some make inside themselves: :func:`hidden_copies`)
    and the ATen operators it falls back to — counted two ways:
    [a C++ kernel as its loop nests, as one]. On the CPU Inductor writes the nodes it cannot fuse, one after the
    other until a library call, as one C++ function with a loop nest each; on a GPU each would be a Triton kernel of
    its own (its horizontal "combo" kernels are off by default), so the functions undercount a GPU's kernels. The
    nests overcount them a little: a reduction and its consumer (a LayerNorm's statistics and its normalisation) are
    two nests on the CPU where Triton fuses them into one kernel."""
    kernels = {name: 1 for name in KERNEL.findall(source)}
    kernels.update({name: loop_nests(code) for name, code in CPP_KERNEL.findall(source)})
    body = source[source.index("def call("):]
    body = body[:body.index("\n\n\n")] if "\n\n\n" in body else body

    def launches(name: str) -> list[int]:
        aten = name.replace("torch.ops.", "")
        if name.split(".")[0] in kernels:
            return [kernels[name.split(".")[0]], 1]
        library = name.startswith("extern_kernels.")
        launch = int(library or (aten.startswith("aten.") and not aten.startswith(NO_LAUNCH)))
        return [launch, launch]

    return np.array([launches(name) for name in CALL.findall(body)] or [[0, 0]]).sum(0) + hidden_copies(body)


@contextlib.contextmanager
def generated_modules() -> Iterator[tuple[list[str], list[str]]]:
    """The source of every module Inductor generates inside the block (its caches off, so nothing is skipped), for
    the CPU it runs on and for an H200 (:func:`~stability.testing.fake_gpu.triton_code`): (C++, Triton)."""
    sources: list[str] = []
    original = GraphLowering.compile_to_module

    def recording(self):
        module = original(self)
        sources.append(Path(module.__file__).read_text())
        return module

    # one thread: with more, Inductor wraps consecutive loop nests in one parallel region, which counts as one nest
    with inductor_config.patch({"fx_graph_cache": False, "autotune_local_cache": False, "cpp.threads": 1}), \
            triton_code() as triton, mock.patch.object(GraphLowering, "compile_to_module", recording):
        yield sources, triton


def stands_for_scale(stands_for: str, tokens: int) -> tuple[int, int, float]:
    """``"tokens,batch"`` of the step the counts stand for → (tokens, batch, how many times larger that step is than
    the counted one of ``tokens`` tokens at batch ``BATCH``)."""
    try:
        stands_tokens, stands_batch = (int(n) for n in stands_for.split(","))
    except ValueError:
        stands_tokens = stands_batch = 0
    if min(stands_tokens, stands_batch) < 1:
        raise ValueError(f"--stands_for takes two positive integers, tokens,batch (e.g. 256,256); got {stands_for!r}")
    return stands_tokens, stands_batch, stands_tokens * stands_batch / (tokens * BATCH)


def counts_at(case, size: str, tokens: int, depth: int, precision: str,
              scale: float = 1.0) -> dict[str, float | None]:
    """One training step of ``case`` at ``depth`` blocks, on the GPU's code path: the eager step's launches and the
    eager network's (forward and backward), and the launches of the compiled network's forward and backward (None
    where the stabilizer refuses to train compiled). ``scale``: how many times larger the step it stands for is
    (tokens × batch), whose size decisions it takes (CenterNorm's written-out backward: ``center_norm.sized_as``;
    a compiled graph takes the formula at every size)."""
    image_size, options = geometry("vit", size, tokens)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(BATCH, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, 10, (BATCH,), generator=generator)
    result: dict[str, float | None] = {}
    for compile in (False, True):
        try:
            module, _ = case.build("vit", size, image_size=image_size, device=torch.device("cpu"),
                                   backbone_options=options, compile=compile, depth=depth)
        except ValueError as refusal:
            if compile and "cannot train compiled" in str(refusal):
                return {**result, "compiled": None}
            raise
        if case.at_cap:
            put_weights_at_the_cap(module)
        with cuda_path(module), center_norm.sized_as(scale):
            if compile:
                result["compiled"] = generated_launches(
                    lambda m=module: network_pass(m, images, precision, compiled=True))
                step = logits_step(module, images, labels, precision)
                result["terms compiled"] = generated_launches(lambda m=module, s=step: terms_pass(m, s), fresh=False)
                continue
            optimizer = module.build_optimizer()
            train_step(module, optimizer, images, labels, precision, 1)  # the optimizer's state exists after it
            with recorded_calls(SubspaceIteration, "step") as calls, \
                    recorded_calls(MuonConstrained, "_constrain") as constrained, \
                    recorded_calls(MuonConstrained, "_cap_all") as capped, recorded_compositions() as composed:
                step = count(lambda m=module, o=optimizer: train_step(m, o, images, labels, precision, 2))
            result["step"] = step.launches
            power = power_step_launches(calls)
            constraint = constraint_launches(constrained + capped)
            composition = composition_launches(composed)
            result["power eager"] = power[0] + constraint[0] + composition[0]
            result["power compiled"] = power[1] + constraint[1] + composition[1]
            module.zero_grad(set_to_none=True)  # as a step starts: no gradients to accumulate into
            network = count(lambda m=module: network_pass(m, images, precision)).launches
            with torch.no_grad():
                logits = module.network(images).to(torch.bfloat16 if precision == "bf16" else torch.float32)
            logits.requires_grad_(True)
            tail = count(lambda t=logits: t.float().sum().backward()).launches  # network_pass's, not the network's
            result["network"] = network - tail
            step = logits_step(module, images, labels, precision)
            result["terms eager"] = count(lambda m=module, s=step: terms_pass(m, s)).launches
    return result


def graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph breaks so far, by reason: an unsupported call is filed under ``graph_break``, a data-dependent
    branch (``if tensor:``) under ``unimplemented`` only."""
    counters = torch._dynamo.utils.counters
    return {**counters["unimplemented"], **counters["graph_break"]}


def generated_launches(run: Callable[[], object], fresh: bool = True) -> np.ndarray:
    """The launches of the code Inductor generates while ``run()`` runs, [Triton kernels for an H200, C++ loop nests,
    C++ functions] (:func:`wrapper_launches`; ``fresh``: Dynamo's caches reset first, so that what ``run`` compiles
    is compiled, and counted, anew). A graph break while it runs is an error: the pieces' launches are not those of
    the one graph a training step compiles."""
    if fresh:
        torch._dynamo.reset()
    breaks = graph_break_reasons()  # the process's so far (a reset keeps them)
    with generated_modules() as (cpp, triton):
        run()
    new = [reason for reason, times in graph_break_reasons().items() if times > breaks.get(reason, 0)]
    if new:  # the count would be the pieces' of a broken graph
        reasons = "; ".join(reason.split("\n")[0] for reason in new)
        raise RuntimeError(f"a graph break while counting the compiled code ({reasons[:500]}): a compiled training "
                           f"step runs without one (tests/test_compile.py), so its launches are not these")
    assert len(triton) == len(cpp), f"{len(triton)} graphs generated for the H200, {len(cpp)} for the CPU"
    kernels = sum((wrapper_launches(source)[1] for source in triton), 0)
    return np.array([kernels, *sum((wrapper_launches(source) for source in cpp), np.zeros(2, dtype=int))])


@contextlib.contextmanager
def recorded_calls(owner: type, method: str) -> Iterator[list[tuple]]:
    """The calls of ``owner.method`` made inside the block, each (the instance, its positional arguments, its keyword
    arguments), the arguments not copied (a copy would launch inside the count)."""
    calls: list[tuple] = []
    original = getattr(owner, method)

    def recording(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return original(self, *args, **kwargs)

    with mock.patch.object(owner, method, recording):
        yield calls


@contextlib.contextmanager
def recorded_compositions() -> Iterator[list[tuple]]:
    """The calls of the certified losses' bound composition (what :meth:`TrainingBound.composition` returns) made
    inside the block, each (the network, the σ estimates, whether the bound carries a gradient)."""
    calls: list[tuple] = []
    original = training_bound.TrainingBound.composition

    def recording(self):
        compose = original(self)

        def recorded(network, sigmas):
            calls.append((network, sigmas, self.differentiable))
            return compose(network, sigmas)

        return recorded

    with mock.patch.object(training_bound.TrainingBound, "composition", recording):
        yield calls


def composition_launches(calls: list[tuple]) -> tuple[int, int]:
    """The eager launches of the recorded bound compositions, forward and backward where the bound carries a gradient
    (into the σ estimates, taken as leaves, and the network's parameters; none with ``bound_gradient: false``), and
    those of the graph ``--model.compile`` runs them as (:meth:`TrainingBound.composition`)."""
    eager = compiled = 0
    graph = torch.compile(training_bound.composed_bound, fullgraph=True, dynamic=False)
    for network, sigmas, differentiable in calls:
        device = network.mean.device.type

        def forward(compose, network=network, sigmas=sigmas, device=device,
                    differentiable=differentiable) -> list[torch.Tensor]:
            leaves = {name: sigma.detach().requires_grad_(differentiable) for name, sigma in sigmas.items()}
            with float32_math(device):
                outputs = list(compose(network, leaves))
            return outputs if differentiable else []

        def backward(outputs: list[torch.Tensor]) -> None:
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])

        outputs: list[torch.Tensor] = []
        eager += count(lambda o=outputs, f=forward: o.extend(f(training_bound.composed_bound))).launches
        seeds = [torch.ones_like(out) for out in outputs]
        if outputs:
            eager += count(lambda o=outputs, g=seeds: torch.autograd.backward(o, g)).launches
        compiled += generated_launches(lambda f=forward: backward(f(graph)))
    return eager, compiled


def power_step_launches(calls: list[tuple]) -> tuple[int, int]:
    """The eager launches of the recorded power-iteration steps, and those of the graph ``--model.compile`` runs
    them as (:meth:`SubspaceIteration.compile`) with the stacks and the write-back it leaves eager (counted as they
    run around the graph): a compiled step counts the latter in place of the former."""
    eager = compiled = 0
    for power, args, kwargs in calls:
        eager += count(lambda p=power, a=args, k=kwargs: p.step(*a, **k)).launches
        was = power.compiled
        power.compile()
        with counted_calls(power, "stacked") as stacking, counted_calls(power, "write_back") as writing:
            compiled += generated_launches(lambda p=power, a=args, k=kwargs: p.step(*a, **k))
        compiled = compiled + sum(stacking) + sum(writing)
        power.compiled = was
    return eager, compiled


@contextlib.contextmanager
def counted_calls(instance: object, method: str) -> Iterator[list[float]]:
    """The launches of each call of ``instance.method`` made inside the block (eager work: counted as it runs)."""
    launches: list[float] = []
    original = getattr(instance, method)

    def counting(*args, **kwargs):
        out = []
        launches.append(count(lambda: out.append(original(*args, **kwargs))).launches)
        return out[0]

    with mock.patch.object(instance, method, counting):
        yield launches


def constraint_launches(calls: list[tuple]) -> tuple[int, int]:
    """The eager launches of the recorded constraints — ``_constrain`` calls (one shape group each) and ``_cap_all``
    calls (the hard cap of every group at once) — and those of the graphs ``--model.compile`` runs them as
    (:meth:`MuonConstrained.compile_terms`; the exact SVD path stays eager)."""
    eager = compiled = 0
    for stab, args, _ in calls:  # _project passes them all by position
        together = isinstance(args[0], list)  # _cap_all(stacks, largest)
        stacks = args[0] if together else [args[0].weight]
        constrain = stab._cap_all if together else stab._constrain
        device = stacks[0].device.type
        with float32_math(device):
            eager += count(lambda f=constrain, a=args: f(*a)).launches
        if not together and args[2]:  # exact
            compiled += count(lambda f=constrain, a=args: f(*a)).launches
            continue
        graph = torch.compile(constrain, fullgraph=True)

        def run(graph=graph, args=args, stacks=stacks, device=device):
            with float32_math(device):
                for stack in stacks:
                    torch._dynamo.mark_static(stack)
                graph(*args)

        compiled += generated_launches(run)
    return eager, compiled


def power_iteration_launches(size: str, tokens: int) -> tuple[int, int, int]:
    """The block power iteration of spectral_norm's projection over every Linear weight of the ViT preset (the
    :class:`~stability.nn.spectral.SubspaceIteration` step that Muon's constraints and the certified losses' bound
    also take): (weights, its eager launches, the launches of its compiled graph), counted at the preset's depth."""
    image_size, options = geometry("vit", size, tokens)
    module, _ = build_module("vit", size, "spectral_norm", image_size=image_size, device=torch.device("cpu"),
                             backbone_options=options)
    power, weights = module.stabilizers[0]._power, module.stabilizers[0]._weights()
    return len(weights), *power_step_launches([(power, (weights, 1), {})])


def terms_pass(module, step: ForwardStep) -> None:
    """The forward and backward of the terms that compile whole (``compiles_whole_term``) on ``step``: eager on an
    eager module, through their compiled graphs on a compiled one."""
    whole = [stab for stab in module.stabilizers if stab.compiles_whole_term and stab.compile_refusal() is None]
    if whole:
        sum(stab.loss(step) for stab in whole).backward()


def logits_step(module, images: torch.Tensor, labels: torch.Tensor, precision: str) -> ForwardStep:
    """A step's forward, made before a count (the terms' counts leave the network out), with the queries and keys
    (leaves that take a gradient) where a stabilizer reads them."""
    reads = any(stab.needs_queries_keys for stab in module.stabilizers)
    captured = capture_queries_keys(module.network.backbone) if reads else contextlib.nullcontext([])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"), captured as found:
        logits = module.network(images)
    queries_keys = [(q.detach().requires_grad_(True), k.detach().requires_grad_(True), scale)
                    for q, k, scale in found]
    return ForwardStep(module.network, images, logits, labels, queries_keys=queries_keys)


def cell(counts: np.ndarray, form: str = "{:.0f}") -> str:
    """[Triton kernels, C++ loop nests, C++ functions] as a table cell: ``kernels (nests, functions)`` (a plain
    number: eager, all alike)."""
    counts = np.broadcast_to(counts, 3)
    return f"{form.format(counts[0])} ({form.format(counts[1])}, {form.format(counts[2])})"


def network_pass(module, images: torch.Tensor, precision: str, compiled: bool = False) -> None:
    """The network's forward and backward alone (``compiled``: through the graph a compiled step trains)."""
    network = module._training_network(images) if compiled else module.network
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        out = network(images)
    logits = out[0] if isinstance(out, tuple) else out  # JaSMin's compiled graph also returns queries and keys
    logits.float().sum().backward()


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--size", default="small", help="ViT preset (counted at its depth)")
    p.add_argument("--tokens", type=int, default=16, help="tokens of the counted steps (counts barely depend on it)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--cases", default=None, help="';'-separated row labels of step_cost.py (default: its ViT rows)")
    p.add_argument("--stands_for", default="256,256",
                   help="tokens,batch of the step the counts stand for (step_cost.py --device cuda's), whose size "
                        "decisions the eager counts take (CenterNorm's backward)")
    args = p.parse_args()
    try:
        stands_tokens, stands_batch, scale = stands_for_scale(args.stands_for, args.tokens)
    except ValueError as error:
        p.error(str(error))
    if args.quick:
        args.size, args.cases = "micro", args.cases or "none;qk_norm"
    check_shape("vit", args.size, args.tokens)
    device = setup(args)
    only = case_labels(args.cases, "cases")
    depth = PRESETS["vit"][args.size]["depth"]
    rows, compiled_steps = [], {}
    for case in selected([c for c in CASES if not c.label.endswith("exact") and "exact," not in c.label], only):
        at = counts_at(case, args.size, args.tokens, depth, args.precision, scale)
        print(f"{case.label}: {at}", flush=True)

        eager = at["step"]
        if at["compiled"] is None:
            rows.append([case.label, f"{eager:.0f}", "—", "—", "—", "refused compiled", "—"])
            continue
        network, terms = at["network"], at["terms compiled"]
        region = at["compiled"] + terms
        # what stays eager, its power-iteration steps (which compile) counted as their compiled graph's launches
        outside = (eager - network - at["terms eager"] - at["power eager"]
                   + at["power compiled"])
        compiled = compiled_steps[case.label] = region + outside
        reference = compiled_steps.get(case.reference)
        ratio = "—" if reference is None else cell(compiled / reference, "{:.2f}×") + (
            f" ({case.reference})" if case.reference != "none" else "")
        rows.append([case.label, f"{eager:.0f}", f"{network:.0f}", cell(region), cell(outside), cell(compiled),
                     ratio])
    body = (f"ViT-{args.size} ({depth} blocks), {args.precision}, counted at its depth on {args.tokens} tokens "
            f"(module docstring), taking the size decisions of the step at {stands_tokens} tokens and batch "
            f"{stands_batch} it stands for (CenterNorm's backward). `eager step`: the eager step's launches on the "
            "GPU's code path; "
            "`network, eager` and `network, compiled`: its forward and backward, eager and as the launches of "
            "Inductor's generated code (kernels and library calls), with the terms that compile whole (Specformer's "
            "penalty, JaSMin's statistics); `eager outside`: the step's other launches (the other stabilizers' "
            "terms, the optimizer, the projections), where the block power iteration, Muon's constraints and the "
            "certified losses' bound composition (forward and backward), which --model.compile compiles into graphs "
            "of their own, count as those graphs' launches; `compiled step`: the compiled network and terms and what "
            "stays eager, and its ratio to its reference compiled (step_cost.py's: the baseline, plain Muon for its "
            "constraints, the certified losses' base for them), the compiled column's ratio where launches set the "
            "time. Each compiled count is `kernels (nests, functions)`: the launches of the Triton program Inductor "
            "writes for an H200, generated without a GPU (stability/testing/fake_gpu.py; a fused attention counted "
            "as one launch forward and one backward), and, for comparison, of the C++ the CPU runs, its kernels "
            "counted as their loop nests (above a GPU's count: a LayerNorm is two nests, one Triton kernel) and as "
            "its functions (below it: the CPU writes nodes it cannot fuse into one function).\n\n"
            + markdown(["row", "eager step", "network, eager", "network, compiled", "eager outside",
                        "compiled step", "× its reference, compiled"], rows))
    matrices, eager, compiled = power_iteration_launches(args.size, args.tokens)
    body += (f"\n\nThe block power iteration alone (spectral_norm's projection over the {matrices} Linear weights of "
             f"ViT-{args.size}; Muon's constraints and the certified losses' bound take the same step), which "
             f"`--model.compile` compiles into one graph of its own: {eager:.0f} launches eager, {cell(compiled)} "
             "compiled. The rows above count it compiled, inside `eager outside`.")
    write("compiled_kernels", args, device, "The compiled step's launches, counted on the CPU", body)


if __name__ == "__main__":
    main()
