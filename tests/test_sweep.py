"""`stability sweep`: grid expansion, emitted commands, resume after a kill, diverged and failed runs,
and every shipped sweep file."""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from stability import exit_codes
from stability.sweep import Spec, Sweep, load_spec
from stability.sweep import main as sweep_main
from stability.sweep.runner import child_environment, usable_cores


def cli(**overrides) -> argparse.Namespace:
    defaults = {"name": None, "config": None, "set": None, "grid": None, "seeds": None}
    return argparse.Namespace(**{**defaults, **overrides})


def test_grid_expansion_crosses_variants_own_grids_shared_grid_and_seeds():
    spec = Spec.from_dict({
        "name": "s", "seeds": [0, 1],
        "variants": [{"stabilizer": "none"},
                     {"stabilizer": "jasmin", "grid": {"jasmin.lam": ["1e-2", "1e-3"], "jasmin.k": [0, 10]}}],
        "grid": {"model.lr": [0.001, 0.01]}})
    runs = spec.runs()
    assert len(runs) == (1 + 4) * 2 * 2
    assert runs[0].name == "stabilizer=none,model.lr=0.001,seed=0"
    assert runs[1].name == "stabilizer=none,model.lr=0.001,seed=1"
    assert runs[4].overrides == (("stabilizer", "jasmin"), ("jasmin.lam", "1e-2"), ("jasmin.k", 0), ("model.lr", 0.001))
    assert len({r.name for r in runs}) == len(runs)
    assert {r.configuration for r in runs if r.overrides[0][1] == "jasmin"} == {
        f"stabilizer=jasmin, jasmin.lam={lam}, jasmin.k={k}, model.lr={lr}"
        for lam in ("1e-2", "1e-3") for k in (0, 10) for lr in (0.001, 0.01)}


def test_a_variant_can_have_its_own_seeds_and_evaluation_args(tmp_path):
    spec = Spec.from_dict({"name": "s", "seeds": [0, 1, 2], "args": {"trainer.max_epochs": 2},
                           "variants": [{"stabilizer": "none", "args": {"robustness.autoattack_num_points": 500}},
                                        {"stabilizer": "jasmin", "seeds": [0]}]})
    runs = spec.runs()
    assert [(dict(r.overrides)["stabilizer"], r.seed) for r in runs] == [("none", 0), ("none", 1), ("none", 2),
                                                                         ("jasmin", 0)]
    assert runs[0].name == "stabilizer=none,seed=0" and runs[0].configuration == "stabilizer=none"
    command = spec.command(runs[0], tmp_path)
    assert "--robustness.autoattack_num_points=500" in command and "--trainer.max_epochs=2" in command
    assert not any("autoattack_num_points" in c for c in spec.command(runs[3], tmp_path))


def test_duplicate_configurations_run_once_and_long_names_stay_unique():
    spec = Spec.from_dict({"name": "s", "variants": [{"a": 1}, {"a": 1}, {"b": "x" * 200}, {"b": "x" * 199}]})
    names = [r.name for r in spec.runs()]
    assert len(names) == 3 and all(len(n) <= 120 for n in names) and len(set(names)) == 3


def test_a_variant_with_its_own_config_files_runs_them_in_place_of_the_sweeps(tmp_path):
    """Another architecture beside the base one (the convolutional anchor beside the certified transformer): the
    variant's config files replace the sweep's in its command, and its name says which."""
    anchor_config = ["configs/lipcnn_mnist.yaml", "configs/stabilizer/gloro_mnist.yaml"]
    spec = Spec.from_dict({"name": "s", "config": ["configs/vit_mnist.yaml"],
                           "variants": [{}, {"config": anchor_config, "trainer.max_epochs": 2}]})
    base, anchor = spec.runs()
    assert base.name == "seed=0" and anchor.name.startswith("config=lipcnn_mnist+gloro_mnist,trainer.max_epochs=2")
    assert anchor.configuration.startswith("config=lipcnn_mnist+gloro_mnist")
    cmd = spec.command(anchor, tmp_path / "r")
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"] == ["configs/lipcnn_mnist.yaml",
                                                                         "configs/stabilizer/gloro_mnist.yaml"]
    assert [a for a in spec.command(base, tmp_path / "b") if a.endswith(".yaml")] == ["configs/vit_mnist.yaml"]


