"""Every benchmark script runs in its quick configuration and writes its table (so they cannot rot)."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stability.testing import fake_gpu

ROOT = Path(__file__).resolve().parent.parent
# compiled_kernels.py counts the Triton code written for an H200 without a GPU: torch 2.11 or newer
needs_fake_gpu = pytest.mark.skipif(not fake_gpu.SUPPORTED, reason="GPU code without a GPU needs torch >= 2.11")


def run_benchmark(script: str, out: Path, *extra: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# ") and f"benchmarks/{script} --quick" in text  # the command is written beside it
    return text


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]


def test_step_cost_lists_every_stabilizer_with_ratios_and_targets(tmp_path):
    text = run_benchmark("step_cost.py", tmp_path / "step.md", "--profile", "jasmin k=10", "--compiled",
                         "specformer;jasmin k=10, materialized")
    table, _, profiled = text.partition("## Where the profiled rows' time goes")
    rows = {row[4]: row for row in table_rows(table)}
    operators = table_rows(profiled)  # JaSMin's step by operator, its own time, largest first
    assert "### jasmin k=10: vit:micro, 16 tokens, fp32" in profiled and "aten::mm" in [row[0] for row in operators]
    shares = [float(row[3].rstrip("%")) for row in operators]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.01
    assert {"none", "jasmin k=10", "jasmin k=10, streamed", "specformer", "spectral_norm project",
            "spectral_norm project, at the cap", "spectral_norm project, exact, at the cap", "lipsformer",
            "muon soft_cap", "muon hard_cap", "muon hard_cap, exact"} <= set(rows)
    assert any(label.startswith("spectral_norm project, at the cap + exact check every 100 steps") for label in rows)
    assert rows["none"][6].startswith("1.00×") and rows["none"][3] == "fp32"
    assert rows["specformer"][7] == "≤ 1.10×" and rows["muon hard_cap"][7] == "≤ 1.30×"
    assert rows["specformer"][8] == "met" or rows["specformer"][8].startswith("missed by ")
    assert "(muon (no constraint))" in rows["muon soft_cap"][6]
    assert all(float(row[5]) > 0 and float(row[9]) > 0 for label, row in rows.items() if "compiled" not in label)
    from stability.stabilizers import REGISTRY

    missing = [name for name in REGISTRY if not any(name in label.split() or label.startswith(name)
                                                    for label in rows)]
    assert not missing, f"step_cost.py has no row for {missing}"
    assert "timm qk_norm=True" in rows
    # compiled, as --model.compile true: the baseline against the eager one, the rest against the compiled baseline
    assert rows["none, compiled"][6].endswith("faster") and float(rows["none, compiled"][5]) > 0
    assert rows["specformer, compiled"][6].endswith("(none, compiled)") and float(rows["specformer, compiled"][5]) > 0
    refused = rows["jasmin k=10, materialized, compiled"]  # the materialised maps need hooks: refused, with why
    assert refused[6] == "refused" and "cannot train compiled" in refused[8]


def test_cap_batches_compares_the_hard_cap_s_batchings_on_each_backbone_s_matrices(tmp_path):
    """Each backbone's projection batched four ways: the second signs' widths and counts are the network's constrained
    matrices (counted here from the network itself); batching alone changes nothing but launches and padded products
    (each shape alone: the most launches and the fewest products; one batch: the fewest launches); the ratios are the
    times' ratios to the suite's batching."""
    from collections import Counter

    from stability.classifier import ImageClassifier

    text = run_benchmark("cap_batches.py", tmp_path / "caps.md")
    rows = table_rows(text)
    ways = ["by width", "by width, share 1", "each shape alone", "one batch"]
    assert [row[1] for row in rows] == ways * 3
    for name in ("vit:micro", "swin:micro", "cswin:micro"):
        row = {r[1]: r for r in rows if r[0] == name}
        backbone = name.partition(":")[0]
        net = ImageClassifier(backbone=backbone, size="micro", stabilizer=["muon"], num_classes=10, in_chans=3,
                              image_size=8, backbone_options={"window_size": 4} if backbone == "swin" else {},
                              stabilizer_options={"muon": {"constraint": "hard_cap"}}).stabilizers[0]
        widths = Counter(min(w.shape) for w in net._matrices)  # the r × r second sign of every matrix
        for way in ways:
            listed = Counter()
            for batch in row[way][2].split("; "):
                for member in batch.split(" + "):
                    count, r = member.split("×")
                    listed[int(r)] += int(count)
            assert listed == widths, (name, way, listed, widths)
        batches = {way: row[way][2].split("; ") for way in ways}
        shapes = {(min(w.shape), max(w.shape)) for w in net._matrices}  # a tall matrix is capped as its transpose
        assert len(batches["each shape alone"]) == len(shapes) and len(batches["one batch"]) == 1
        assert len(batches["one batch"]) <= len(batches["by width, share 1"]) <= len(batches["by width"]) <= len(widths)
        launches = {way: int(row[way][3]) for way in ways}
        gflop = {way: float(row[way][5]) for way in ways}
        assert launches["each shape alone"] > launches["by width"] >= launches["one batch"]
        assert gflop["each shape alone"] <= gflop["by width"] * 1.001 <= gflop["one batch"] * 1.002
        for way in ways:  # each ratio is its time over the suite's batching's, here and on the H200 (the model's)
            for ratio, value in ((7, 6), (9, 8)):
                assert float(row[way][ratio].rstrip("×")) == pytest.approx(
                    float(row[way][value]) / float(row["by width"][value]), abs=0.01, rel=0.01)
    swin = {r[1]: r for r in rows if r[0] == "swin:micro"}  # widths 64 and 32: a share of 1 joins them, 0.25 does not
    assert swin["by width"][2] == "13×64; 12×32" and swin["by width, share 1"][2] == "13×64 + 12×32"
    cswin = {r[1]: r for r in rows if r[0] == "cswin:micro"}  # widths 128, 64, 32: padding all to 128 costs products
    assert float(cswin["one batch"][5]) > 2 * float(cswin["by width"][5])
    # the 3xTF32 cap, counted without timing (the CPU takes IEEE products: timed, it is refused): three products for
    # each float32 one, the same batches, no time
    counted = table_rows(run_benchmark("cap_batches.py", tmp_path / "tf32x3.md", "--count", "--cap_products", "tf32x3"))
    for row, split in zip(rows, counted):
        assert split[:3] == row[:3] and split[6] == split[7] == "—" and float(split[8]) > 0
        assert float(split[5]) == pytest.approx(3 * float(row[5]), rel=0.01) and int(split[3]) > int(row[3])
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cap_batches.py"), "--quick", "--cap_products",
                              "tf32x3", "--out", str(tmp_path / "refused.md")], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
    assert refused.returncode != 0 and "cpu has no TF32 units" in refused.stderr
    assert not (tmp_path / "refused.md").exists()
    # --model replaces the H200 model's constants: with launches and bytes free and IEEE float32 at 1 TFLOP/s, each
    # row's predicted ms is its GFLOP
    priced = table_rows(run_benchmark("cap_batches.py", tmp_path / "priced.md", "--count", "--model",
                                      "launch_s=1e-12,kernel_s=1e-12,bytes_per_s=1e18,fp32_flops_per_s=1e12"))
    for row in priced:
        assert float(row[8]) == pytest.approx(float(row[5]), rel=0.01)
    unknown = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cap_batches.py"), "--quick", "--count",
                              "--model", "lanch_s=1", "--out", str(tmp_path / "unknown.md")], capture_output=True,
                             text=True, cwd=ROOT, timeout=300)
    assert unknown.returncode != 0 and "no constant 'lanch_s'; choose from launch_s, kernel_s" in unknown.stderr


def test_matmul_rates_time_every_precision_at_every_shape(tmp_path):
    """Each shape's product in bf16, TF32, IEEE float32 and as three TF32 products, with its time, its rate (the
    product's FLOPs over its time, for every precision) and the model's assumed rate; a verdict per shape; on the CPU,
    the note that it has no TF32 units."""
    text = run_benchmark("matmul_rates.py", tmp_path / "rates.md")
    rows = table_rows(text)
    assert [row[1] for row in rows] == ["bf16", "tf32", "float32", "tf32x3"] * 3
    for row in rows:
        milliseconds, rate = float(row[2]), float(row[3])
        batch, m, k, n = {"tiny stack (2 × 16²)": (2, 16, 16, 16), "tiny Gram (2 × 16 × 48)": (2, 16, 48, 16),
                          "square 64³": (1, 64, 64, 64)}[row[0]]
        flops = 2 * batch * m * k * n
        assert milliseconds > 0 and rate == pytest.approx(flops / (milliseconds / 1000) / 1e12, rel=0.02)
    from stability.testing.gpu_model import FITTED
    assumed = [f"{FITTED['h200'].flops_per_s[p] / 1e12:.3g}" for p in ("bf16", "tf32", "fp32")]
    assert [row[4] for row in rows[:4]] == [*assumed, "—"] and assumed[:2] == ["593", "297"]
    assert text.count("tf32x3 takes") == 3 and "cpu has no TF32 units" in text


def test_norm_kernels_counts_each_norms_rows_and_prices_them_both_ways(tmp_path):
    """Each norm of a layer, forward and backward: CUDA's norm kernels counted by their rows (the residual stream's
    LayerNorm, and CenterNorm on its kernels, one block a token each way, the QK norm's and the fused cosine norm's a
    block a head and token for q and for k each way; the spelled-out cosine norm and CenterNorm's other paths none, in
    more launches), both models' predictions and the measured time's ratios to them; the CPU's note; ``--calls 0``
    refused."""
    text = run_benchmark("norm_kernels.py", tmp_path / "norms.md")
    rows = {row[0]: row for row in table_rows(text)}
    batch, tokens, heads, _ = (2, 17, 2, 8)  # norm_kernels.QUICK_SHAPE
    tokens_rows, head_rows = batch * tokens, batch * heads * tokens
    expected = {"residual stream: LayerNorm (float32)": 2 * tokens_rows,
                "residual stream: CenterNorm on LayerNorm's kernels (float32)": 2 * tokens_rows,
                "residual stream: CenterNorm written out (float32)": 0,
                "residual stream: CenterNorm's formula (float32)": 0,
                "QK norm: LayerNorm of q and k (bf16)": 4 * head_rows,
                "cosine norm of q and k: fused RMSNorm (bf16)": 4 * head_rows,
                "cosine norm of q and k: spelled out (bf16)": 0}
    assert {name: round(float(row[1]) * 1000) for name, row in rows.items()} == expected
    fused = rows["cosine norm of q and k: fused RMSNorm (bf16)"]
    spelled = rows["cosine norm of q and k: spelled out (bf16)"]
    assert int(spelled[2]) > int(fused[2])  # the formula's operators, each a launch
    # CenterNorm: LayerNorm's kernels move fewer bytes in fewer launches than its backward written out, and that
    # fewer than autograd through the formula
    centre = [rows[f"residual stream: CenterNorm {how} (float32)"] for how in ("on LayerNorm's kernels", "written out")]
    centre.append(rows["residual stream: CenterNorm's formula (float32)"])
    assert int(centre[0][2]) < int(centre[1][2]) < int(centre[2][2])
    assert float(centre[0][3]) < float(centre[1][3]) < float(centre[2][3])
    for row in rows.values():
        by_bytes, by_rows, measured = float(row[4]), float(row[5]), float(row[6])
        assert by_bytes > 0 and by_rows > 0 and measured > 0
        assert float(row[7]) == pytest.approx(measured / by_bytes, rel=0.02)
        assert float(row[8]) == pytest.approx(measured / by_rows, rel=0.02)
    assert "ns; `step_cost.py --count --norm_rows`" in text and "only a GPU's set the row term" in text
    for bad, message in (("--calls=0", "--calls 0: give at least 1"), ("--shape=1,2,3", "--shape '1,2,3': give")):
        refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "norm_kernels.py"), "--quick", bad,
                                  "--out", str(tmp_path / "none.md")], capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode != 0 and message in refused.stderr
    assert not (tmp_path / "none.md").exists()


def test_norm_kernels_counts_each_call_as_a_steps_first(benchmark_modules):
    """A norm's count does not depend on the calls before it: each call starts without the gradients an earlier one
    left (which a second backward would add into: an `add_` a parameter)."""
    from norm_kernels import QUICK_SHAPE, cases, counted

    device = torch.device("cpu")
    runs = cases(*QUICK_SHAPE, device)
    alone = {name: counted(run, device) for name, run in cases(*QUICK_SHAPE, device).items()}
    for run in runs.values():  # every case once, so that each leaves its gradients behind
        run()
    for name, run in runs.items():
        again = counted(run, device)
        assert (again.launches, again.bytes, dict(again.ops)) == (alone[name].launches, alone[name].bytes,
                                                                    dict(alone[name].ops)), name


def test_norm_kernels_cut_at_its_limit_writes_the_counts_it_finished(benchmark_modules, monkeypatch, tmp_path):
    """Cut before a whole round is timed, the table keeps every norm's counts and both predictions, with no time and
    the cut noted, and the exit status is 130; cut while counting the first norm, nothing is written."""
    import norm_kernels

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "norms.md"
    monkeypatch.setattr(norm_kernels, "interleaved", cut)
    monkeypatch.setattr(sys, "argv", ["norm_kernels.py", "--quick", "--out", str(out)])
    assert cut_main(norm_kernels.main) == 130
    text = out.read_text()
    rows = table_rows(text)
    assert len(rows) == 7 and all(float(row[4]) > 0 and row[6] == "—" for row in rows)
    assert "interrupted before a whole round was timed: counts and predictions only" in text
    out.write_text("an earlier table")
    benchmark_modules.CUT.clear()
    monkeypatch.setattr(norm_kernels, "counted", cut)
    assert "nothing written" in str(cut_main(norm_kernels.main))
    assert out.read_text() == "an earlier table"


def test_norm_kernels_prices_each_row_by_both_models(benchmark_modules):
    """The table's two predictions are the two models' (the second with its time per norm row), and the ratios the
    measured time's to each: on counts where the device's time decides (at --quick's shapes the host's launches
    decide, and the two agree)."""
    from norm_kernels import table_rows

    from stability.testing.gpu_model import GpuModel, StepCounts

    flops = {"bf16": 0.0, "tf32": 0.0, "fp32": 0.0}
    counts = {"head-wide": StepCounts(10, flops, 5e8, 0.0, norm_rows=2e6),
              "spelled out": StepCounts(40, flops, 2e9, 0.0, norm_rows=0.0)}
    bytes_only = GpuModel(2e-5, 2e12, {"bf16": 5e14, "tf32": 3e14, "fp32": 1.5e13}, "overlap", 5e-6)
    with_rows = GpuModel(2e-5, 2e12, {"bf16": 5e14, "tf32": 3e14, "fp32": 1.5e13}, "overlap", 5e-6, row_s=7e-10)
    rows = {row[0]: row for row in table_rows(counts, {"head-wide": 1.5e-3, "spelled out": 1.2e-3}, bytes_only,
                                              with_rows)}
    head, spelled = rows["head-wide"], rows["spelled out"]
    assert head[1:4] == [2000.0, 10, 500.0]
    assert head[4] == pytest.approx(1e6 * (10 * 5e-6 + 5e8 / 2e12)) == 300  # µs: launches on the device, bytes
    assert head[5] == pytest.approx(head[4] + 1e6 * 2e6 * 7e-10) == 1700  # and the rows
    assert spelled[5] == pytest.approx(spelled[4])  # no rows, no difference
    assert head[6] == pytest.approx(1500) and head[7] == pytest.approx(5.0) and head[8] == pytest.approx(1500 / 1700)


def test_host_profile_lists_a_steps_operators_and_counts(tmp_path):
    """benchmarks/host_profile.py profiles the training steps it names and writes the table and the per-step counts
    as it goes."""
    out = tmp_path / "profile.txt"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_profile.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "training steps 2..4 on cpu" in text and "ms a step (profiled)" in text
    assert "aten::addmm" in text or "aten::mm" in text  # the model's operators are in the table
    steps = [float(line.split(": ")[1].split()[0]) for line in text.splitlines() if line.startswith("aten::copy_:")]
    assert steps and steps[0] > 0
    assert text.rstrip().splitlines()[-1].startswith("fit of 14 steps")


def test_gpu_check_says_in_one_line_that_there_is_no_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and len(said.splitlines()) == 1, said
    assert "no CUDA GPU" in done.stdout + done.stderr


def test_measurement_cost_relates_every_measurement_to_a_training_step(tmp_path):
    text = run_benchmark("measurement_cost.py", tmp_path / "measure.md")
    rows = {row[0]: row for row in table_rows(text)}
    assert rows["training step"][5] == "1.00" and float(rows["training step"][4]) > 0
    assert rows["local Lipschitz, power, 2 iterations"][7].startswith("≤ 5 steps: ")
    assert {"FGSM", "PGD-10", "certified bound (Lipschitz-transformer ViT)", "certified accuracy (bound + radii)",
            "attention diagnostics (16 points)"} <= set(rows)


def test_measurement_cost_counts_the_launches_batching_saves(tmp_path):
    """``--count``: each measurement's launches per point, one at a time and in one batch of 4. A measurement whose
    launches do not grow with its batch saves nearly the batch's size; a batched call that looped over its points
    would save nothing and fail."""
    text = run_benchmark("measurement_cost.py", tmp_path / "count.md", "--count")
    rows = {row[0]: row for row in table_rows(text)}
    assert rows["certified bound (Lipschitz-transformer ViT)"][5] == "1.0 (per call)"
    pointwise = [name for name in rows if not name.startswith("certified bound")]
    assert {"FGSM", "PGD-10", "local Lipschitz, power, 2 iterations", "attention diagnostics"} <= set(pointwise)
    for name in pointwise:
        one, batched = float(rows[name][1]), float(rows[name][3])
        assert batched > 0 and float(rows[name][5]) == pytest.approx(one / batched, rel=0.05), name
        # at most the batch's size, but for the copy a product of one row makes on a GPU (cuBLASLt adds a bias in
        # its epilogue only for two rows or more: the head's Linear at batch 1 copies its bias, at batch 4 not)
        assert 3.0 <= float(rows[name][5]) <= 4.2, name
    one_pass, exact = rows["local Lipschitz, exact in one pass (10 copies a point)"], rows[
        "local Lipschitz, exact (one VJP per logit)"]
    assert float(one_pass[3]) < float(exact[3]) / 2  # one backward pass where the exact norm makes ten


@needs_fake_gpu
def test_compiled_kernels_counts_the_compiled_networks_launches(tmp_path):
    """``compiled_kernels.py``: the compiled network's forward and backward launch fewer operators than the eager
    network's (Inductor fuses the elementwise ones), counted in the Triton program written for an H200 and in the
    CPU's C++ (its loop nests above the Triton kernels, its functions below: a LayerNorm is two nests, one kernel);
    the compiled step is that plus what stays eager; Specformer's penalty, which compiles whole, moves from the eager
    launches into a few generated kernels."""
    text = run_benchmark("compiled_kernels.py", tmp_path / "compiled.md", "--cases", "none;qk_norm;specformer")
    rows = {row[0]: row for row in table_rows(text)}
    assert set(rows) == {"none", "qk_norm", "specformer"} and rows["none"][6] == "1.00× (1.00×, 1.00×)"
    triple = r"(\d+) \((\d+), (\d+)\)"
    for row in rows.values():  # each compiled count "kernels (nests, functions)"
        step, network = map(float, row[1:3])
        compiled, outside, compiled_step = (list(map(float, re.fullmatch(triple, cell).groups()))
                                            for cell in row[3:6])
        assert 0 < compiled[2] < compiled[0] < compiled[1] and compiled[0] < network
        assert outside[0] == outside[1] == outside[2]  # all eager
        assert compiled_step == [c + outside[0] for c in compiled]
    for label in ("none", "qk_norm"):  # nothing of theirs compiles outside the network
        step, network, outside = float(rows[label][1]), float(rows[label][2]), rows[label][4]
        assert outside == f"{step - network:.0f} ({step - network:.0f}, {step - network:.0f})" and step > network
    compiled = {label: [float(n) for n in re.findall(r"\d+", rows[label][3])] for label in rows}
    assert all(compiled["qk_norm"][i] > compiled["none"][i] for i in range(3))  # its norms are kernels of their own
    specformer, none = (list(map(float, rows[label][1:3])) for label in ("specformer", "none"))
    assert specformer[0] - specformer[1] > 30 + none[0] - none[1]  # eager, the penalty launches dozens of ops
    # compiled, a few Triton kernels and C++ functions (its nests: a loop nest per weight's reduction)
    assert 0 < compiled["specformer"][0] - compiled["none"][0] < 30 < compiled["specformer"][1] - compiled["none"][1]
    assert 0 < compiled["specformer"][2] - compiled["none"][2] < 10
    assert float(rows["specformer"][4].split()[0]) <= float(rows["none"][4].split()[0])


def test_compiled_kernels_eager_counts_take_the_path_of_the_step_they_stand_for(benchmark_modules, monkeypatch):
    """``compiled_kernels.py``'s eager columns take the size decisions of the GPU step they stand for (``--stands_for``,
    256 tokens at batch 256 by default): LipsFormer's residual scales, counted at 16 tokens and batch 4, take their
    written-out backwards (one launch fewer a scale) where the step they stand for is large enough, as ``step_cost.py
    --count`` does, and the Linear layers that write the branches take α into their weights there; at scale 1 they
    keep α ⊙ y after the product. Its CenterNorms (the float32 residual stream) take LayerNorm's kernels at every size.
    (The compiled graphs, not generated here, take the norms' formula and fold α into the weights at every size:
    ``test_center_norm``, ``test_lipsformer``.)"""
    import compiled_kernels
    import numpy as np
    import step_cost

    from stability.models.registry import PRESETS
    from stability.nn import channel_scale

    monkeypatch.setattr(compiled_kernels, "generated_launches", lambda run, fresh=True: np.zeros(3))
    case = next(c for c in step_cost.CASES if c.label == "lipsformer")
    depth = PRESETS["vit"]["micro"]["depth"]
    from stability.stabilizers.lipsformer import LipsFormer

    counts = {}
    for folded in (True, False):
        with monkeypatch.context() as patch:
            if not folded:  # α kept apart from the Linear layers
                patch.setattr(LipsFormer, "after_prepare", lambda self, network: None)
            counts[folded] = [compiled_kernels.counts_at(case, "micro", 16, depth, "bf16", scale)
                              for scale in (1.0, 1e9)]
    scales = 2 * depth  # residual scales: two a block
    (small, large), (small_folded, large_folded) = counts[False], counts[True]
    # one launch fewer a residual scale (its product written in bf16, no cast after it); the norms alike at both sizes
    assert small["step"] - large["step"] == small["network"] - large["network"] == scales
    # folded: the small step's launches unchanged (α ⊙ y after the product), the large one's five a scale more
    # than the written-out α ⊙ y (the weight and bias scaled forward, their gradients and α's back)
    assert small_folded["step"] == small["step"] and large_folded["step"] - large["step"] == 5 * scales
    # the default: ViT-S's step at 256 tokens and batch 256, 1024 times the counted one (16 tokens, batch 4), whose
    # residual scales (17 tokens × 384 wide, bf16) it takes past their written-out backwards' threshold
    tokens, batch, scale = compiled_kernels.stands_for_scale("256,256", 16)
    assert (tokens, batch) == (256, 256) and scale == 256 * 256 / (16 * compiled_kernels.BATCH) == 1024
    counted_branch_bytes = compiled_kernels.BATCH * 17 * 384 * 2  # a residual scale's bf16 input
    assert counted_branch_bytes * scale >= channel_scale.WRITTEN_OUT_FROM_BYTES > counted_branch_bytes
    for bad in ("256", "256,0", "a,b"):
        with pytest.raises(ValueError, match="two positive integers"):
            compiled_kernels.stands_for_scale(bad, 16)


def test_compiled_kernels_reads_the_launches_of_generated_code(benchmark_modules):
    """The module's own kernels (by the names it defines, a template's and a tuple target's included; a C++ kernel as
    its loop nests, each a GPU kernel of its own), library calls and ATen fallbacks count; allocations, views,
    deletions and the returned tuple do not."""
    from compiled_kernels import wrapper_launches

    source = """
