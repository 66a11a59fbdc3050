"""Every benchmark script runs in its quick configuration and writes its table (so they cannot rot)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, out: Path) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# ") and f"benchmarks/{script} --quick" in text  # the command is written beside it
    return text


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]


def test_step_cost_lists_every_stabilizer_with_ratios_and_targets(tmp_path):
    text = run_benchmark("step_cost.py", tmp_path / "step.md")
    rows = {row[3]: row for row in table_rows(text)}
    assert {"none", "jasmin k=10", "jasmin k=10, streamed", "specformer", "spectral_norm project", "lipsformer",
            "muon soft_cap"} <= set(rows)
    assert rows["none"][5].startswith("1.00×")
    assert rows["specformer"][6] == "≤ 1.10×"
    assert rows["specformer"][7] == "met" or rows["specformer"][7].startswith("missed by ")
    assert "(muon (no constraint))" in rows["muon soft_cap"][5]
    assert all(float(row[4]) > 0 and float(row[8]) > 0 for row in rows.values())


def test_measurement_cost_relates_every_measurement_to_a_training_step(tmp_path):
    text = run_benchmark("measurement_cost.py", tmp_path / "measure.md")
    rows = {row[0]: row for row in table_rows(text)}
    assert rows["training step"][5] == "1.00" and float(rows["training step"][4]) > 0
    assert rows["local Lipschitz, power, 2 iterations"][7].startswith("≤ 5 steps: ")
    assert {"FGSM", "PGD-10", "certified bound (Lipschitz-transformer ViT)", "certified accuracy (bound + radii)",
            "attention diagnostics (16 points)"} <= set(rows)


def test_estimator_accuracy_power_iteration_never_exceeds_the_exact_norm(tmp_path):
    text = run_benchmark("estimator_accuracy.py", tmp_path / "accuracy.md")
    power, specformer = text.split("## Specformer")
    for row in table_rows(power):
        assert float(row[3]) <= 1e-4  # a lower bound: (estimate - exact) / exact ≤ 0 up to rounding
    assert len(table_rows(specformer)) >= 2