def test_command_line_form_and_overrides(tmp_path):
    spec = load_spec(None, cli(name="lr", config=["configs/vit_digits.yaml"], seeds="3,4",
                               grid=["model.lr=1e-3,0.01", "stabilizer=[lipsformer,jasmin],none"],
                               set=["trainer.max_epochs=2", "model.backbone_options={embed_dim: 16}"]))
    assert [dict(r.overrides)["stabilizer"] for r in spec.runs()][:4] == [["lipsformer", "jasmin"]] * 2 + ["none"] * 2
    assert [r.seed for r in spec.runs()][:2] == [3, 4] and len(spec.runs()) == 8
    cmd = spec.command(spec.runs()[0], tmp_path / "r")
    assert cmd[:4] == [sys.executable, "-m", "stability", "fit"] and cmd[4:6] == ["--config", "configs/vit_digits.yaml"]
    assert "--trainer.max_epochs=2" in cmd and '--model.backbone_options={"embed_dim": 16}' in cmd
    assert "--model.lr=1e-3" in cmd and '--stabilizer=["lipsformer", "jasmin"]' in cmd
    assert "--seed_everything=3" in cmd and f"--run_dir={tmp_path / 'r'}" in cmd


@pytest.mark.parametrize("raw, message", [
    ({"variants": []}, "give the sweep a name"),
    ({"name": "s", "grids": {}}, "unknown keys \\['grids'\\]"),
    ({"name": "s", "grid": {"model.lr": []}}, "must be a non-empty list"),
    ({"name": "s", "seeds": []}, "seeds must not be empty"),
])
def test_bad_sweep_files_say_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        Spec.from_dict(raw)


def test_bad_only_names_the_valid_runs(tmp_path, capsys):
    assert sweep_main(["--name", "s", "--seeds", "0", "--only", "nope", "--sweeps_dir", str(tmp_path)]) == 2
    assert "valid: ['seed=0']" in capsys.readouterr().err


def test_emit_writes_one_command_per_run(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "s", "grid": {"model.lr": [0.001, 0.01]}, "seeds": [0, 1, 2]}))
    assert sweep_main([str(spec_file), "--sweeps_dir", str(tmp_path / "sw"), "--emit", "commands"]) == 0
    root = tmp_path / "sw" / "s"
    commands = (root / "commands.txt").read_text().splitlines()
    assert len(commands) == 6 and all(" sweep " in c and "--only 'model.lr=" in c for c in commands)
    assert yaml.safe_load((root / "sweep.yaml").read_text())["seeds"] == [0, 1, 2]
    assert not any(p.name.startswith("model.lr") for p in root.iterdir())  # nothing was run


def test_bad_submit_options_are_clear(tmp_path, capsys):
    assert sweep_main(["--name", "s", "--submit", "slurm", "--slurm_option", "account",
                       "--sweeps_dir", str(tmp_path)]) == 2
    assert "--slurm_option takes KEY=VALUE" in capsys.readouterr().err


def test_a_killed_sweep_reruns_only_what_did_not_finish_and_loses_nothing(tmp_path, scalars, sweep_file, run_sweep):
    spec = sweep_file(tmp_path, seeds=[0, 1, 2])
    root = tmp_path / "sweeps" / "tiny"
    first = subprocess.Popen([sys.executable, "-m", "stability", "sweep", str(spec), "--sweeps_dir", "sweeps"],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not (root / "stabilizer=none,seed=0" / "done.json").is_file():  # first run finished ...
        assert time.time() < deadline and first.poll() is None, "the first run did not finish"
        time.sleep(0.2)
    while not (root / "stabilizer=none,seed=1" / "sweep_run.json").is_file():  # ... and the second started
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # like a lost node: sweep and its run die at once
    first.wait()
    finished = root / "stabilizer=none,seed=0"
    kept = {p.name: p.stat().st_mtime_ns for p in finished.rglob("*")}
    assert not (root / "stabilizer=none,seed=1" / "done.json").exists()

    second = run_sweep(tmp_path, spec)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "[skip] stabilizer=none,seed=0: completed" in second.stdout
    assert "1 already complete, 2 to run" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in finished.rglob("*")} == kept  # untouched
    for seed in (0, 1, 2):
        run = root / f"stabilizer=none,seed={seed}"
        assert json.loads((run / "done.json").read_text())["status"] == "completed"
        assert len(scalars(run, "test/acc")) == 1  # exactly one fit and one test in each run
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["seed_everything"] == seed and saved["trainer"]["max_epochs"] == 1
    assert [p.name for p in (root / ".interrupted").iterdir()] == ["stabilizer=none,seed=1.0"]

    third = run_sweep(tmp_path, spec)  # everything complete: nothing runs again
    assert "3 already complete, 0 to run" in third.stdout and "[start]" not in third.stdout