def call(self, args):
    primals_1, primals_2 = args
    args.clear()
    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    extern_kernels.mm(primals_1, primals_2, out=buf0)
    buf1 = reinterpret_tensor(buf0, (32, ), (1, ), 0); del buf0
    cpp_fused_gelu_0(buf1, primals_1)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1)
    buf3 = torch.ops.aten.view.default(buf1, [4, 8])
    triton_poi_fused_add_1.run(buf1, buf3, 32, stream=stream0)
    (buf4, ) = cpp_bmm_2(buf1, buf3)
    return (buf1, buf2, )


def benchmark_compiled_module(times=10, repeat=10):
    cpp_fused_gelu_0(None)
"""
    two_nests = ('extern "C" void kernel(float* out_ptr0)\n{\n    auto x = out_ptr0;\n    {\n        {\n'
                 '            for(int64_t x0=0; x0<4; x0++) {}\n        }\n    }\n'
                 '    {\n        for(int64_t x0=0; x0<8; x0++)\n        {\n        }\n    }\n}\n')
    kernels = ("cpp_fused_gelu_0 = async_compile.cpp_pybinding(['float*'], r\'\'\'\n" + two_nests + "\'\'\')\n"
               "triton_poi_fused_add_1 = async_compile.triton('triton_', 'code')\n"
               "cpp_bmm_2 = async_compile.cpp_pybinding(['float*'], 'code')\n")
    assert list(wrapper_launches(kernels + source)) == [6, 5]  # the two-nest kernel: one C++ function


def test_fit_also_names_a_malformed_pair_or_a_missing_file(benchmark_modules, tmp_path):
    from step_cost import fit_also_pairs

    counts, table = tmp_path / "counts.json", tmp_path / "table.md"
    counts.write_text("{}")
    table.write_text("")
    assert fit_also_pairs(f"{counts}={table}") == [(str(counts), str(table))]
    with pytest.raises(SystemExit, match="expected COUNTS_JSON=TABLE"):
        fit_also_pairs(str(counts))
    with pytest.raises(SystemExit, match="no such file .*missing.md"):
        fit_also_pairs(f"{counts}={tmp_path / 'missing.md'}")


def test_compiled_kernels_counts_the_copies_inside_library_products(benchmark_modules):
    """A generated ``baddbmm``, ``addmm`` or ``addmv`` with β ≠ 0 copies its input first (a kernel of its own on a
    GPU), except an ``addmm`` of a 1-D bias with β = 1 (cuBLASLt's epilogue); β = 0 copies nothing."""
    from compiled_kernels import wrapper_launches

    source = """
def call(self, args):
    arg0_1, arg1_1 = args
    assert_size_stride(arg0_1, (3, 64, 96), (6144, 96, 1))
    assert_size_stride(arg1_1, (64, ), (1, ))
    buf0 = empty_strided_cuda((3, 64, 64), (4096, 64, 1), torch.float32)
    extern_kernels.bmm(arg0_1, reinterpret_tensor(arg0_1, (3, 96, 64), (6144, 1, 96), 0), out=buf0)
    extern_kernels.baddbmm(buf0, buf0, buf0, alpha=2.0315, beta=-4.775, out=buf1)
    extern_kernels.baddbmm(arg0_1, buf1, arg0_1, alpha=1, out=buf2)
    extern_kernels.baddbmm(buf0, buf0, buf0, alpha=1, beta=0, out=buf3)
    extern_kernels.addmm(arg1_1, buf4, buf5, alpha=1, beta=1, out=buf6)
    extern_kernels.addmm(reinterpret_tensor(buf0, (64, 64), (64, 1), 0), buf4, buf5, alpha=1, beta=1, out=buf7)
    extern_kernels.addmm(arg1_1, buf4, buf5, alpha=1, beta=0.5, out=buf8)
    buf9 = empty_strided_cuda((64, 64), (64, 1), torch.float32)
    extern_kernels.addmm(buf9, buf4, buf5, alpha=1, beta=1, out=buf10)
    buf11 = reinterpret_tensor(buf9, (64, 64), (0, 1), 0)
    extern_kernels.addmm(buf11, buf4, buf5, alpha=1, beta=1, out=buf12)
    extern_kernels.addmm(arg2_1, buf4, buf5, alpha=1, beta=1, out=buf13)
    extern_kernels.bias_addmm(arg1_1, buf4, buf5, alpha=1, beta=1, out=buf14)
    extern_kernels.bias_addmm(arg1_1, buf4, buf5, alpha=1, beta=0.5, out=buf15)
    return (buf2, )
"""
    # the copies: two baddbmm; addmm of a 2-D input (reinterpreted, allocated, reinterpreted by name) or β ≠ 1;
    # not of a 1-D or unknown input with β = 1 (arg2_1, whose sizes the code does not show, is taken as a bias)
    assert list(wrapper_launches(source)) == [12 + 7, 12 + 7]  # twelve library calls


@needs_fake_gpu
def test_a_compiled_power_iterations_kernels_do_not_grow_with_the_matrices_of_a_shape(benchmark_modules):
    """The block power iteration compiled: its matrices and bases are stacked, and the bases written back, outside
    the graph, so the generated code is the same for 12 matrices of a shape as for 4 (inside it, a stack of more
    than 8 inputs is a copy kernel an input on a GPU, and on the CPU a loop nest an input at any count)."""
    from compiled_kernels import generated_launches

    from stability.nn.spectral import SubspaceIteration

    def kernels(count: int) -> list[int]:
        homes = [torch.nn.Module() for _ in range(count)]
        power = SubspaceIteration([(m, "p") for m in homes], [(16, 12)] * count, block=4)
        power.compile()
        matrices = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(count)]
        return list(generated_launches(lambda: power.step(matrices, 1)))

    four = kernels(4)  # [Triton kernels, C++ loop nests, C++ functions]
    assert kernels(12) == four and four[1] > four[2] > 0 and four[0] > 0


