"""The hard cap's second signs batched four ways, on each backbone's constrained matrices: the projection alone, timed,
counted on the GPU's code path, and priced by the H200 step model.

    python benchmarks/cap_batches.py                          # ViT-Ti, Swin-T, CSwin-T on the CPU (~8 min, 2 threads)
    python benchmarks/cap_batches.py --device cuda            # the same on a GPU (seconds)
    python benchmarks/cap_batches.py --count --cap_products tf32x3   # no timing: the 3xTF32 cap counted and priced
    python benchmarks/cap_batches.py --count --model fp32_flops_per_s=45e12   # priced with another constant
    python benchmarks/cap_batches.py --quick                  # micro presets (tests)

``muon``'s hard cap (``constraints.hard_caps``) takes one first sign a weight shape and then a second sign of an
r × r matrix for each (r = the shape's smaller side), run as few Newton–Schulz batches, each padded with zeros to its
largest r. Which widths share a batch trades launches (a GPU's cost for small matrices) for padded products. The
batchings compared, each on the same matrices:

- ``by width``: the suite's (``constraints.padded_batches``): a width joins a larger one's batch while its padding
  costs at most a quarter of that width's products;
- ``by width, share s``: the same rule with another share (``--shares``; a larger share joins more widths);
- ``each shape alone``: one batch a weight shape (no padding, most launches);
- ``one batch``: every second sign padded to the largest r (fewest launches, most products).

Each row is one call of the projection a training step makes after Muon's update (``MuonConstrained._project``: the
weights stacked by shape, capped, copied back), at the step bound of Muon's default learning rate. ``ms``: its time
here (the median of ``--repeats`` interleaved calls); launches, GB and GFLOP: counted on the GPU's code path (on a
CPU, as a GPU would take it: ``stability.testing.gpu_model``; float32 products as three TF32 products each with
``--cap_products tf32x3``, which only a GPU times: on the CPU, whose cap takes IEEE float32 products, with ``--count``
only);
``H200 ms``: the step model fitted to the H200's step table, applied to those counts: a prediction (``--model``: with
some of its constants replaced, e.g. those of another fit).
"""
from __future__ import annotations

import contextlib
import functools
import math
from unittest import mock

import torch
from common import CUT, arguments, build_module, interleaved, markdown, setup, write

from stability.nn import constraints
from stability.testing import gpu_model

BACKBONES = "vit:tiny,swin:tiny,cswin:tiny"
QUICK_BACKBONES = "vit:micro,swin:micro,cswin:micro"
SUITE = "by width"
BY_WIDTH = constraints.padded_batches  # the suite's rule, kept before any batching below replaces it


def each_alone(sizes: list[tuple[int, int]]) -> list[list[int]]:
    return [[i] for i in range(len(sizes))]


def one_batch(sizes: list[tuple[int, int]]) -> list[list[int]]:
    return [list(range(len(sizes)))]


def batchings(shares: list[float]) -> dict:
    """Label → a replacement of ``constraints.padded_batches`` (the suite's own first), called with the sizes alone."""
    return {SUITE: BY_WIDTH, **{f"by width, share {s:g}": functools.partial(BY_WIDTH, share=s) for s in shares},
            "each shape alone": each_alone, "one batch": one_batch}


@contextlib.contextmanager
def batched_as(batching, seen: list | None = None):
    """``hard_caps`` batches its second signs by ``batching`` inside the block; ``seen`` collects (sizes, batches)."""
    def recorded(sizes, share=None):
        batches = batching(sizes)
        if seen is not None:
            seen.append((list(sizes), batches))
        return batches

    with mock.patch.object(constraints, "padded_batches", recorded):
        yield