def test_a_diverged_run_is_recorded_and_the_sweep_goes_on(tmp_path, sweep_file, run_sweep):
    diverging = {"stabilizer": "none", "model.optimizer": "sgd", "model.lr": 1.0e5}
    spec = sweep_file(tmp_path, seeds=[0], extra_variants=[diverging])
    done = run_sweep(tmp_path, spec, "--workers", "2")  # both runs at once
    assert done.returncode == 0, done.stdout[-3000:]
    root = tmp_path / "sweeps" / "tiny"
    diverging_run = root / "stabilizer=none,model.optimizer=sgd,model.lr=100000.0,seed=0"
    diverged = json.loads((diverging_run / "done.json").read_text())
    assert diverged["status"] == "diverged" and diverged["diverged_at_step"] >= 0 and "non-finite" in diverged["reason"]
    assert json.loads((root / "stabilizer=none,seed=0" / "done.json").read_text())["status"] == "completed"
    assert "1 completed, 1 diverged" in done.stdout
    shared = os.environ.get("OMP_NUM_THREADS", str(max(1, usable_cores() // 2)))  # 2 workers share the cores
    assert json.loads((diverging_run / "sweep_run.json").read_text())["OMP_NUM_THREADS"] == shared
    again = run_sweep(tmp_path, spec)
    assert "[skip] stabilizer=none,model.optimizer=sgd,model.lr=100000.0,seed=0: diverged" in again.stdout


def test_a_failing_run_is_reported_and_retried(tmp_path, sweep_file, run_sweep):
    spec = sweep_file(tmp_path, seeds=[0], extra_variants=[{"stabilizer": "no_such_stabilizer"}])
    done = run_sweep(tmp_path, spec)
    assert done.returncode == 1 and "[failed] stabilizer=no_such_stabilizer,seed=0: exit status 2" in done.stdout
    assert "no_such_stabilizer" in done.stdout  # the run's own error is shown
    again = run_sweep(tmp_path, spec)
    assert "[start] stabilizer=no_such_stabilizer,seed=0" in again.stdout
    assert "[start] stabilizer=none" not in again.stdout


SWEEP_FILES = sorted((Path(__file__).resolve().parent.parent / "configs" / "experiments").rglob("*.yaml"))


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_shipped_sweep_file_expands_and_each_variant_parses(path, capsys, monkeypatch):
    """The studies' sweep files (small and paper scale) cannot rot: the first run of every variant
    parses as a `stability fit` command line with its overrides in the resolved config."""
    from stability.cli import main

    root = next(parent for parent in path.parents if (parent / "pyproject.toml").is_file())
    monkeypatch.chdir(root)
    spec = Spec.from_dict(yaml.safe_load(path.read_text()), str(path))
    assert spec.runs() and spec.name.endswith(path.stem)
    for variant in spec.variants:
        run = Spec(spec.name, spec.config, spec.args, [variant], spec.grid, spec.seeds).runs()[0]
        with pytest.raises(SystemExit) as exit_info:
            main(spec.command(run, Path("unused"))[3:] + ["--print_config"])
        assert exit_info.value.code in (0, None), run.name
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["seed_everything"] == run.seed
        for key, value in run.overrides:  # every override reached the resolved config
            found = printed
            for part in key.split("."):
                found = found.get("init_args", found)[part] if part not in found else found[part]
            assert found == value or (isinstance(value, dict) and value.items() <= found.items()), (key, found)


RESUMABLE = {  # 3 epochs of 6 steps, with the randomness a resumed run must repeat (augmentation, dropout)
    "trainer.max_epochs": 3, "trainer.limit_train_batches": 6, "trainer.log_every_n_steps": 1,
    "trainer.enable_model_summary": False, "data.random_crop": 1,
    "model.backbone_options": {"embed_dim": 16, "depth": 1, "num_heads": 2, "drop_rate": 0.1},
    "lipschitz.every_n_epochs": 0, "robustness.every_n_epochs": 0, "test_after_fit": True}


def resumable_sweep(directory: Path) -> Path:
    path = directory / "resumable.yaml"
    path.write_text(yaml.safe_dump({"name": "resumable", "args": RESUMABLE, "seeds": [0]}, sort_keys=False))
    return path


def logged(run: Path, scalars) -> dict[str, list]:
    return {tag: scalars(run, tag) for tag in ("train/loss_step", "val/loss", "val/acc", "test/acc")}


def test_an_interrupted_run_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(tmp_path, run_sweep,
                                                                                       scalars):
    spec = resumable_sweep(tmp_path)
    whole = tmp_path / "whole"
    whole.mkdir()
    assert run_sweep(whole, spec).returncode == 0
    first = subprocess.Popen([sys.executable, "-m", "stability", "sweep", str(spec), "--sweeps_dir", "sweeps"],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = tmp_path / "sweeps" / "resumable" / "seed=0"
    deadline = time.time() + 300
    while not (run / "checkpoints" / "last.ckpt").is_file():  # the first epoch is saved ...
        assert time.time() < deadline and first.poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    time.sleep(0.5)  # ... and the second is under way
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert not (run / "done.json").exists()

    second = run_sweep(tmp_path, spec)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "[resume] seed=0" in second.stdout
    assert json.loads((run / "sweep_run.json").read_text())["resumed"]
    reference = logged(whole / "sweeps" / "resumable" / "seed=0", scalars)
    assert logged(run, scalars) == reference  # every logged step and value, including the test after fit
    assert len(reference["train/loss_step"]) == 18 and len(reference["test/acc"]) == 1


def sweeping_past_a_checkpoint(directory: Path, spec: Path) -> tuple[subprocess.Popen, Path]:
    """The sweep ``spec`` started in the background, once its run has written its first checkpoint."""
    sweep = subprocess.Popen([sys.executable, "-m", "stability", "sweep", str(spec), "--sweeps_dir", "sweeps"],
                             cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    run = directory / "sweeps" / "resumable" / "seed=0"
    deadline = time.time() + 300
    while not (run / "checkpoints" / "last.ckpt").is_file():
        assert time.time() < deadline and sweep.poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    return sweep, run


def test_a_run_stopped_by_sigterm_is_not_complete_and_the_sweep_resumes_it(tmp_path, run_sweep):
    """Lightning ends a fit on SIGTERM with SystemExit(None), status 0; a sweep took that for a complete run and
    never ran the rest. ``stability fit`` now exits with 143 and the sweep keeps the run pending."""
    spec = resumable_sweep(tmp_path)
    sweep, run = sweeping_past_a_checkpoint(tmp_path, spec)
    fit = subprocess.run(["pgrep", "-P", str(sweep.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(fit[0]), signal.SIGTERM)  # the run alone, as a scheduler or a user might
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 1, output
    assert "[interrupted] seed=0: stopped by SIGTERM" in output and "[completed]" not in output
    assert "stopped by SIGTERM before the run ended" in (run / "run.log").read_text()
    assert not (run / "done.json").exists()
    second = run_sweep(tmp_path, spec)
    assert second.returncode == 0 and "[resume] seed=0" in second.stdout, second.stdout[-3000:]
    assert json.loads((run / "done.json").read_text())["status"] == "completed"


def test_a_sigterm_to_the_sweep_stops_its_fits_at_once(tmp_path):
    """SIGTERM to the sweep itself (a scheduler's preemption, ``kill``) stops its running fit and the sweep within
    seconds, the run kept pending. The sweep used to wait for the fit to end on its own (the thread pool's exit
    waited for its workers before the fits were told to stop)."""
    spec = resumable_sweep(tmp_path)
    sweep, run = sweeping_past_a_checkpoint(tmp_path, spec)
    stopped = time.time()
    sweep.send_signal(signal.SIGTERM)
    output, _ = sweep.communicate(timeout=120)
    assert time.time() - stopped < 60, output
    assert sweep.returncode != 0 and "[completed]" not in output, output
    assert "stopped by SIGTERM before the run ended" in (run / "run.log").read_text()
    assert not (run / "done.json").exists()


@pytest.mark.parametrize("code, status", [(0, "completed"), (exit_codes.DIVERGED, "diverged"),
                                          (exit_codes.INTERRUPTED, "interrupted"), (-signal.SIGTERM, "interrupted")])
def test_a_run_that_ends_as_the_sweep_is_stopped_is_recorded_as_it_ended(tmp_path, monkeypatch, code, status):
    """The sweep's SIGTERM arrives while a fit ends: a fit that exits 0 (its test done) or DIVERGED has ended and gets
    its done.json; one stopped (INTERRUPTED, or killed by the signal) stays pending. A finished run was left pending,
    and the next sweep tested it again from the start (an official AutoAttack of 80 minutes, for nothing)."""
    spec = Spec.from_dict({"name": "racing", "args": {}, "seeds": [0]})
    sweep = Sweep(spec, str(tmp_path / "sweeps"))
    (run,) = spec.runs()

    def command(run, run_dir):  # the stop comes while the fit ends (after it started: else it is not started)
        threading.Timer(0.3, setattr, (sweep, "_stopping", True)).start()
        return [sys.executable, "-c", f"import os, time; time.sleep(1.5); os.kill(os.getpid(), {-code}) if {code} < 0 "
                                      f"else None; raise SystemExit({max(code, 0)})"]

    monkeypatch.setattr(spec, "command", command)
    assert sweep._execute_one(run) == status
    done = sweep.run_dir(run) / "done.json"
    assert (json.loads(done.read_text())["status"] if done.is_file() else "interrupted") == status


def test_fit_ckpt_path_last_continues_the_newest_version(tmp_path, tiny_vit_args, scalars):
    from stability.cli import main

    os.chdir(tmp_path)
    common = [*tiny_vit_args, "--trainer.limit_train_batches", "4", "--lipschitz.every_n_epochs", "0",
              "--robustness.every_n_epochs", "0", "--trainer.log_every_n_steps", "1"]
    main(["fit", *common, "--trainer.max_epochs", "1"])
    main(["fit", *common, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    runs = tmp_path / "runs" / "digits" / "vit" / "none"
    assert [p.name for p in runs.iterdir()] == ["version_0"]  # continued, not a new version
    assert len(scalars(runs / "version_0", "train/loss_step")) == 8  # 4 steps in each epoch, none twice
    with pytest.raises(SystemExit):
        main(["fit", *common, "--runs_dir", "elsewhere", "--ckpt_path", "last"])


def test_submitit_local_jobs_run_the_sweep_and_a_preempted_job_resumes(tmp_path):
    import submitit

    from stability.sweep.submit import submit

    spec = Spec.from_dict({"name": "submitted", "args": RESUMABLE, "seeds": [0, 1]})
    sweep = Sweep(spec, str(tmp_path / "sweeps"))
    jobs = submit(sweep, spec.runs(), "local", str(tmp_path / "sweeps"), timeout_min=10)
    assert len(jobs) == 2 and all(isinstance(job, submitit.local.local.LocalJob) for job in jobs)
    run = tmp_path / "sweeps" / "submitted" / "seed=0"
    deadline = time.time() + 300
    while not (run / "checkpoints" / "last.ckpt").is_file():
        assert time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    task = subprocess.run(["pgrep", "-P", str(jobs[0]._process.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(task[0]), signal.SIGUSR2)  # preemption: submitit calls RunJob.checkpoint and requeues the job
    assert [job.result() for job in jobs] == ["completed"] * 2
    assert json.loads((run / "done.json").read_text())["status"] == "completed"
    assert json.loads((run / "sweep_run.json").read_text())["resumed"]
    assert json.loads((tmp_path / "sweeps" / "submitted" / "seed=1" / "done.json").read_text())["status"] == \
        "completed"


def test_workers_without_devices_give_each_run_one_visible_gpu(monkeypatch):
    """Lightning's devices default is 1 here, so a run takes GPU 0 unless told otherwise: --workers without
    --devices spreads the runs over the visible GPUs, one GPU each (CUDA_VISIBLE_DEVICES of each run)."""
    from stability.sweep.runner import shared_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert shared_gpus(3) == ["3", "5", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert shared_gpus(2) == []  # no GPU: the runs share the CPU cores


def test_each_run_gets_its_share_of_the_cores_with_or_without_a_gpu():
    """K runs on one GPU machine: each its device and 1/K of the cores (they oversubscribed the cores before); a
    setting the user gave is kept; one run alone keeps torch's default."""
    cores = usable_cores()
    on_gpu = child_environment({}, "0", 4)
    assert on_gpu == {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": str(max(1, cores // 4))}
    assert child_environment({}, None, 2)["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert child_environment({"OMP_NUM_THREADS": "3"}, "1", 4)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in child_environment({}, "0", 1)