@needs_fake_gpu
def test_compiled_kernels_refuses_to_count_a_broken_graph(benchmark_modules):
    """A graph break while the compiled code is counted is an error (the count would be the pieces'); without one the
    same function counts. (A residual scale that asked ``torch.result_type`` before its compile check broke the
    compiled LipsFormer network at every residual scale: 77 launches counted where the whole graph has over 600.)"""
    from compiled_kernels import generated_launches

    def scaled(x, breaking):
        y = torch.relu(x) * 2
        if breaking == "call":
            torch._dynamo.graph_break()
        if breaking == "branch" and y.sum() > 0:  # data-dependent: Dynamo files it elsewhere
            y = y - 1
        return y + 1

    x = torch.randn(8, 4)
    assert generated_launches(lambda: torch.compile(scaled)(x, "none"))[0] > 0
    for breaking in ("call", "branch"):
        with pytest.raises(RuntimeError, match="graph break while counting"):
            generated_launches(lambda b=breaking: torch.compile(scaled)(x, b))


@needs_fake_gpu
@pytest.mark.parametrize("constraint", ["hard_cap", "soft_cap"])
def test_compiled_kernels_counts_muons_constraint_whichever_method_runs_it(benchmark_modules, constraint):
    """The hard cap runs every shape group at once (``_cap_all``), the other constraints one group a call
    (``_constrain``): either way the step's constraint is recorded and counted, eager and as its compiled graph
    (a benchmark that recorded only ``_constrain`` counted the hard cap as eager work outside any graph)."""
    from common import build_module
    from compiled_kernels import constraint_launches, recorded_calls

    from stability.stabilizers.muon import MuonConstrained
    from stability.testing.profiling import train_step

    module, optimizer = build_module("vit", "micro", "muon", {"constraint": constraint}, image_size=8, in_chans=1,
                                     device=torch.device("cpu"), backbone_options={"patch_size": 4})
    images, labels = torch.rand(2, 1, 8, 8), torch.tensor([0, 1])
    with recorded_calls(MuonConstrained, "_constrain") as constrained, \
            recorded_calls(MuonConstrained, "_cap_all") as capped:
        train_step(module, optimizer, images, labels, step=1)
    assert (len(capped), len(constrained) > 0) == ((1, False) if constraint == "hard_cap" else (0, True))
    eager, compiled = constraint_launches(constrained + capped)
    assert eager > 0 and min(compiled) > 0  # compiled: [Triton kernels, C++ loop nests, C++ functions]