def describe(sizes: list[tuple[int, int]], batches: list[list[int]]) -> str:
    """Each batch as its widths, largest first, with their counts of r × r signs: ``72×192; 4×96 + 1×10``."""
    def width_counts(batch: list[int]) -> str:
        counts: dict[int, int] = {}
        for i in batch:
            counts[sizes[i][1]] = counts.get(sizes[i][1], 0) + sizes[i][0]
        return " + ".join(f"{count}×{r}" for r, count in sorted(counts.items(), reverse=True))
    return "; ".join(width_counts(batch) for batch in batches)


def projection(backbone: str, size: str, device: torch.device, cap_products: str):
    """The hard-capped Muon of a ``stability fit`` on ``backbone`` at ``size`` and one call of its projection: the
    hooks a training step runs around Muon's update (the decay before it, the projection at the step's bound after)."""
    image_size = 32 if size != "micro" else 8
    backbone_options = {"window_size": 4} if backbone == "swin" else {}
    module, _ = build_module(backbone, size, "muon", {"constraint": "hard_cap", "cap_products": cap_products},
                             image_size=image_size, device=device, backbone_options=backbone_options)
    stab = next(s for s in module.stabilizers if s.name == "muon")

    def project() -> None:
        stab._before_update()
        stab.after_optimizer_step(module.network)

    project()  # once before it is counted or timed: the step bound's sweep (newton_schulz_bound) is made once, cached
    return module, project


