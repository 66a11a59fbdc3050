"""Runs compared at equal cost (stability/report/equal_cost.py, ``stability report --cost``, experiments/wallclock.py)
on a committed fixture of logged runs (tests/fixtures/equal_cost/make.py says what each logged): numbers at every
budget for stabilizers without a certified bound, measurements every N epochs lined up by step, a resumed run's time
counted once, and one-line errors for bad budgets and a cost no run logged."""
import importlib.util
import shutil
from pathlib import Path

import pytest

from stability import report
from stability.report import equal_cost
from stability.report.reading import find_runs, load_run

FIXTURE = Path(__file__).parent / "fixtures" / "equal_cost" / "runs"


def runs(unfinished=False):
    return {r.path.name.split(",")[0].removeprefix("stabilizer="): r
            for r in (load_run(p, unfinished=unfinished) for p in find_runs(FIXTURE)) if r is not None}


def test_every_budget_has_numbers_for_stabilizers_without_a_certified_bound():
    found = runs()
    metrics = equal_cost.metrics_of(found.values())
    assert metrics == ["val/acc", "robust/pgd_L2_0.5", "certified/acc_L2_0.5", "certified/acc_L2_1.58",
                       "lipschitz/local_max"]
    assert equal_cost.default_budgets(list(found.values()), "flops") == [0.75, 1.5, 3.0, 6.0]  # of jasmin's 6 TFLOP
    for name in ("none", "jasmin"):
        cells = equal_cost.at_budget(found[name], "flops", 1.5, metrics)
        assert cells["val/acc"] is not None and cells["certified/acc_L2_0.5"] is None  # a missing cell, not a row


def test_a_measurement_every_second_epoch_lines_up_by_step():
    """At 3 TFLOP the baseline has trained 3 epochs: its accuracy is epoch 3's, its PGD accuracy epoch 2's (measured
    every second epoch); JaSMin, 1.5× the cost, has trained 2."""
    found = runs()
    none = equal_cost.at_budget(found["none"], "flops", 3.0, ["val/acc", "robust/pgd_L2_0.5"])
    assert none["val/acc"] == (pytest.approx(0.65), 3) and none["robust/pgd_L2_0.5"] == (pytest.approx(0.26), 2)
    jasmin = equal_cost.at_budget(found["jasmin"], "flops", 3.0, ["val/acc"])
    assert jasmin["val/acc"] == (pytest.approx(0.6), 2)


def test_a_resumed_run_counts_its_time_once():
    """The certified run was resumed at epoch 2 and logged epoch 3 in both events files: 4 epochs of 60 s are 4 min,
    not 5, and its wall-clock budget of 4 min reaches epoch 4."""
    run = runs()["lipschitz_transformer+muon+gloro"]
    assert [spent for _, spent in equal_cost.epoch_costs(run, "wall")] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert equal_cost.at_budget(run, "wall", 4.0, ["val/acc"])["val/acc"][1] == 4


def load_wallclock():
    spec = importlib.util.spec_from_file_location("wallclock", Path(__file__).parents[1] / "experiments/wallclock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wallclock_keeps_its_certified_table_on_the_fixture():
    text = load_wallclock().table(FIXTURE, [1, 2.5, 4])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")[1:]]
            for line in text.splitlines()[2:]}
    certified = next(v for k, v in rows.items() if k.startswith("lipschitz_transformer"))
    assert certified == ["0.550 / 0.340 / 0.120 (1 ep)", "0.600 / 0.380 / 0.140 (2 ep)",
                         "0.700 / 0.460 / 0.180 (4 ep)"]
    assert rows[next(k for k in rows if k.startswith("none"))] == ["—", "—", "—"]  # no certified accuracy logged
    assert any("unfinished: 2 epochs" in k for k in rows)  # the unfinished run is listed


def test_the_report_compares_at_equal_flops_and_wall_time(tmp_path):
    for cost, unit in (("flops", "TFLOP"), ("wall", "min"), ("gpu", "GPU s")):
        out = tmp_path / cost
        assert report.main([str(FIXTURE), "--out", str(out), "--cost", cost]) == 0
        text = (out / "report.md").read_text()
        assert "## At equal cost" in text and f" {unit}**" in text
        png = out / f"equal_cost_{cost}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = (tmp_path / "flops" / "report.md").read_text()
    block = text.split("**3 TFLOP**")[1].split("**")[0]
    none_row = next(line for line in block.splitlines() if line.startswith("| none"))
    assert "0.650 (3 ep)" in none_row and "0.260 (2 ep)" in none_row


@pytest.mark.parametrize("args, said", [(["--cost", "flops", "--budgets", "five"], "'five' is not a number"),
                                        (["--cost", "flops", "--budgets", "1,-2"], "'-2' is not a positive"),
                                        (["--cost", "gpu"], "no run under")])
def test_bad_budgets_and_a_cost_not_logged_are_one_line_errors(tmp_path, capsys, args, said):
    source = FIXTURE
    if said == "no run under":  # runs that logged wall-clock time only
        source = tmp_path / "runs"
        shutil.copytree(FIXTURE, source)
        from torch.utils.tensorboard import SummaryWriter

        for run in source.iterdir():
            for events in run.glob("events.*"):
                events.unlink()
            writer = SummaryWriter(str(run))
            writer.add_scalar("time/train_epoch_s", 10.0, 10)
            writer.add_scalar("val/acc", 0.5, 10)
            writer.close()
    assert report.main([str(source), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_the_frontier_keeps_only_what_no_cheaper_point_beats():
    points = [(1.0, 0.5), (2.0, 0.4), (2.0, 0.7), (3.0, 0.6), (4.0, 0.8)]
    assert equal_cost.frontier(points) == [(1.0, 0.5), (2.0, 0.7), (4.0, 0.8)]