def test_loop_overhead_times_stability_fit_against_a_hand_written_loop(tmp_path):
    text = run_benchmark("loop_overhead.py", tmp_path / "loop.md")
    rows = {row[0]: row for row in table_rows(text)}
    assert rows["hand-written loop (AdamW)"][3] == "1.00"
    assert float(rows["stability fit (default callbacks)"][2]) > 0 and "target ≥ 90%" in text


def test_the_captured_loops_step_trains_as_the_hand_written_loop(tmp_path):
    """The captured loop's step on its static buffers (eager on the CPU: what the CUDA graph holds), with AdamW rebuilt
    on learning-rate tensors filled from the schedule, gives the hand-written loop's weights after the same steps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lightning as L
    import torch
    from loop_overhead import build, captured_groups, hand_written_optimizer, time_captured, time_hand_written

    cli = build(str(ROOT / "configs/vit_digits.yaml"), "cpu", "data", str(tmp_path / "run"),
                ["--trainer.max_steps", "20", "--trainer.max_epochs", "2", "--model.warmup_epochs", "0.5",
                 "--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"])
    cpu = torch.device("cpu")
    _, hand = time_hand_written(cli, 0, 4, cpu, "32-true")
    _, captured = time_captured(cli, 0, 4, cpu, "32-true")
    groups = captured_groups(hand_written_optimizer(cli, cli.model)[0], cpu)
    assert not {"capturable", "fused", "foreach", "differentiable"} & {k for g in groups for k in g}  # constructor
    assert all(isinstance(g["lr"], torch.Tensor) for g in groups)
    moved = 0.0
    L.seed_everything(cli.config.get("seed_everything") or 0)
    initial = type(cli.model)(**{k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}).network
    for (name, a), b, start in zip(hand.named_parameters(), captured.parameters(), initial.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((a - start).abs().max()))
    assert moved > 1e-4  # the steps did change the weights


def test_the_hand_written_loop_steps_the_schedule_its_docstring_claims(tmp_path):
    """The loop's optimizer and LambdaLR are the module's own: warmup, then the configured decay, every step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lightning as L
    from loop_overhead import build, hand_written_optimizer

    from stability.optim import lr_factor

    cli = build(str(ROOT / "configs/vit_digits.yaml"), "cpu", "data", str(tmp_path / "run"),
                ["--trainer.max_steps", "20", "--trainer.max_epochs", "2", "--model.warmup_epochs", "0.5",
                 "--model.backbone_options",
                 "{embed_dim: 16, depth: 1, num_heads: 2}"])
    L.seed_everything(0)
    optimizer, schedule = hand_written_optimizer(cli, cli.model)
    total = int(cli.trainer.estimated_stepping_batches)
    warmup = round(0.5 * total / cli.trainer.max_epochs)
    assert total == 20 and warmup > 0 and {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.05}
    for step in range(total):
        expected = cli.model.hparams.lr * lr_factor(step, total, warmup, "cosine", 0.0)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), step
        optimizer.step()
        schedule.step()


