"""`stability report`: the table and plots made from the event files of real tiny runs, labels of
plain runs, histogram quantiles."""
import json
import math
import statistics
import time
from pathlib import Path

import pytest

from stability import report
from stability.report.aggregate import Configuration, group, label_configurations
from stability.report.plots import short_names, weighted_quantiles
from stability.report.reading import RunRecord, load_run


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, sweep_file, run_sweep):
    """Six tiny runs: the baseline, LipsFormer (it has a certified bound) and a configuration that
    diverges, seeds 0 and 1."""
    root = tmp_path_factory.mktemp("report")
    diverging = {"stabilizer": "none", "model.optimizer": "sgd", "model.lr": 1.0e5}
    spec = sweep_file(root, seeds=[0, 1], extra_variants=[diverging, {"stabilizer": "lipsformer"}])
    done = run_sweep(root, spec, "--workers", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "sweeps" / "tiny"


def table_rows(text: str) -> dict[str, dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["configuration"]: row for row in rows}


def test_report_table_is_the_mean_and_std_over_seeds_with_every_plot(tiny_sweep, tmp_path, scalars):
    out = tmp_path / "results"
    assert report.main([str(tiny_sweep), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    values = table_rows(text)["stabilizer=none"]
    assert values["seeds"] == "2" and values["diverged"] == "0/2"
    accuracies = [scalars(tiny_sweep / f"stabilizer=none,seed={s}", "test/acc")[0] for s in (0, 1)]
    assert values["clean acc"] == f"{statistics.fmean(accuracies):.3g} ± {statistics.stdev(accuracies):.2g}"
    assert "pgd_Linf_8/255" in values and "Lip local mean" in values and values["s/epoch"] != "—"
    assert values["worst_Linf_8/255"] != "—" and values["cert L2_0.5"] == "—"  # no certified bound: no column value
    lipsformer = table_rows(text)["stabilizer=lipsformer"]
    assert lipsformer["cert L2_0.5"] != "—" and lipsformer["certified log10"] != "—"
    for plot in ("accuracy_vs_lipschitz", "robust_vs_budget", "loss_curves", "lipschitz_distribution",
                 "accuracy_vs_certified", "certified_vs_empirical"):
        png = out / f"{plot}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, plot
        assert f"![{plot}]({plot}.png)" in text


def test_a_diverged_run_counts_in_the_rate_only(tiny_sweep, tmp_path):
    out = tmp_path / "results"
    assert report.main([str(tiny_sweep), "--out", str(out)]) == 0
    row = table_rows((out / "report.md").read_text())["stabilizer=none, model.optimizer=sgd, model.lr=100000.0"]
    assert row["seeds"] == "2" and row["diverged"] == "2/2" and row["clean acc"] == "—"


def test_test_time_numbers_come_from_results_json(tiny_sweep):
    run = load_run(tiny_sweep / "stabilizer=none,seed=0")
    results = json.loads((run.path / "checkpoints" / "results.json").read_text())
    assert run.results == results
    assert run.summary["clean acc"] == results["clean_accuracy"]
    assert run.robust() == {k: v for k, v in results["robustness"]["accuracy"].items() if k != "clean"}
    assert run.summary["Lip local mean"] == results["lipschitz"]["local_mean"]


def test_a_missing_directory_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def record(path: str, seed: int, **sections) -> RunRecord:
    config = {"seed_everything": seed, "run_dir": path, "data": {"class_path": "stability.data.Digits",
                                                                 "init_args": {"batch_size": 64}}, **sections}
    return RunRecord(Path(path), config, "completed", {}, {})


def test_report_labels_plain_runs_by_the_settings_that_differ():
    runs = [record(f"r{lr}{seed}", seed, model={"lr": lr, "backbone": "vit"})
            for lr, seed in ((0.001, 0), (0.001, 1), (0.01, 0))]
    label_configurations(runs)
    assert [r.configuration for r in runs] == ["lr=0.001", "lr=0.001", "lr=0.01"]
    assert [len(c.runs) for c in group(runs)] == [2, 1]


def test_labels_leave_out_the_options_of_stabilizers_a_run_did_not_select():
    """config.yaml holds every stabilizer's option group; only the selected ones label a run."""
    defaults = {"spectral_norm": {"mode": "project", "sigma_max": 1.0}, "jasmin": {"lam": 1e-3}}
    runs = [record("a", 0, stabilizer="none", **defaults),
            record("b", 0, stabilizer="spectral_norm", **{**defaults, "spectral_norm": {"mode": "parametrize",
                                                                                        "sigma_max": 1.0}}),
            record("c", 0, stabilizer="jasmin", **{**defaults, "jasmin": {"lam": 1e-2}})]
    label_configurations(runs)
    assert [r.configuration for r in runs] == [
        "stabilizer=none", "spectral_norm.mode=parametrize, stabilizer=spectral_norm",
        "jasmin.lam=0.01, stabilizer=jasmin"]


def test_plot_names_leave_out_settings_that_tell_no_two_configurations_apart():
    lt = "stabilizer=lipschitz_transformer+muon"
    margin = "stabilizer=lipschitz_transformer+muon+lipschitz_margin"
    configurations = [
        Configuration("stabilizer=none", "none"),
        Configuration(f"{lt}, lipschitz_transformer.attention_scale=64.0, lipschitz_transformer.logit_scale=32.0, "
                      "muon.lr=0.05", "lipschitz_transformer+muon"),
        *(Configuration(f"{margin}, lipschitz_transformer.attention_scale=0.001, "
                        f"lipschitz_transformer.logit_scale=32.0, muon.lr=0.05, lipschitz_margin.eps={eps}",
                        "lipschitz_transformer+muon+lipschitz_margin")
          for eps in (0.1, 0.3)),
    ]
    assert list(short_names(configurations).values()) == [
        "none", "lipschitz_transformer+muon: attention_scale=64.0",
        "lipschitz_transformer+muon+lipschitz_margin: attention_scale=0.001, eps=0.1",
        "lipschitz_transformer+muon+lipschitz_margin: attention_scale=0.001, eps=0.3"]
    # a setting alike everywhere stays where leaving it out would make two names the same
    twins = [Configuration("stabilizer=muon, model.lr=0.1", "muon"), Configuration("stabilizer=muon", "muon"),
             Configuration("stabilizer=none, model.lr=0.1", "none")]
    assert list(short_names(twins).values()) == ["muon: model.lr=0.1", "muon", "none: model.lr=0.1"]


def test_histogram_quantiles_follow_the_buckets():
    limits, counts = [1.0, 2.0, 4.0, 8.0], [0, 10, 80, 10]
    q05, q50, q95 = weighted_quantiles(limits, counts, [0.05, 0.5, 0.95])
    assert 1.0 <= q05 <= 2.0 and 2.0 <= q50 <= 4.0 and 4.0 <= q95 <= 8.0


def test_jasmin_columns_average_g1_over_layers_and_read_the_no_embed_estimate():
    """``g1 mean``: the layers' test values averaged (per-head scalars left out); ``Lip no-embed mean``:
    results.json's estimate from the patch embedding on."""
    scalars = {"attention/blocks.0.attn/g1_mean": [(0, 9.0), (5, 0.2)],
               "attention/blocks.1.attn/g1_mean": [(5, 0.4)],
               "attention/blocks.1.attn/g1_mean_h0": [(5, 7.0)],
               "attention/blocks.1.attn/g1_max": [(5, 3.0)]}
    results = {"clean_accuracy": 0.9, "lipschitz": {"local_mean": 12.0, "local_noembed_mean": 4.5}}
    run = RunRecord(Path("run"), {}, "completed", scalars, {}, results=results)
    assert run.summary["g1 mean"] == pytest.approx(0.3)
    assert run.summary["Lip no-embed mean"] == 4.5
    assert RunRecord(Path("run"), {}, "completed", {}, {}).summary["g1 mean"] is None


def test_the_frontier_keeps_what_no_smaller_bound_beats():
    from stability.report.frontier import pareto_front
    points = [("a", 3.0, 0.90), ("b", 1.0, 0.80), ("c", 2.0, 0.79), ("d", 2.0, 0.85), ("e", 5.0, 0.90),
              ("f", 4.0, 0.95)]
    # c loses to b (smaller bound, more accurate), d beats c at the same bound, e ties a at a larger bound
    assert pareto_front(points) == ["b", "d", "a", "f"]
    assert pareto_front([]) == []


def test_the_paper_bound_plot_marks_the_frontier(tmp_path):
    from stability.report.plots import plot_accuracy_vs_paper_bound

    class Config:
        def __init__(self, label, bounds, accuracies):
            self.label, self._values = label, {"paper bound log10": bounds, "clean acc": accuracies}

        def values(self, column):
            return self._values.get(column, [])

    configs = [Config("small", [1.0, 1.2], [0.90, 0.92]), Config("large", [3.0], [0.97]),
               Config("worse", [2.0], [0.80]), Config("no bound", [], [0.99])]
    styles = {c.label: {"color": "C0", "marker": "o", "linestyle": "-", "name": c.label} for c in configs}
    path = tmp_path / "frontier.png"
    assert plot_accuracy_vs_paper_bound(configs, styles, path, "t") == ["small", "large"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_accuracy_vs_paper_bound(configs[:1], styles, tmp_path / "none.png", "t") == []
    assert not (tmp_path / "none.png").exists()


def _lr_run(lr, seed, loss, status="completed", stabilizer="none", extra=""):
    scalars = {"val/loss": [(0, 9.0), (1, loss)]} if loss is not None else {}
    config = {"model": {"num_classes": 10, "lr": lr}, "seed_everything": seed, "stabilizer": stabilizer}
    return RunRecord(Path(f"r{lr}-{seed}{extra}"), config, status, scalars, {},
                     configuration=f"stabilizer={stabilizer}, lr={lr}{extra}")


def test_lr_sensitivity_is_wortsmans_expected_capped_loss_minus_the_best():
    """Seed 0: losses 0.5, 0.2, 3.0 (capped at log 10) → mean(0.5, 0.2, log 10) − 0.2; seed 1: 0.4, 0.3 and a
    diverged run (log 10) → mean(0.4, 0.3, log 10) − 0.3. The largest stable η is 0.01 (mean 0.25 ≤ the threshold
    log 10 − (log 10 − 0.25)/2; at 0.1 runs diverged); 2 of 7 runs diverged."""
    from stability.report.aggregate import group
    from stability.report.lr_sensitivity import lr_families, lr_table

    cap = math.log(10)
    runs = [_lr_run(1e-3, 0, 0.5), _lr_run(1e-2, 0, 0.2), _lr_run(1e-1, 0, 3.0),
            _lr_run(1e-3, 1, 0.4), _lr_run(1e-2, 1, 0.3), _lr_run(1e-1, 1, 0.1, "diverged"),
            _lr_run(1e-1, 2, None, "diverged")]
    families = lr_families(group(runs))
    assert len(families) == 1
    family = families[0]
    assert family.lrs == [1e-3, 1e-2, 1e-1] and family.label == "stabilizer=none"
    expected = [(0.5 + 0.2 + cap) / 3 - 0.2, (0.4 + 0.3 + cap) / 3 - 0.3]
    assert family.sensitivity() == pytest.approx(expected)  # seed 2 ran at one η only: left out
    assert family.largest_stable_lr() == 1e-2
    assert family.divergence() == (2, 7)
    row = lr_table(families).splitlines()[-1]
    assert "lr 0.001–0.1 (3)" in row and "| 0.01 |" in row and "2/7" in row


def test_lr_families_need_two_learning_rates_and_keep_methods_apart(tmp_path):
    from stability.report.aggregate import group
    from stability.report.lr_sensitivity import lr_families, plot_loss_vs_lr

    runs = [_lr_run(1e-3, 0, 0.5), _lr_run(1e-2, 0, 0.2), _lr_run(1e-3, 0, 0.6, stabilizer="qk_norm"),
            _lr_run(1e-2, 0, 0.1, stabilizer="qk_norm"), _lr_run(1e-3, 0, 0.3, stabilizer="z_loss")]
    families = lr_families(group(runs))
    assert [f.label for f in families] == ["stabilizer=none", "stabilizer=qk_norm"]
    assert plot_loss_vs_lr(families, tmp_path / "lr.png", "t") and (tmp_path / "lr.png").is_file()


def test_the_loss_vs_lr_plot_has_a_panel_per_depth_and_legends_that_tell_the_methods_apart(tmp_path):
    from stability.report.aggregate import group
    from stability.report.lr_sensitivity import LRFamily, facet_key, lr_families, plot_loss_vs_lr, short_legends

    families = [LRFamily(label, key) for label, key in [
        ("stabilizer=none, depth=12", "lr"), ("stabilizer=none, warmup=0.2, depth=12", "lr"),
        ("stabilizer=none, depth=4", "lr"), ("stabilizer=none, warmup=0.2, depth=4", "lr"),
        ("stabilizer=lt+muon, scale=64, cap=hard, lr=0.05, depth=12", "muon.lr"),
        ("stabilizer=lt+muon, scale=64, cap=none, lr=0.05, depth=12", "muon.lr")]]
    assert facet_key(families) == "depth"  # every family has it, 2 values; cap is not everyone's
    # warmup=0.2 is shared by all who have it, but without it two legends of a panel would both read "none"
    assert short_legends(families, "depth") == ["none", "none, warmup=0.2", "none", "none, warmup=0.2",
                                                "lt+muon, cap=hard (η: muon.lr)", "lt+muon, cap=none (η: muon.lr)"]
    assert facet_key(families[:1]) is None and facet_key([families[0], families[2]]) is None  # 2 values, 2 families
    runs = [_lr_run(lr, 0, loss, stabilizer=method, extra=f", depth={depth}")
            for depth in (4, 12) for method in ("none", "qk_norm") for lr, loss in ((1e-3, 0.5), (1e-2, 0.3))]
    faceted = lr_families(group(runs))
    assert len(faceted) == 4 and facet_key(faceted) == "depth"
    assert plot_loss_vs_lr(faceted, tmp_path / "lr.png", "t") and (tmp_path / "lr.png").is_file()
    assert not plot_loss_vs_lr([], tmp_path / "none.png", "t") and not (tmp_path / "none.png").exists()


def test_a_family_follows_the_learning_rate_that_varies_when_a_label_has_two():
    """The Lipschitz transformer's runs fix ``lr`` (AdamW's, for the few parameters Muon does not take) and sweep
    ``muon.lr``: one family over muon.lr, none over the fixed lr."""
    from stability.report.aggregate import group
    from stability.report.lr_sensitivity import lr_families

    runs = []
    for muon_lr, loss in ((0.01, 0.4), (0.1, 0.2)):
        run = _lr_run(0.05, 0, loss, stabilizer="lipschitz_transformer+muon")
        run.configuration = f"stabilizer=lipschitz_transformer+muon, lr=0.05, muon.lr={muon_lr}"
        runs.append(run)
    families = lr_families(group(runs))
    assert [(f.label, f.lr_key, f.lrs) for f in families] == [
        ("stabilizer=lipschitz_transformer+muon, lr=0.05", "muon.lr", [0.01, 0.1])]


def test_a_learning_rate_that_ends_just_under_the_initial_loss_is_not_stable():
    """Final losses 0.5 and 2.2 (< log 10, but a fifth of the best improvement kept): 1e-2 is not stable."""
    from stability.report.aggregate import group
    from stability.report.lr_sensitivity import lr_families

    family = lr_families(group([_lr_run(1e-3, 0, 0.5), _lr_run(1e-2, 0, 2.2)]))[0]
    assert family.largest_stable_lr() == 1e-3


def write_events(run: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    """One TensorBoard events file in ``run`` (one file per call, as each process of a resumed run writes)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run))
    for tag, values in scalars.items():
        for step, value in values:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_a_resumed_run_counts_each_step_once_with_its_newest_value(tmp_path):
    """Resumed from the checkpoint of step 20, a run logs steps 30 and 40 again in a new events file."""
    from stability.report.reading import read_events

    first, resumed = tmp_path / "first", tmp_path / "resumed"
    write_events(first, {"val/acc": [(10, 0.1), (20, 0.2), (30, 0.3), (40, 0.4)]})
    time.sleep(0.05)
    write_events(resumed, {"val/acc": [(30, 0.33), (40, 0.44), (50, 0.55)]})
    # names that sort against the files' age (TensorBoard's names hold a per-process counter that can do the same)
    next(first.glob("events.*")).rename(tmp_path / "events.out.tfevents.9.older")
    next(resumed.glob("events.*")).rename(tmp_path / "events.out.tfevents.10.newer")
    scalars, _ = read_events(tmp_path)
    assert [step for step, _ in scalars["val/acc"]] == [10, 20, 30, 40, 50]
    assert [value for _, value in scalars["val/acc"]] == pytest.approx([0.1, 0.2, 0.33, 0.44, 0.55])


def wallclock_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("wallclock", Path(__file__).parents[1] / "experiments/wallclock.py")
    wallclock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wallclock)
    return wallclock


@pytest.mark.parametrize("args, said", [(["missing"], "no such directory"),
                                        (["."], "need minutes as numbers"), (["."], "must be > 0")])
def test_wallclock_refuses_a_missing_directory_and_bad_budgets(tmp_path, monkeypatch, capsys, args, said):
    budgets = {"need minutes as numbers": "five", "must be > 0": "0,5"}.get(said, "5")
    monkeypatch.setattr("sys.argv", ["wallclock.py", str(tmp_path / args[0]), "--budgets", budgets])
    with pytest.raises(SystemExit) as stopped:
        wallclock_script().main()
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_wallclock_budgets_include_unfinished_runs(tmp_path):
    """experiments/wallclock.py: the last epoch within each budget, unfinished sweep runs marked as such."""
    wallclock = wallclock_script()
    run = tmp_path / "seed=0"
    run.mkdir()
    (run / "config.yaml").write_text("seed_everything: 0\n")
    (run / "sweep_run.json").write_text(json.dumps({"configuration": "seed=0"}))  # no done.json: unfinished
    epochs = [(1, 60.0, 0.5, 0.3, 0.1), (2, 60.0, 0.6, 0.4, 0.2), (3, 120.0, 0.7, 0.5, 0.25)]
    write_events(run, {"time/train_epoch_s": [(e, s) for e, s, *_ in epochs],
                       "val/acc": [(e, a) for e, _, a, _, _ in epochs],
                       "certified/acc_L2_0.5": [(e, c) for e, _, _, c, _ in epochs],
                       "certified/acc_L2_1.58": [(e, c) for e, *_, c in epochs]})
    assert load_run(run) is None and load_run(run, unfinished=True).status == "unfinished"
    text = wallclock.table(tmp_path, [1.5, 2, 10])
    row = next(line for line in text.splitlines() if "unfinished: 3 epochs" in line)
    assert [c.strip() for c in row.strip("|").split("|")][1:] == [
        "0.500 / 0.300 / 0.100 (1 ep)", "0.600 / 0.400 / 0.200 (2 ep)", "0.700 / 0.500 / 0.250 (3 ep)"]


def test_wallclock_joins_times_and_measurements_by_step(tmp_path):
    """Certified accuracy measured every second epoch: each budget reads the epoch the measurement belongs to (joined
    by global step; by position, epoch 1's time would be paired with epoch 2's measurement)."""
    wallclock = wallclock_script()
    run = tmp_path / "seed=0"
    run.mkdir()
    (run / "config.yaml").write_text("seed_everything: 0\n")
    (run / "sweep_run.json").write_text(json.dumps({"configuration": "seed=0"}))
    times = [(10, 60.0), (20, 60.0), (30, 60.0), (40, 60.0)]  # (last step of the epoch, seconds)
    write_events(run, {"time/train_epoch_s": times,
                       "val/acc": [(10, 0.5), (20, 0.6), (30, 0.7), (40, 0.8)],
                       "certified/acc_L2_0.5": [(20, 0.4), (40, 0.6)],
                       "certified/acc_L2_1.58": [(20, 0.2), (40, 0.3)]})
    rows = wallclock.at_budgets(load_run(run, unfinished=True), [60, 120, 180, 240])
    assert rows[0] is None
    got = [v for r in rows[1:] for v in (r["epochs"], r["acc"], r["0.5"], r["1.58"])]
    assert got == pytest.approx([2, 0.6, 0.4, 0.2, 2, 0.6, 0.4, 0.2, 4, 0.8, 0.6, 0.3])


def _sweep_run(root: Path, name: str, done: bool, results: dict | None, epochs: int,
               fit_values: dict | None = None) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"seed_everything: {name[-1]}\ntrainer:\n  max_epochs: 10\n")
    (run / "sweep_run.json").write_text(json.dumps({"configuration": "(base)"}))
    if done:
        (run / "done.json").write_text(json.dumps({"status": "completed"}))
    if results is not None:
        (run / "checkpoints" / "results.json").write_text(json.dumps(results))
    write_events(run, {"loss/task_epoch": [(e, 1.0 / e) for e in range(1, epochs + 1)],
                       "val/acc": [(e, 0.5 + 0.01 * e) for e in range(1, epochs + 1)],
                       **{tag: [(epochs, value)] for tag, value in (fit_values or {}).items()}})
    return run


def _results(clean: float, pgd: float, complete: bool, aa_points: int) -> dict:
    robustness = {"points": 100, "accuracy": {"clean": clean, "pgd_L2_0.5": pgd}, "certified": {},
                  "attacks": {"pgd_L2_0.5": {"attack": "pgd", "norm": "L2", "eps": 0.5, "points": 100},
                              "autoattack_L2_0.5": {"attack": "autoattack", "norm": "L2", "eps": 0.5,
                                                    "points": aa_points}}}
    if not complete:
        robustness["interrupted"] = f"autoattack_L2_0.5 stopped by SIGTERM after {aa_points} points"
    return {"complete": complete, "clean_accuracy": clean, "robustness": robustness}


def test_unfinished_runs_enter_the_report_once_their_test_has_begun(tmp_path, capsys):
    """--unfinished: a run stopped in its test is in the table with what it measured, counted as unfinished and named
    with the measurement it stopped in; a run still training is listed, never averaged in (its numbers are
    validation values of a model not yet trained); without the flag only finished runs count."""
    sweep = tmp_path / "sweep"
    _sweep_run(sweep, "seed=0", True, _results(0.9, 0.8, True, 100), 10)
    _sweep_run(sweep, "seed=1", False, _results(0.8, 0.6, False, 40), 10)
    _sweep_run(sweep, "seed=2", False, None, 3)
    stopped_early = {"complete": False, "clean_accuracy": 0.7, "lipschitz": {
        "points": 8, "interrupted": "local Lipschitz stopped by SIGTERM after 8 points", "complete": False}}
    _sweep_run(sweep, "seed=3", False, stopped_early, 10,  # its fit-stage values must not stand in for its test's
               fit_values={"robust/pgd_L2_0.5": 0.99, "lipschitz/local_mean": 5.0})
    out = tmp_path / "results"
    assert report.main([str(sweep), "--out", str(out / "finished")]) == 0
    row = table_rows((out / "finished" / "report.md").read_text())["(base)"]
    assert row["seeds"] == "1" and row["clean acc"] == "0.9" and "unfinished" not in row

    assert report.main([str(sweep), "--out", str(out / "all"), "--unfinished"]) == 0
    text = (out / "all" / "report.md").read_text()
    row = table_rows(text)["(base)"]
    assert row["seeds"] == "3" and row["unfinished"] == "2/3"
    assert row["clean acc"] == f"{0.8:.3g} ± {statistics.stdev([0.9, 0.8, 0.7]):.2g}"
    assert row["pgd_L2_0.5"] == f"{0.7:.3g} ± {statistics.stdev([0.8, 0.6]):.2g} (2/3)"  # not seed 3's 0.99 of fit
    assert "Lip local mean" not in row  # seed 3's only Lipschitz value is from fit
    assert "test-set values" in text
    section = text[text.index("## Unfinished runs"):]
    assert "`seed=1`: autoattack_L2_0.5 stopped by SIGTERM after 40 points" in section
    assert "autoattack_L2_0.5 on 40 points" in section
    assert "`seed=2`: training, 3 of 10 epochs, validation accuracy 0.530; not in the table" in section
    assert "`seed=3`: local Lipschitz stopped by SIGTERM after 8 points" in section
    assert "`seed=0`" not in section

    only_training = tmp_path / "training"
    _sweep_run(only_training, "seed=2", False, None, 3)
    assert report.main([str(only_training), "--out", str(out / "none"), "--unfinished"]) == 2
    assert "1 still training" in capsys.readouterr().err


def test_a_worst_case_is_averaged_over_runs_that_ran_the_same_attacks(tmp_path):
    """Seed 0 ran PGD and AutoAttack at ℓ2 0.5, seed 1 PGD alone: their worst cases are not the same quantity, so the
    worst-case cell is seed 0's, marked 1 of 2 runs, as is the AutoAttack cell; PGD averages both."""
    sweep = tmp_path / "sweep"
    for seed, (pgd, autoattack) in enumerate([(0.8, 0.5), (0.6, None)]):
        results = _results(0.9, pgd, True, 100)
        robustness = results["robustness"]
        if autoattack is None:
            del robustness["attacks"]["autoattack_L2_0.5"]
            robustness["accuracy"]["worst_L2_0.5"] = pgd
        else:
            robustness["accuracy"].update({"autoattack_L2_0.5": autoattack, "worst_L2_0.5": autoattack})
        _sweep_run(sweep, f"seed={seed}", True, results, 10)
    assert report.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    row = table_rows((tmp_path / "out" / "report.md").read_text())["(base)"]
    assert row["worst_L2_0.5"] == "0.5 (1/2)" and row["autoattack_L2_0.5"] == "0.5 (1/2)"
    assert row["pgd_L2_0.5"] == f"{0.7:.3g} ± {statistics.stdev([0.8, 0.6]):.2g}"


def test_a_table_whose_runs_measured_the_local_norm_differently_says_so():
    """results.json's ``local_method`` (absent: power iteration, as before it existed); runs without tested Lipschitz
    values do not count."""
    def run(lipschitz):
        return RunRecord(Path("run"), {}, "completed", {}, {}, results={"clean_accuracy": 0.9, "lipschitz": lipschitz})

    exact, older, untested = run({"local_mean": 2.0, "local_method": "exact"}), run({"local_mean": 1.9}), run({})
    assert (exact.local_method, older.local_method, untested.local_method) == ("exact", "power", None)
    (note, _) = report.local_methods_note([exact, older, exact, untested])
    assert note.startswith("`Lip local` mixes methods: the exact norm in 2 runs, power iteration in 1 run")
    assert report.local_methods_note([exact, exact, untested]) == []