def main() -> None:
    p = arguments(__doc__.split("\n")[0])
    p.add_argument("--backbones", default=BACKBONES, help="comma-separated BACKBONE:SIZE")
    p.add_argument("--shares", default="1", help="comma-separated shares of the by-width rule also compared "
                                                 f"(the suite's: {constraints.PAD_SHARE:g}); '' for none")
    p.add_argument("--cap_products", default="float32", choices=("float32", "tf32x3"),
                   help="muon's cap_products: tf32x3 takes three TF32 products for each float32 one on a GPU")
    p.add_argument("--count", action="store_true", help="no timing: the counts and the H200 prediction only")
    p.add_argument("--model", default="", help="comma-separated CONSTANT=VALUE replacing the H200 model's (constants: "
                                               f"{', '.join(gpu_model.CONSTANTS)}; seconds and per-second rates)")
    args = p.parse_args()
    model = priced_by(args.model)
    device = setup(args)
    if args.cap_products == "tf32x3" and not args.count and not constraints.split_products_on(device):
        raise SystemExit(f"--cap_products tf32x3: {device.type} has no TF32 units, so its cap would take IEEE float32 "
                         "products while the counts take three TF32 products each; give --count (no timing), "
                         "--device cuda (a GPU with TF32), or float32")
    if args.quick:
        args.backbones, args.repeats = QUICK_BACKBONES, 1
    try:
        shares = [float(s) for s in args.shares.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--shares {args.shares!r}: give comma-separated numbers (e.g. 0.5,1)") from None
    if any(s < 0 for s in shares):
        raise SystemExit(f"--shares {args.shares!r}: a share is at least 0")
    ways = batchings(shares)
    entries = args.backbones.split(",")
    for entry in entries:  # before any is measured: a typo fails here
        if not entry.partition(":")[2]:
            raise SystemExit(f"--backbones {entry!r}: give BACKBONE:SIZE, e.g. swin:tiny")
    rows = []
    for done, entry in enumerate(entries):
        notes = len(CUT)
        try:
            rows += measure(entry, ways, device, args, model)
        except KeyboardInterrupt:  # cut before its rows were complete: the backbone is dropped
            CUT.append(f"interrupted while measuring {entry}, before its rows were complete (no row of it)")
        CUT[notes:] = [note if entry in note else f"{entry}: {note}" for note in CUT[notes:]]
        if CUT:  # the time limit came: write what finished, name what did not
            if entries[done + 1:]:
                CUT.append("not measured: " + ", ".join(entries[done + 1:]))
            break
    if not rows:
        raise SystemExit("cap_batches: interrupted before any row was measured; nothing written")
    header = ["backbone", "batching", "second-sign batches (count × r, padded to the first r)", "launches",
              "GB (non-matrix ops)", "GFLOP", f"{device.type} ms", f"× {SUITE}", "H200 ms (predicted)",
              f"× {SUITE} (H200)"]
    body = (f"Muon's hard cap (`cap_products: {args.cap_products}`), the projection after one step, batched as "
            "the script's docstring says; counts on the GPU's code path (GFLOP: "
            f"{'TF32, three products for each float32 one' if args.cap_products == 'tf32x3' else 'IEEE float32'}), "
            f"{'no timing (--count), ' if args.count else ''}the H200 column the step model's prediction "
            f"(`gpu_model.FITTED`{', with --model ' + args.model if args.model else ''}: "
            f"{1e6 * model.launch_s:.1f} µs a launch on the host, {1e6 * model.kernel_s:.1f} µs a kernel, "
            f"{model.bytes_per_s / 1e12:.3g} TB/s, {model.flops_per_s['fp32'] / 1e12:.3g} TFLOP/s IEEE float32, "
            f"{model.flops_per_s['tf32'] / 1e12:.3g} TF32).\n\n" + markdown(header, rows))
    write("cap_batches", args, device, "The hard cap's second signs, batched four ways", body)
    if CUT:
        raise SystemExit(130)  # the table holds what finished; the exit status says it was cut


def measure(entry: str, ways: dict, device: torch.device, args, model: gpu_model.GpuModel) -> list[list]:
    """The rows of one BACKBONE:SIZE: each batching counted, timed (unless ``--count``; a cut keeps the whole rounds)
    and priced."""
    backbone, _, size = entry.partition(":")
    module, project = projection(backbone, size, device, args.cap_products)
    counted, described = {}, {}
    for label, batching in ways.items():
        seen: list = []
        with gpu_model.cuda_path(module), batched_as(batching, seen):
            counted[label] = gpu_model.count(project)
        described[label] = describe(*seen[-1])
    timed = {label: (lambda b=batching, p=project: _call(p, b)) for label, batching in ways.items()}
    seconds = dict.fromkeys(ways, float("nan")) if args.count else \
        interleaved(timed, device, args.repeats, warmup=1, keep_cut_rounds=True)
    predicted = {label: model.seconds(c) for label, c in counted.items()}
    return [[entry, label, described[label], int(c.launches), c.bytes / 1e9, _plain(c.total_flops() / 1e9),
             _plain(1000 * seconds[label]), _times(seconds[label] / seconds[SUITE]),
             _plain(1000 * predicted[label]), _times(predicted[label] / predicted[SUITE])]
            for label, c in counted.items()]


def priced_by(replaced: str) -> gpu_model.GpuModel:
    """The H200 model (``gpu_model.FITTED``) with the constants ``replaced`` names (``launch_s=2.4e-5,...``)."""
    fitted = gpu_model.FITTED["h200"]
    constants = fitted.constants()
    for item in filter(None, (part.strip() for part in replaced.split(","))):
        name, _, value = item.partition("=")
        if name not in constants:
            raise SystemExit(f"--model {item!r}: no constant {name!r}; choose from {', '.join(constants)}")
        try:
            constants[name] = float(value)
        except ValueError:
            raise SystemExit(f"--model {item!r}: give {name}=<a number>") from None
        if not constants[name] > 0:
            raise SystemExit(f"--model {item!r}: a constant is positive")
    return gpu_model.GpuModel(constants["launch_s"], constants["bytes_per_s"],
                              {p: constants[f"{p}_flops_per_s"] for p in gpu_model.PRECISIONS}, fitted.form,
                              constants["kernel_s"], fitted.row_s)


def _plain(value: float) -> str:
    """Three significant digits; from 1,000 on, the whole number (no exponent); — for no value."""
    return "—" if math.isnan(value) else f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _times(ratio: float) -> str:
    return "—" if math.isnan(ratio) else f"{ratio:.2f}×"


def _call(project, batching) -> None:
    with batched_as(batching):
        project()


if __name__ == "__main__":
    main()