def test_estimator_accuracy_power_iteration_never_exceeds_the_exact_norm(tmp_path):
    text = run_benchmark("estimator_accuracy.py", tmp_path / "accuracy.md")
    power, specformer = text.split("## Specformer")
    for row in table_rows(power):
        assert float(row[3]) <= 1e-4  # a lower bound: (estimate - exact) / exact ≤ 0 up to rounding
    assert len(table_rows(specformer)) >= 2


def test_gpu_check_reads_a_fits_phases_from_its_log(monkeypatch):
    """The runs section times each phase of a fit from the lines the monitors write as a measurement starts and ends,
    and a fit cut short names the phase it was in."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    clock = iter(range(0, 1000, 5))
    monkeypatch.setattr(gpu_check.time, "time", lambda: float(next(clock)))
    phases = gpu_check.Phases()  # t = 0
    for line in ["Epoch 0: 100%", "lipschitz (fit): local Lipschitz estimates on 16 points …",  # t = 5
                 "lipschitz (fit): local Lipschitz estimates on 16 points in 2 s (8 points/s)",  # t = 10
                 "`Trainer.fit` stopped: `max_epochs=1` reached.",  # t = 15
                 "robustness (test): pgd_L2_0.5 on 64 points …"]:  # t = 20
        phases.read(line)
    assert phases.current == "robustness (test): pgd_L2_0.5"
    assert phases.close() == {gpu_check.TRAINING: 10.0, "lipschitz (fit): local Lipschitz estimates": 5.0,
                              "test: evaluation between measurements": 5.0, "robustness (test): pgd_L2_0.5": 5.0}


def test_gpu_checks_comparison_stops_at_its_deadline_and_names_the_phase(monkeypatch):
    """A comparison case still running at the section's deadline is reported cut, with the phase it was in, and the
    section returns then (on the H200 a case outran the section's budget and the section never said so); a case's
    exception reaches the section."""
    import threading

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    release = threading.Event()

    def slow_case(stabilizer, backbone, case):
        case["started"] = gpu_check.time.time()
        case["phase"] = "the measurements on the CPU"
        release.wait(30)

    monkeypatch.setattr(gpu_check, "_compare_case", slow_case)
    monkeypatch.setattr(gpu_check, "cases", lambda: [("none", "vit"), ("qk_norm", "vit")])
    monkeypatch.setattr(gpu_check, "progress", lambda section, **fields: None)
    started = gpu_check.time.time()
    result = gpu_check.compare_with_cpu(started + 0.5)
    release.set()
    assert gpu_check.time.time() - started < 5
    first, second = result["rows"]
    assert first["passed"] is None
    assert first["worst"] == "cut at the section's budget during the measurements on the CPU"
    assert second["passed"] is None and second["worst"].startswith("not run")
    assert result["cut"] and result["passed"]
    assert len(gpu_check.LINGERING) == 1  # the cut case's thread, which the next section waits for
    assert gpu_check.wait_for_cut_cases() and not gpu_check.LINGERING  # released above: it ends

    def failing_case(stabilizer, backbone, case):
        case["error"] = ValueError("planted")

    monkeypatch.setattr(gpu_check, "_compare_case", failing_case)
    with pytest.raises(ValueError, match="planted"):
        gpu_check.compare_with_cpu(None)


def test_gpu_check_runs_its_sections_in_a_cpu_dry_run(tmp_path):
    """The script's own logic (a fit and its checks, the GPU-vs-CPU comparison, the report, sections run in separate
    calls and kept), run on the CPU against itself: it proves nothing about a GPU, but a GPU session finds no bug of
    the script's own. ``--quick`` runs every section inside its budget (FlexAttention's compilation counted); with
    budgets too small to finish, each section stops, says it was cut (not a failure of the suite), and the report keeps
    what was done."""
    out = tmp_path / "check.md"

    def check(*args: str, status: int = 0) -> None:
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu_dry_run", *args,
                               "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == status, done.stdout[-3000:] + done.stderr[-3000:]

    check("--quick", "--sections", "tests,runs,compare,benchmarks", "--cases", "none:vit,spectral_norm:vit",
          "--attack_points", "32", "--autoattack_points", "2", "--budget_scale", "10")  # 2 CPU cores, not a GPU
    text = out.read_text()
    for section in ("tests", "runs", "compare", "benchmarks"):
        assert f"## {section}: passed" in text and "s budget." in text, section
    assert "| spectral_norm | vit |" in text and "skipped" in text  # the gpu tests skip on the CPU
    state = __import__("json").loads(out.with_suffix(".json").read_text())
    runs = {row["stabilizers"]: row for row in state["runs"]["rows"]}
    assert runs["none"]["autoattack points"] == 2 and runs["spectral_norm"]["autoattack points"] is None  # AA: a few
    assert 0 <= runs["none"]["clean"] <= 1 and len(state["compare"]["rows"]) == 2
    assert state["benchmarks"]["rows"][0]["command"].startswith("python benchmarks/step_cost.py")
    check("--sections", "compare", "--cases", "none:vit,spectral_norm:swin")  # the full mode, one section
    state = __import__("json").loads(out.with_suffix(".json").read_text())
    assert state["runs"]["quick"] and not state["compare"]["quick"]  # the other sections keep their last results
    assert "| spectral_norm | swin |" in out.read_text()
    # a budget too small to finish: each section stops and says so — cut, not failed (status 3, not 1)
    check("--quick", "--sections", "runs,compare", "--cases", "none:vit", "--budget_scale", "0.0001", status=3)
    state = __import__("json").loads(out.with_suffix(".json").read_text())
    problem = state["runs"]["rows"][0]["problems"][0]
    assert problem.startswith("cut at the section's budget during ") or problem == ("not started: the section's "
                                                                                     "budget was spent"), problem
    worst = state["compare"]["rows"][0]["worst"]  # not started, or cut in its first phase (the case's own thread)
    assert worst == "not run: the section's budget was spent" or worst.startswith("cut at the section's budget during")
    text = out.read_text()
    assert "## runs: cut at its budget" in text and "## compare: cut at its budget" in text and "FAILED" not in text


def test_sweep_workers_times_the_same_runs_with_k_at_once(tmp_path):
    text = run_benchmark("sweep_workers.py", tmp_path / "workers.md")
    rows = {row[0]: row for row in table_rows(text)}
    assert set(rows) == {"1", "2"} and rows["1"][3] == "1.00" and float(rows["2"][1]) > 0


def gpu_session(tmp_path: Path, *parts: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), *parts], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "", **env})
    log = out / "session.log"
    return done, log.read_text() if log.is_file() else ""


def test_gpu_session_refuses_an_unknown_part_naming_the_valid_ones(tmp_path):
    done, log = gpu_session(tmp_path, "check", "horizons")
    assert done.returncode == 2 and "unknown part 'horizons'" in log and "start" not in log  # nothing ran
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    defined = sorted(line[len("part_"):line.index("(")] for line in script.splitlines() if line.startswith("part_"))
    named = sorted(log.split("valid parts are ")[1].strip().split(", "))
    assert named == defined


def test_gpu_session_records_how_each_part_ended_and_goes_on(tmp_path):
    """A part that fails (no GPU here: gpu_check exits 2) and one cut at its limit (its script replaced by one that
    hangs, stopped after 1 s) are each recorded with their status and seconds; the parts after them still run."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(f'#!/bin/sh\ncase "$1" in *loop_overhead.py) exec sleep 30;; esac\n'
                                 f'exec {sys.executable} "$@"\n')
    (fake / "python").chmod(0o755)
    done, log = gpu_session(tmp_path, "loop", "check", LIMIT_LOOP="1",
                            PATH=f"{fake}:{__import__('os').environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert "loop: cut at its limit after" in log
    assert "check: exit 2 after" in log
    assert log.rstrip().endswith("done")


@pytest.fixture
def benchmark_modules(monkeypatch):
    """The benchmark scripts importable in this process, with the interrupt notes and the SIGINT handler restored."""
    import signal
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import common
    common.CUT.clear()
    handler = signal.getsignal(signal.SIGINT)
    yield common
    common.CUT.clear()
    signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after it caught one


def scripted(values):
    """A timed case whose n-th call takes values[n] seconds; an exception in values is raised at that call."""
    calls = iter(values)
    def case():
        value = next(calls)
        if isinstance(value, BaseException):
            raise value
        return value
    return case


def cut_main(main) -> int:
    """A benchmark's main, which must end with a status, never with an escaped interrupt (pytest would stop)."""
    try:
        main()
    except SystemExit as done:
        return done.code
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the benchmark")
    return 0


def test_an_interrupt_keeps_the_timed_rounds_every_case_finished(benchmark_modules, monkeypatch, tmp_path):
    """Cut in the third round, after case a's third sample: the medians are of the two whole rounds (a's 100 s from the
    cut round dropped: with it, a's median would be 2), and the table says it was cut. Cut in the first round, or
    without keep_cut_rounds, the interrupt goes on."""
    common = benchmark_modules
    monkeypatch.setattr(common, "time_once", lambda fn, device: fn())
    def cases(b_third):
        return {"a": scripted([0, 1.0, 2.0, 100.0]), "b": scripted([0, 1.0, 2.0, b_third])}
    try:
        medians = common.interleaved(cases(KeyboardInterrupt()), "cpu", repeats=5, warmup=1, keep_cut_rounds=True)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped after two whole rounds")
    assert medians == {"a": 1.5, "b": 1.5}
    assert common.CUT == ["interrupted after 2 of 5 timed rounds: medians of those 2"]
    out = common.write("cut", __import__("argparse").Namespace(out=str(tmp_path / "cut.md")), "cpu", "T", "")
    assert "**Cut short:** interrupted after 2 of 5" in out.read_text()
    with pytest.raises(KeyboardInterrupt):
        common.interleaved(cases(KeyboardInterrupt()), "cpu", repeats=5, warmup=1)
    with pytest.raises(KeyboardInterrupt):
        common.interleaved({"a": scripted([0, KeyboardInterrupt()])}, "cpu", repeats=5, warmup=1, keep_cut_rounds=True)


@pytest.mark.parametrize("where", ["timing", "building"])
def test_step_cost_cut_at_its_limit_writes_the_shapes_it_finished(benchmark_modules, monkeypatch, tmp_path, where):
    """Three shapes; the second is cut while it is timed (interleaved keeps its whole rounds and notes the cut) or
    while it is built (no row of it). Its rows are kept in the first case only; the third shape is never measured;
    the exit status is 130."""
    import step_cost
    def measure(backbone, size, tokens, *rest):
        if tokens == 256:
            if where == "building":
                raise KeyboardInterrupt
            benchmark_modules.CUT.append("interrupted after 1 of 3 timed rounds: medians of those 1")
        return [[backbone, size, tokens, "fp32", "none", 1.0, "1.00×", "", "", 1.0, "1.00×"]]
    monkeypatch.setattr(step_cost, "measure", measure)
    out = tmp_path / "step.md"
    monkeypatch.setattr(sys, "argv", ["step_cost.py", "--backbones", "vit:micro", "--tokens", "16,256,64",
                                      "--out", str(out)])
    assert cut_main(step_cost.main) == 130
    text = out.read_text()
    assert [row[2] for row in table_rows(text)] == (["16", "256"] if where == "timing" else ["16"])
    notes = {"timing": "vit:micro, 256 tokens, fp32: interrupted after 1 of 3 timed rounds",
             "building": "interrupted while measuring vit:micro, 256 tokens, fp32, before its rows were complete"}
    assert notes[where] in text
    assert "not measured: vit:micro, 64 tokens, fp32" in text


@pytest.mark.parametrize("where", ["timing", "building"])
def test_cap_batches_cut_at_its_limit_writes_the_backbones_it_finished(benchmark_modules, monkeypatch, tmp_path,
                                                                      where):
    """Three backbones; the second is cut while it is timed (interleaved keeps its whole rounds and notes the cut) or
    while it is built (no row of it); the third is never measured; the exit status is 130. Cut in the first, nothing
    is written."""
    import cap_batches
    def measure(entry, ways, *rest):
        if entry == "swin:micro":
            if where == "building":
                raise KeyboardInterrupt
            benchmark_modules.CUT.append("interrupted after 1 of 3 timed rounds: medians of those 1")
        return [[entry, way] for way in ways]
    monkeypatch.setattr(cap_batches, "measure", measure)
    out = tmp_path / "caps.md"
    monkeypatch.setattr(sys, "argv", ["cap_batches.py", "--backbones", "vit:micro,swin:micro,cswin:micro", "--out",
                                      str(out)])
    assert cut_main(cap_batches.main) == 130
    text = out.read_text()
    finished = ["vit:micro", "swin:micro"] if where == "timing" else ["vit:micro"]
    assert [row[0] for row in table_rows(text)] == [entry for entry in finished for _ in range(4)]
    notes = {"timing": "swin:micro: interrupted after 1 of 3 timed rounds",
             "building": "interrupted while measuring swin:micro, before its rows were complete"}
    assert notes[where] in text and "not measured: cswin:micro" in text
    out.write_text("an earlier table")
    benchmark_modules.CUT.clear()
    monkeypatch.setattr(cap_batches, "measure", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert "nothing written" in str(cut_main(cap_batches.main))
    assert out.read_text() == "an earlier table"


def test_step_cost_writes_nothing_when_cut_before_any_row(benchmark_modules, monkeypatch, tmp_path):
    """An earlier table is not replaced by an empty one."""
    import step_cost
    def measure(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(step_cost, "measure", measure)
    out = tmp_path / "step.md"
    out.write_text("an earlier table")
    monkeypatch.setattr(sys, "argv", ["step_cost.py", "--backbones", "vit:micro", "--tokens", "16", "--out", str(out)])
    assert "nothing written" in str(cut_main(step_cost.main))
    assert out.read_text() == "an earlier table"


def test_step_costs_host_time_is_the_steps_and_its_launches_those_of_the_tiny_shape(benchmark_modules, monkeypatch):
    """``--count --host``: the time is of one of the case's training steps (a planted 20 ms of host work in each step
    adds 20 ms, not more, not less), at the tiny shape (its images' size, the width it builds), never a check step,
    and the launches are counted at that shape (against a count made here); ``--host`` alone is refused."""
    import step_cost

    from stability.testing.gpu_model import count, cuda_path

    case = next(c for c in step_cost.CASES if c.label == "none")
    built = []
    original_build = step_cost.Case.build
    monkeypatch.setattr(step_cost.Case, "build", lambda self, *a, **kw: built.append(kw) or original_build(
        self, *a, **kw))
    seconds, launches = step_cost.host_time(case, "vit", "micro", "fp32", rounds=3, steps=2)
    assert built[0]["backbone_options"]["embed_dim"] == step_cost.HOST_WIDTH * 4 and built[0].get("depth") is None
    image_size, options = step_cost.geometry("vit", "micro", step_cost.HOST_TOKENS)
    module, _ = case.build("vit", "micro", image_size=image_size, device=torch.device("cpu"),
                           backbone_options={**options, "embed_dim": step_cost.HOST_WIDTH * 4})
    images, labels = torch.rand(step_cost.HOST_BATCH, 3, image_size, image_size), torch.tensor([0, 1])
    with cuda_path(module):
        optimizer = module.build_optimizer()
        step_cost.train_step(module, optimizer, images, labels, "fp32", 1)
        assert launches == count(lambda: step_cost.train_step(module, optimizer, images, labels, "fp32", 2)).launches
    original_step, steps, shapes = step_cost.train_step, [], set()

    def slower(module, optimizer, images, labels, precision, step):
        steps.append(step)
        shapes.add(tuple(images.shape))
        time.sleep(0.02)
        return original_step(module, optimizer, images, labels, precision, step)

    monkeypatch.setattr(step_cost, "train_step", slower)
    slowed, same = step_cost.host_time(case, "vit", "micro", "fp32", rounds=3, steps=40)  # 124 steps in all
    assert same == launches and 0.015 < slowed - seconds < 0.03, (slowed, seconds)
    assert shapes == {(step_cost.HOST_BATCH, 3, image_size, image_size)}
    assert len(set(steps)) == len(steps) and not [s for s in steps if s % step_cost.CHECK_EVERY == 0]
    with pytest.raises(SystemExit, match="give --count too"):
        monkeypatch.setattr(sys, "argv", ["step_cost.py", "--host"])
        step_cost.main()


def test_step_cost_cases_bring_the_rows_their_ratios_need():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_cost import CASES, selected
    labels = [c.label for c in selected(CASES, ("muon soft_cap", "lipschitz_transformer + muon + gloro"))]
    assert labels == ["none", "muon (no constraint)", "muon soft_cap", "lipschitz_transformer + muon hard_cap",
                      "lipschitz_transformer + muon + gloro"]
    assert [c.label for c in selected(CASES, ("qk_norm",), ("none", "jasmin k=10"))] == ["none", "jasmin k=10",
                                                                                           "qk_norm"]
    assert selected(CASES, ()) == CASES


def test_every_step_cost_row_trains_the_constraint_its_label_names():
    """A label that names a weight constraint builds it; the Lipschitz transformer's rows cap every matrix as its
    configs do (muon's own defaults, the soft cap on the hidden matrices, once stood under a "hard_cap" label)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import build_module
    from step_cost import CASES

    from stability.stabilizers.muon import CONSTRAINTS, MuonConstrained

    checked = 0
    for case in CASES:
        if "muon" not in case.stabilizer.split(","):
            continue
        named = [c for c in CONSTRAINTS if c != "none" and c in case.label.replace(" ", "_")]
        module, _ = case.build("vit", "micro", image_size=8, in_chans=1, device=torch.device("cpu"),
                               backbone_options={"patch_size": 4})  # what every table builds
        muon = next(s for s in module.stabilizers if isinstance(s, MuonConstrained))
        expected = "none" if "no constraint" in case.label else named[0] if named else "hard_cap"
        assert muon.constraint == expected, case.label
        if "lipschitz_transformer" in case.label:
            assert muon.layers == "all", case.label
        checked += 1
    assert checked >= 8
    with pytest.raises(ValueError, match=r"\['gloro'\].*not in \['none'\]"):
        build_module("vit", "micro", "none", image_size=8, in_chans=1, device=torch.device("cpu"),
                     stabilizer_options={"gloro": {}})
    # the first stabilizer's options and its options by name merge, the named ones winning (they once replaced them)
    module, _ = build_module("vit", "micro", "muon", {"constraint": "soft_cap", "layers": "all"}, image_size=8,
                             in_chans=1, device=torch.device("cpu"),
                             stabilizer_options={"muon": {"constraint": "none"}})
    muon = next(s for s in module.stabilizers if isinstance(s, MuonConstrained))
    assert (muon.constraint, muon.layers) == ("none", "all")


def test_every_table_builds_its_rows_with_the_options_they_name(monkeypatch):
    """step_cost's timed and counted steps and compiled_kernels' counts each build a row with all of its options
    (its stabilizers', its backbone's): the hard-capped rows' muon options were once dropped by one of them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compiled_kernels
    import step_cost

    class Built(Exception):
        pass

    wanted = None

    def recording(*args, **kwargs):  # the row asked for stops the table; the rows it is measured against are built
        if args[2:4] == (wanted.stabilizer, wanted.options) and kwargs["backbone_options"].get("qk_norm") == (
                wanted.backbone_options or {}).get("qk_norm"):
            raise Built(args, kwargs)
        return build_module(*args, **kwargs)

    from common import build_module
    monkeypatch.setattr(step_cost, "build_module", recording)
    case = next(c for c in step_cost.CASES if c.label == "lipschitz_transformer + muon + gloro")
    timm = next(c for c in step_cost.CASES if c.backbone_options)
    capped = next(c for c in step_cost.CASES if c.label == "muon hard_cap")  # options of its own
    calls = {
        "counted": lambda c: step_cost.counted(c, "vit", "micro", 16, 4, "bf16"),
        "measure": lambda c: step_cost.measure("vit", "micro", 16, 4, torch.device("cpu"), 1, "bf16", only=(c.label,)),
        "counts_at": lambda c: compiled_kernels.counts_at(c, "micro", 16, 1, "bf16"),
    }
    for name, call in calls.items():
        for row in (case, timm, capped):
            wanted = row
            with pytest.raises(Built) as built:
                call(row)
            args, kwargs = built.value.args
            assert args[2:4] == (row.stabilizer, row.options), name
            assert kwargs["stabilizer_options"] == row.stabilizer_options, name
            assert row.backbone_options is None or kwargs["backbone_options"].items() >= row.backbone_options.items(), \
                name
            if name != "measure":  # the counts' depth wins over any option of the row's
                assert kwargs["backbone_options"]["depth"] in (1, 2), name



@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, "lightning"])
def test_loop_overhead_cut_at_its_limit_writes_the_loops_it_timed(benchmark_modules, monkeypatch, tmp_path, interrupt):
    """Cut while the captured loop is timed (a KeyboardInterrupt in a plain loop), or while the fit is timed (Lightning
    turns the interrupt into SystemExit, the trainer marked interrupted): the loops timed before are written."""
    import types

    import loop_overhead
    trainer = types.SimpleNamespace(interrupted=False)
    data = types.SimpleNamespace(datamodule=types.SimpleNamespace(batch_size=8), trainer=trainer)
    monkeypatch.setattr(loop_overhead, "build", lambda *a: data)
    def fit(*a):
        if interrupt == "lightning":
            trainer.interrupted = True
            raise SystemExit(1)
        return 2.0
    def captured(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop_overhead, "time_stability_fit", fit)
    monkeypatch.setattr(loop_overhead, "time_hand_written", lambda *a: (1.0, None))
    monkeypatch.setattr(loop_overhead, "time_captured", captured)
    out = tmp_path / "loop.md"
    monkeypatch.setattr(sys, "argv", ["loop_overhead.py", "--steps", "10", "--out", str(out)])
    status = cut_main(loop_overhead.main)
    if interrupt == "lightning":  # cut in the first loop: nothing to write
        assert "nothing written" in str(status) and not out.exists()
        return
    assert status == 130
    text = out.read_text()
    rows = {row[0]: row for row in table_rows(text)}
    assert sorted(rows) == ["hand-written loop (AdamW)", "stability fit (default callbacks)"]
    assert rows["stability fit (default callbacks)"][3] == "0.50" and rows["hand-written loop (AdamW)"][4] == "—"
    assert "interrupted while timing the captured loop" in text
    assert "stability fit reaches 50% of the hand-written loop's images/s" in text


def test_loop_overhead_passes_on_an_exit_that_is_not_a_cut(benchmark_modules, monkeypatch, tmp_path):
    import types

    import loop_overhead
    data = types.SimpleNamespace(datamodule=types.SimpleNamespace(batch_size=8),
                                 trainer=types.SimpleNamespace(interrupted=False))
    monkeypatch.setattr(loop_overhead, "build", lambda *a: data)
    def fit(*a):
        raise SystemExit("a failed fit")
    monkeypatch.setattr(loop_overhead, "time_stability_fit", fit)
    monkeypatch.setattr(sys, "argv", ["loop_overhead.py", "--out", str(tmp_path / "loop.md")])
    assert cut_main(loop_overhead.main) == "a failed fit" and not (tmp_path / "loop.md").exists()


def test_epoch_phases_cut_during_the_fit_writes_the_phases_so_far(benchmark_modules, monkeypatch, tmp_path):
    """A real fit interrupted as its third training step starts (Lightning catches the KeyboardInterrupt and exits):
    the table has the start-up and the steps so far, and says where it was cut."""
    import epoch_phases
    import lightning as L

    class Interrupt(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                raise KeyboardInterrupt

    class CLI(epoch_phases.StabilityCLI):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trainer.callbacks.append(Interrupt())

    monkeypatch.setattr(epoch_phases, "StabilityCLI", CLI)
    monkeypatch.setattr(epoch_phases.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "run"))
    out = tmp_path / "phases.md"
    monkeypatch.setattr(sys, "argv", ["epoch_phases.py", "--config", "configs/vit_digits.yaml", "--epochs", "3",
                                      "--out", str(out), "--",
                                      "--model.backbone_options", "{embed_dim: 16, depth: 1, num_heads: 2}"])
    monkeypatch.chdir(ROOT)
    assert cut_main(epoch_phases.main) == 130
    text = out.read_text()
    assert "interrupted during epoch 1 of 3, in the run's training step 3 (or after it)" in text
    assert float({row[0]: row for row in table_rows(text)}["training steps: forward and loss"][1]) > 0


def test_a_real_sigint_cuts_step_cost_to_the_rounds_it_timed(tmp_path):
    """The whole path: SIGINT (as `timeout -s INT` sends it) while the rows are timed (the script says when it starts
    timing), and the table is written."""
    import signal
    import time
    out = tmp_path / "step.md"
    process = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "step_cost.py"), "--backbones", "vit:micro",
                                "--tokens", "16,64", "--batch", "2", "--cases", "qk_norm", "--repeats", "1000000",
                                "--out", str(out)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:  # built and warmed up: the timing begins
            if "timing" in line:
                break
        time.sleep(3)  # whole rounds of two micro steps
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()  # never left behind, whatever failed
    assert process.returncode == 130, stderr[-2000:]
    text = out.read_text()
    assert [row[4] for row in table_rows(text)] == ["none", "qk_norm"]
    assert "timed rounds: medians of those" in text and "not measured: vit:micro, 64 tokens, fp32" in text


def test_step_cost_refuses_an_unknown_case_naming_the_valid_ones():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_cost.py"), "--quick", "--cases",
                           "qk_norm;qknorm", "--device", "cuda:99"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode != 0 and "--cases ['qknorm']: choose from" in done.stderr and "'qk_norm'" in done.stderr


def test_step_counts_from_one_and_two_blocks_equal_those_from_two_and_three(benchmark_modules, monkeypatch):
    """step_cost.counted extrapolates a step's counts from one and two blocks, which holds only while no decision
    changes with the depth. The hard cap's batching of second signs once did: a ViT's head and patch embedding joined
    its blocks' padded batch from two blocks on and ran apart at one, and the Lipschitz transformer's ViT-S step was
    counted at 431 launches for 941. Its hard-capped micro step, extrapolated to four blocks from (1, 2) and from
    (2, 3) blocks, gives the same launches, bytes and FLOPs."""
    import step_cost

    case = next(c for c in step_cost.CASES if c.label == "lipschitz_transformer + muon hard_cap")
    low = step_cost.counted(case, "vit", "micro", 16, 4, "bf16")
    monkeypatch.setattr(step_cost, "COUNT_DEPTHS", (2, 3))
    high = step_cost.counted(case, "vit", "micro", 16, 4, "bf16")
    assert low.launches == high.launches
    assert low.bytes == pytest.approx(high.bytes, rel=1e-9)
    assert low.flops == pytest.approx(high.flops, rel=1e-9)


def test_a_time_per_norm_row_explains_the_qk_norm_rows_the_model_missed(benchmark_modules, monkeypatch, tmp_path):
    """The committed counts of the code the H200 measured carry CUDA's norm rows; fitted with a time per row
    (``--norm_rows``), the two QK-norm rows, which share their head-wide norms and differ in bytes, are each predicted
    within 7% by the model fitted to the other rows (without that term: −14% and −6%, 20 points together where they
    are 11 with it), at a time per row of a fraction of a nanosecond over the whole GPU, and the median error falls.
    ``--norm_rows`` alone is refused, and so are counts kept before rows were counted, before any counting."""
    import step_cost

    results = ROOT / "results" / "benchmarks"
    counts = step_cost.kept_counts(results / "step_model_h200.json")
    measured = step_cost.measured_table(results / "step_cost_cuda_h200.md")
    labels = step_cost.modelled_rows(counts, measured)
    data, seconds = [counts[label] for label in labels], [measured[label] / 1000 for label in labels]
    priced_form, priced = step_cost.fit_forms(data, seconds, labels, labels, norm_rows=True)
    blind_form, blind = step_cost.fit_forms(data, seconds, labels, labels)
    model, errors = priced[priced_form][:2]
    blind_errors = blind[blind_form][1]
    assert 0.2e-9 < model.row_s < 2e-9
    qk_rows = ("qk_norm", "timm qk_norm=True")
    assert all(abs(errors[label]) < 0.07 for label in qk_rows) and abs(blind_errors["qk_norm"]) > 0.10
    assert sum(abs(errors[label]) for label in qk_rows) < 0.6 * sum(abs(blind_errors[label]) for label in qk_rows)

    def median(errs):
        return sorted(abs(e) for e in errs.values())[len(errs) // 2]

    assert median(errors) < median(blind_errors)
    with pytest.raises(SystemExit, match="give --count too"):
        monkeypatch.setattr(sys, "argv", ["step_cost.py", "--norm_rows"])
        step_cost.main()
    monkeypatch.setattr(step_cost, "counted", lambda *a: pytest.fail("counted before refusing"))
    monkeypatch.setattr(step_cost, "allow_tf32_training", lambda: None)  # no global matmul setting left behind
    kept = json.loads((results / "step_model_h200.json").read_text())
    for row in kept["counts"].values():  # counts as kept before norm rows were counted
        del row["norm_rows"]
    (tmp_path / "before_rows.json").write_text(json.dumps(kept))
    with pytest.raises(SystemExit, match=r"--norm_rows: counts kept before norm rows were counted: --fit_counts "
                                         r"\(none\)"):
        monkeypatch.setattr(sys, "argv", ["step_cost.py", "--count", "--norm_rows", "--cases", "none", "--fit_counts",
                                          str(tmp_path / "before_rows.json")])
        step_cost.main()


def test_the_shipped_gpu_model_is_the_fit_of_the_committed_counts(benchmark_modules):
    """``gpu_model.FITTED`` (what ``--cost gpu`` predicts with) is the model step_cost.py fits to the committed counts
    of the code the H200 measured and its table: a recount that changes them (a counter that sees more) refits it."""
    import step_cost

    from stability.testing.gpu_model import FITTED

    results = ROOT / "results" / "benchmarks"
    refitted = step_cost.table_model(step_cost.kept_counts(results / "step_model_h200.json"),
                                     step_cost.measured_table(results / "step_cost_cuda_h200.md"))
    shipped = FITTED["h200"]
    assert shipped.form == refitted.form
    for name in ("launch_s", "kernel_s", "bytes_per_s"):
        assert getattr(shipped, name) == pytest.approx(getattr(refitted, name), rel=1e-3), name
    assert shipped.flops_per_s == pytest.approx(refitted.flops_per_s, rel=1e-3)


def test_operator_bytes_splits_a_rows_difference_by_operator(benchmark_modules, tmp_path):
    """A row's bytes and launches less the reference's, by operator, largest change first, summing to the rows'
    difference; counts kept before bytes were kept by operator, and an unknown row, are refused by name."""
    from collections import Counter

    from operator_bytes import difference, table

    from stability.testing.gpu_model import StepCounts

    flops = {"bf16": 0.0, "tf32": 0.0, "fp32": 0.0}
    reference = StepCounts(3, flops, 7e9, 0.0, Counter(gelu=1, add=2), 0.0, Counter(gelu=4e9, add=3e9))
    row = StepCounts(6, flops, 9.5e9, 0.0, Counter(gelu=1, add=1, mul=3, div=1), 0.0,
                     Counter(gelu=4e9, add=1e9, mul=4.5e9))
    changes = difference(row, reference)
    assert changes == [("mul", 3.0, 4.5e9), ("add", -1.0, -2e9), ("div", 1.0, 0.0)]
    assert sum(moved for _, _, moved in changes) == row.bytes - reference.bytes
    text = table(changes, blocks=2, top=2)
    assert "| mul | +3 | +4.500 | +2.250 |" in text and "| 1 others | +1 | +0.000 | +0.000 |" in text
    assert text.splitlines()[-1] == "| **total** | +3 | +2.500 | +1.250 |"
    with pytest.raises(ValueError, match="reference's counts were kept before bytes were kept by operator"):
        difference(row, StepCounts(3, flops, 7e9, 0.0, Counter(gelu=1)))
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"key": "vit:small", "counts": {"none": reference.to_dict(), "row": row.to_dict()}}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "operator_bytes.py"), str(counts), "row",
                           "--blocks", "2"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "| mul | +3 | +4.500 | +2.250 |" in done.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "operator_bytes.py"), str(counts),
                              "lipsformer"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "no row 'lipsformer'; its rows: none, row" in refused.stderr


def test_center_norm_paths_times_both_paths_in_one_process(tmp_path, benchmark_modules):
    """The paired LipsFormer step: the plain step and LipsFormer with CenterNorm on LayerNorm's kernels and on its
    former path, each a ratio to the plain step; the former path is the formula (or the written-out backward), not
    LayerNorm, and switching to it is undone after the step."""
    from center_norm_paths import former_path

    from stability.nn import center_norm
    from stability.nn.center_norm import CenterNorm

    text = run_benchmark("center_norm_paths.py", tmp_path / "paths.md")
    rows = {row[0]: row for row in table_rows(text)}
    assert list(rows) == ["none", "lipsformer: CenterNorm on LayerNorm's kernels",
                          "lipsformer: CenterNorm's former path"]
    assert rows["none"][2] == "1.00×" and all(float(row[1]) > 0 for row in rows.values())
    norm, x = CenterNorm(8), torch.randn(2, 3, 8, requires_grad=True)
    with former_path():
        assert norm(x).grad_fn.name() == "AddcmulBackward0"
    assert norm(x).grad_fn.name() == "NativeLayerNormBackward0" and center_norm.takes_layer_norm(x, x, x)


def test_step_shapes_are_checked_by_name_before_anything_is_measured(benchmark_modules, monkeypatch, tmp_path):
    """Every transformer preset is taken (Swin with a window that fits); an unknown backbone or size, or a preset
    without patches (the CNN and the hybrid), is refused naming the transformers' presets, and a number of tokens that
    is not square naming the number — by step_cost.py before its first shape is measured, by compiled_kernels.py and
    center_norm_paths.py before they start."""
    import step_cost

    from stability.models.registry import PRESETS

    transformers = [f"{name}:{size}" for name in ("vit", "swin", "cswin") for size in PRESETS[name]]
    for name_size in transformers:
        name, size = name_size.split(":")
        image_size, options = step_cost.geometry(name, size, 16)
        assert image_size == 4 * PRESETS[name][size]["patch_size"]
        assert options == ({"window_size": 2} if name == "swin" else {})
    choices = ", ".join(transformers)
    for backbone, size in (("vit", "huge"), ("vitt", "tiny"), ("lipcnn", "micro"), ("hybrid", "micro")):
        with pytest.raises(SystemExit) as refused:
            step_cost.geometry(backbone, size, 16)
        assert str(refused.value) == f"no transformer preset {backbone}:{size}; choose one of {choices}"
    with pytest.raises(SystemExit, match="--tokens 50: need a square number"):
        step_cost.geometry("vit", "micro", 50)
    measured = []
    monkeypatch.setattr(step_cost, "measure", lambda *args, **kwargs: measured.append(args) or [])
    monkeypatch.setattr(sys, "argv", ["step_cost.py", "--backbones", "vit:micro,swim:tiny", "--out",
                                      str(tmp_path / "t.md")])
    with pytest.raises(SystemExit, match="no transformer preset swim:tiny"):
        step_cost.main()
    assert measured == []
    for script, arguments in (("compiled_kernels.py", ["--size", "huge"]),
                              ("center_norm_paths.py", ["--backbone", "hybrid:micro"])):
        refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *arguments,
                                  "--out", str(tmp_path / "x.md")], capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode != 0 and "no transformer preset" in refused.stderr, refused.stderr[-500:]
        assert "Traceback" not in refused.stderr
