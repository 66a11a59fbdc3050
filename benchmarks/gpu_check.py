"""One command that proves the suite on a GPU.

    python benchmarks/gpu_check.py --quick                # budgets of 525 s in all: run this first
    python benchmarks/gpu_check.py                        # every section, in full
    python benchmarks/gpu_check.py --sections runs,compare   # some of them (the others keep their last results)

Sections:

* ``tests``: the tests marked ``gpu`` (``pytest -m gpu``): no synchronisation inside a training step of any
  stabilizer (CUDA's own sync check), GPU against CPU for every stabilizer and backbone, measurements against
  the CPU under fp32 and bf16-mixed.
* ``runs``: every registered stabilizer (with what it needs, and the compositions the tests train) on every
  backbone it applies to, ``stability fit`` in bf16-mixed on one GPU with the test-time measurements (FGSM, PGD,
  official AutoAttack, certified accuracy where a bound exists). Each must exit 0 with a finite training loss and a
  ``results.json`` in which every robust accuracy is at most the clean accuracy of the same points, and certified at
  most clean.
* ``compare``: each stabilizer's loss terms, gradients, one optimizer step with its projection and the measurements
  after it, the same weights and batch in float32 (TF32 off) on the GPU and on the CPU, compared as
  ``stability/testing/parity.py`` defines (every key with both values and its tolerance).
* ``benchmarks``: ``step_cost.py`` at batch 256 in fp32 and bf16 (ViT-S, Swin-T, CSwin-T, 64 and 256 tokens;
  memory after a warm-up step) and ``measurement_cost.py`` at batch 256 against an fp32 and a bf16 training step.
* ``ddp`` (two GPUs or more): ``stability test`` of one checkpoint on one process and on two.

``--quick`` runs each section small, inside a time budget of its own (``QUICK_BUDGET_S``, 525 s in all: each
section's own time and FlexAttention's compilation where softcap trains; set from the H200 run of 2026-11-27,
README "On a GPU"): the ``gpu`` tests but the GPU–CPU comparison, which ``compare`` runs on every ViT case instead, on 8
images; one 1-epoch bf16-mixed fit of every stabilizer and composition on ViT, with measurements sized to prove the GPU
path rather than to measure (one ℓ∞ and one ℓ2 budget, few points, the official AutoAttack on 4 points of two fits);
the step-cost rows of ViT-S at 256 tokens, batch 256, bf16. Fits and cases are reported as each ends, a fit with the
seconds of each of its phases (read from its log: the monitors write a line as a measurement starts and as it ends).
A section that runs out of its budget stops and says how far it got: "cut at its budget" (a fit names the phase it was
in), which is not a failure of the suite (exit status 3 when nothing failed), as opposed to FAILED (1).

Results go to ``results/benchmarks/gpu_check_<device>.md`` (and ``.json``, which keeps each section's last
result so that sections can run in separate calls), with the device, the commands and the times; both are rewritten
after every fit, case and section, so a run cut short leaves what it finished. Without a CUDA GPU the script prints
one line and exits with status 2; with a failed check, status 1; with every check that ran passed but a section cut
at its budget, status 3.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stability.sweep.runner import child_environment  # noqa: E402

SECTIONS = ("tests", "runs", "compare", "benchmarks", "ddp")
COMPOSITIONS = ["lipsformer,jasmin", "lipschitz_transformer,muon", "lipschitz_transformer,muon,lipschitz_margin"]
BACKBONES = ("vit", "swin", "cswin")  # each at its micro preset, on 16 × 16 digits
DEVICE = "cuda"  # "cpu" for --cpu_dry_run
SELECTED: set[tuple[str, str]] | None = None  # --cases
SIZES = {"epochs": 2, "attack_points": 256, "autoattack_points": 32}  # of the runs (options of the same names)
QUICK_SIZES = {"epochs": 1, "attack_points": 64, "autoattack_points": 4}
QUICK_AUTOATTACK = {"none", "lipschitz_transformer,muon"}  # the quick runs that also run the official AutoAttack
# --quick: each section's own time (results/benchmarks/README.md), plus the compilation of FlexAttention where the
# section trains softcap on CUDA (its fused path compiles a forward and a backward kernel per shape: tens of seconds
# that are the compiler's, not the suite's)
QUICK_RUN_S = {"tests": 120, "runs": 90, "compare": 90, "benchmarks": 45}
FLEX_COMPILE_S = {"tests": 60, "runs": 60, "benchmarks": 60}
QUICK_BUDGET_S = {s: t + FLEX_COMPILE_S.get(s, 0) for s, t in QUICK_RUN_S.items()}  # 525 s in all
QUICK = False
STATE: dict = {}  # every section's last result, as written to the .json
REPORT: tuple | None = None  # (out, device description, gpus): where and how the report is rewritten
LINGERING: list[threading.Thread] = []  # comparison cases cut at the budget, still running (a thread cannot be killed)
LINGER_S = 600  # how long the next section, or the exit, waits for them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every section small, each inside its time budget "
                                                             f"({sum(QUICK_BUDGET_S.values())} s in all)")
    parser.add_argument("--sections", default=None, help=f"comma-separated, from {SECTIONS} (default: all; --quick: "
                                                         f"{','.join(QUICK_BUDGET_S)})")
    parser.add_argument("--cases", default=None, help="only these STABILIZERS:BACKBONE (comma-separated, + between "
                                                      "stabilizers), e.g. none:vit,muon:swin")
    parser.add_argument("--workers", type=int, default=None, help="fits run at once on the GPU (section runs; "
                                                                  "default 4, --quick 8)")
    for option, value in SIZES.items():
        parser.add_argument(f"--{option}", type=int, default=None,
                            help=f"of each fit (section runs; default {value}, --quick {QUICK_SIZES[option]})")
    parser.add_argument("--budget_scale", type=float, default=1.0,
                        help="--quick: multiply every section's budget (0: no budgets, to time the sections)")
    parser.add_argument("--out", default=None, help="default results/benchmarks/gpu_check_<device>.md")
    parser.add_argument("--cpu_dry_run", action="store_true",
                        help="run the sections on the CPU against itself: tests this script without a GPU, proves "
                             "nothing about one (its fits: 8 training batches an epoch, in float32)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check")
        raise SystemExit(2)
    sections = [s for s in (args.sections or ",".join(QUICK_BUDGET_S if args.quick else SECTIONS)).split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown section(s) {unknown}; choose from {SECTIONS}")
    global DEVICE, SELECTED, QUICK, REPORT
    DEVICE = "cpu" if args.cpu_dry_run else "cuda"
    QUICK = args.quick
    SIZES.update({option: getattr(args, option) if getattr(args, option) is not None else
                  (QUICK_SIZES if QUICK else SIZES)[option] for option in SIZES})
    workers = args.workers or (8 if QUICK else 4)
    SELECTED = None if args.cases is None else {tuple(c.replace("+", ",").split(":")) for c in args.cases.split(",")}
    device_name = "cpu dry run" if args.cpu_dry_run else torch.cuda.get_device_name(0)
    out = Path(args.out) if args.out else ROOT / "results" / "benchmarks" / f"gpu_check_{slug(device_name)}.md"
    state_path = out.with_suffix(".json")
    STATE.update(json.loads(state_path.read_text()) if state_path.is_file() else {})
    from stability.machine import describe

    REPORT = (out, describe(DEVICE), torch.cuda.device_count())
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/gpu_check.py", *sys.argv[1:]])
    for section in sections:
        wait_for_cut_cases()  # a cut case's thread would share the CPU and the GPU with this section's timings
        started = time.time()
        budget = QUICK_BUDGET_S.get(section, 0) * args.budget_scale if QUICK and args.budget_scale > 0 else None
        deadline = None if budget is None else started + budget
        print(f"gpu_check: {section} …" + (f" (budget {budget} s)" if budget else ""), flush=True)
        STATE[section] = {"passed": False, "running": True, "command": command, "quick": QUICK, "budget": budget,
                          "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": 0.0}
        run = {"tests": run_gpu_tests, "runs": lambda d: run_fits(workers, d), "compare": compare_with_cpu,
               "benchmarks": lambda d: run_benchmarks(device_name, d), "ddp": lambda d: compare_processes()}[section]
        result = run(deadline)
        result.update(seconds=round(time.time() - started, 1), command=command, quick=QUICK, budget=budget,
                      date=time.strftime("%Y-%m-%d %H:%M"))
        result.pop("running", None)
        STATE[section] = result
        save(state_path)
        print(f"gpu_check: {section}: {verdict(result)} ({result['seconds']:.0f} s"
              + (f" of {budget} s" if budget else "") + ")", flush=True)
    print(out.read_text())
    print(f"wrote {out}")
    status = 1 if not all(s["passed"] for s in STATE.values()) else \
        3 if any(s.get("cut") for s in STATE.values()) else 0
    if not wait_for_cut_cases():  # a thread still inside torch at interpreter shutdown can crash it: leave now
        sys.stdout.flush()
        os._exit(status)
    raise SystemExit(status)


def wait_for_cut_cases() -> bool:
    """Wait (up to LINGER_S) for comparison cases cut at their section's budget to end; False if one still runs."""
    for thread in list(LINGERING):
        if thread.is_alive():
            print(f"gpu_check: waiting for a comparison case cut at its budget to end (at most {LINGER_S} s) …",
                  flush=True)
            thread.join(LINGER_S)
        if not thread.is_alive():
            LINGERING.remove(thread)
    return not LINGERING


def verdict(section: dict) -> str:
    """FAILED (a check failed), cut at its budget (every check that ran passed, some did not run), or passed."""
    if section.get("running"):
        return "RUNNING (or cut short)"
    if not section["passed"]:
        return "FAILED"
    return "cut at its budget (not a failure: what ran passed)" if section.get("cut") else "passed"


def summarise(rows: list[dict]) -> dict:
    """A section's verdict from its rows: each passed (True), failed (False) or cut at the budget (None)."""
    return {"passed": all(r["passed"] is not False for r in rows), "cut": any(r["passed"] is None for r in rows),
            "rows": rows}


def save(state_path: Path | None = None) -> None:
    """Rewrite the .json and the report from STATE (after every fit, case and section: a run cut short keeps them)."""
    out, device, gpus = REPORT
    state_path = state_path or out.with_suffix(".json")
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(STATE, indent=1) + "\n")
    out.write_text(render(STATE, device, gpus))


def progress(section: str, **fields) -> None:
    """Record a section's partial result and rewrite the report."""
    STATE[section].update(fields)
    save()


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.time())


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cases() -> list[tuple[str, str]]:
    """(stabilizers, backbone) for every registered stabilizer with what it needs, and the tested compositions
    (--quick: on ViT)."""
    from stability.stabilizers import REGISTRY

    names = [",".join([*REGISTRY[n].needs, n]) for n in REGISTRY] + COMPOSITIONS
    backbones = ("vit",) if QUICK else BACKBONES
    every = [(s, b) for s in names for b in backbones if all(b in REGISTRY[n].backbones for n in s.split(","))]
    if not QUICK:  # the convolutional anchor, with the stabilizers that apply to it (the losses alone: it certifies)
        every += [(n, "lipcnn") for n, cls in REGISTRY.items() if "lipcnn" in cls.backbones]
    return every if SELECTED is None else [case for case in every if case in SELECTED]


# ------------------------------------------------------------------------------------------------- tests
COMPARE_TEST = "losses_projections_and_measurements_match_the_cpu"  # --quick: the compare section runs it instead


def run_gpu_tests(deadline: float | None) -> dict:
    """``pytest -m gpu`` verbosely, so that a run cut at its budget still says which tests passed and failed."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-v", "-p", "no:cacheprovider", "tests"]
    if QUICK:
        command[-1:-1] = ["-k", f"not {COMPARE_TEST}"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=remaining(deadline))
        stdout, returncode, cut = done.stdout, done.returncode, False
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or b""
        stdout, returncode, cut = out.decode(errors="replace") if isinstance(out, bytes) else out, 1, True
    outcomes = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", stdout, flags=re.MULTILINE)
    failures = [f"{outcome} {test}" for test, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    errors = [line for line in stdout.splitlines() if line.startswith("E  ")]
    counts = {o: sum(1 for _, x in outcomes if x == o) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    summary = ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n) or "no test ran"
    if cut:
        summary = f"cut at its budget after {len(outcomes)} tests: {summary}"
    # a cut run failed if a test that ran failed, or if none finished (a hang in the first test is no budget matter)
    passed = bool(outcomes) and not failures if cut else returncode == 0
    return {"passed": passed, "cut": cut, "summary": summary, "failures": failures[:40], "errors": errors[:40],
            "pytest": "python " + " ".join(command[1:])}


# -------------------------------------------------------------------------------------------------- runs
# --quick: measurements sized to prove the GPU path (each code path once, on few points), not to measure robustness
QUICK_MEASUREMENTS = ["--lipschitz.num_points", "16", "--lipschitz.test_num_points", "32",
                      "--lipschitz.attention_points", "4", "--lipschitz.pair_points", "8",
                      "--robustness.num_points", "64", "--robustness.eps", "[0.00784313725490196]",
                      "--robustness.l2_eps", "[0.5]"]  # one budget each: ℓ∞ 2/255, ℓ2 0.5


def fit_command(stabilizer: str, backbone: str, run_dir: Path) -> list[str]:
    accelerator = "gpu" if DEVICE == "cuda" else "cpu"
    attacks = "[fgsm, pgd, autoattack]" if not QUICK or stabilizer in QUICK_AUTOATTACK else "[fgsm, pgd]"
    command = [sys.executable, "-m", "stability", "fit", "--stabilizer", stabilizer, "--model.backbone", backbone,
               "--data.image_size", "16", "--trainer.max_epochs", str(SIZES["epochs"]),
               "--trainer.precision", "bf16-mixed" if DEVICE == "cuda" else "32-true",  # a CPU's bf16 is slow
               "--trainer.accelerator", accelerator, "--trainer.devices", "1",
               "--trainer.enable_progress_bar", "false", "--timing.enabled", "true",
               "--run_dir", str(run_dir), "--test_after_fit", "true",
               "--robustness.test_attacks", attacks,
               "--robustness.attack_num_points", str(SIZES["attack_points"]),
               "--robustness.autoattack_num_points", str(SIZES["autoattack_points"])]
    dry_run = ["--trainer.limit_train_batches", "8", "--trainer.limit_val_batches", "2"] if DEVICE == "cpu" else []
    return command + dry_run + (QUICK_MEASUREMENTS if QUICK else ["--lipschitz.test_num_points", "128",
                                                                  "--lipschitz.attention_points", "8"])


MEASUREMENT_START = re.compile(r"^(\w[\w ]*) \((fit|test)\): (.+) on \d+ points …$")
MEASUREMENT_END = re.compile(r"^(\w[\w ]*) \((fit|test)\): (.+) on \d+ points in ")
FIT_END = "`Trainer.fit` stopped"
TRAINING = "start-up, training and validation"


class Phases:
    """The phases of one fit, read from its log as it runs: start-up with training and validation, then each
    measurement (from the line a monitor writes as it starts one to the line it writes as it ends it), the test's
    own forward passes between them. ``seconds`` sums each phase's time; ``current`` is what runs now."""

    def __init__(self) -> None:
        self.current, self.since = TRAINING, time.time()
        self.seconds: dict[str, float] = {}
        self.fit_done = False

    def enter(self, phase: str) -> None:
        now = time.time()
        self.seconds[self.current] = round(self.seconds.get(self.current, 0.0) + now - self.since, 1)
        self.current, self.since = phase, now

    def read(self, line: str) -> None:
        line = line.strip()
        if match := MEASUREMENT_START.match(line):
            self.enter(f"{match[1]} ({match[2]}): {match[3]}")
        elif MEASUREMENT_END.match(line):
            self.enter("test: evaluation between measurements" if self.fit_done else TRAINING)
        elif line.startswith(FIT_END):
            self.fit_done = True
            self.enter("test: evaluation between measurements")

    def close(self) -> dict[str, float]:
        self.enter("")
        return {phase: seconds for phase, seconds in self.seconds.items() if phase}


def run_fit(command: list[str], timeout: float | None, workers: int = 1) -> tuple[int | None, str, Phases]:
    """Run one fit, reading its log as it comes: (exit status or None when cut at ``timeout``, the log's last lines,
    its phases). With ``workers`` fits at once each gets its share of the CPU cores, as a sweep's runs do."""
    phases = Phases()
    env = child_environment(dict(os.environ), None, workers)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1, env=env)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        process.kill()

    timer = None if timeout is None else threading.Timer(timeout, kill)
    if timer is not None:
        timer.start()
    tail: list[str] = []
    try:
        for line in process.stdout:
            phases.read(line)
            tail = (tail + [line.rstrip()])[-40:]
        process.wait()
    finally:
        if timer is not None:
            timer.cancel()
    return (None if killed.is_set() else process.returncode), "\n".join(tail), phases


def run_fits(workers: int, deadline: float | None) -> dict:
    """Every case's fit, ``workers`` at a time; each row goes into the report the moment its fit ends (the
    fits that run longest are started first), with its phases' times; a fit cut at the budget names its phase."""
    root = ROOT / "runs" / "gpu_check"
    todo = sorted(cases(), key=lambda case: case[0] not in QUICK_AUTOATTACK)
    rows: list[dict] = []

    def one(case):
        stabilizer, backbone = case
        run_dir = root / f"{backbone}_{stabilizer.replace(',', '+')}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts clean
        started = time.time()
        left = remaining(deadline)
        if left is not None and left < 1:
            return {"stabilizers": stabilizer, "backbone": backbone, "seconds": 0.0, "exit": None, "passed": None,
                    "phases": {}, "problems": ["not started: the section's budget was spent"]}
        exit_code, tail, phases = run_fit(fit_command(stabilizer, backbone, run_dir), left, workers)
        seconds = time.time() - started
        if exit_code is None:
            current = phases.current
            return {"stabilizers": stabilizer, "backbone": backbone, "seconds": round(seconds, 1), "exit": None,
                    "passed": None, "phases": phases.close(),
                    "problems": [f"cut at the section's budget during {current}"]}
        return check_run(stabilizer, backbone, run_dir, exit_code, tail, seconds, phases.close())

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in as_completed([pool.submit(one, case) for case in todo]):  # each fit reported as it ends
            rows.append(future.result())
            progress("runs", rows=rows)
    return {**summarise(rows), "fit": " ".join(fit_command("<stabilizers>", "<backbone>", Path("<dir>"))[1:])}


def check_run(stabilizer: str, backbone: str, run_dir: Path, exit_code: int, log_tail: str, seconds: float,
              phases: dict[str, float]) -> dict:
    row = {"stabilizers": stabilizer, "backbone": backbone, "seconds": round(seconds, 1), "exit": exit_code,
           "phases": phases}
    problems = []
    if exit_code != 0:
        problems.append(f"exit {exit_code}: {log_tail.strip().splitlines()[-1:] or ''}")
    losses = training_losses(run_dir)
    if not losses or not all(math.isfinite(v) for v in losses):
        problems.append(f"training loss not finite or missing ({losses[-3:]})")
    results_file = next(run_dir.rglob("results.json"), None)
    if results_file is None:
        problems.append("no results.json")
    else:
        results = json.loads(results_file.read_text())
        robustness, accuracy = results["robustness"], results["robustness"]["accuracy"]
        row["clean"] = results["clean_accuracy"]
        # the clean accuracy of each prefix of points an attack ran on, and each attack's own points
        clean_of = {robustness["points"]: accuracy["clean"], robustness["attack_points"]: accuracy.get(
            "attack_clean", accuracy["clean"])}
        if robustness.get("autoattack_points"):
            clean_of[robustness["autoattack_points"]] = accuracy.get("autoattack_clean", accuracy["clean"])
        points = {label: info["points"] for label, info in robustness["attacks"].items()}
        for label, info in robustness["attacks"].items():
            budget = label[len(info["attack"]) + 1:]
            points.setdefault(f"worst_{budget}", info["points"])
            points[f"worst_{budget}"] = min(points[f"worst_{budget}"], info["points"])
        for label, count in points.items():
            if label in accuracy and accuracy[label] > clean_of[count] + 1e-9:
                problems.append(f"{label} {accuracy[label]:.3f} > clean {clean_of[count]:.3f} on its {count} points")
        robust = [accuracy[label] for label in points if label in accuracy]
        row["worst robust"] = min(robust) if robust else None
        certified = robustness["certified"]
        row["certified"] = max(certified.values()) if certified else None
        if certified and max(certified.values()) > accuracy["clean"] + 1e-9:
            problems.append("certified > clean")
        row["autoattack points"] = robustness["autoattack_points"]
    row["passed"], row["problems"] = not problems, problems
    return row


def training_losses(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    try:
        return [e.value for e in events.Scalars("train/loss_epoch")]
    except KeyError:
        return []


# ----------------------------------------------------------------------------------------------- compare
COMPARE_POINTS, COMPARE_POINTS_QUICK = 32, 8  # images per case (the CPU reference dominates the case's time)
def compare_with_cpu(deadline: float | None) -> dict:
    """stability/testing/parity.py on every case: the reference on the CPU against a copy on the device, float32, TF32
    off. Each case runs in a thread that the section stops waiting for at its deadline: a case cut there is
    reported with the phase it was in; its thread is left to end on its own, and the next section (or the exit) waits
    for it first, so that it shares no section's timings."""
    rows: list[dict] = []
    for stabilizer, backbone in cases():
        if remaining(deadline) == 0:
            rows.append({"stabilizers": stabilizer, "backbone": backbone, "passed": None, "keys": 0,
                         "worst": "not run: the section's budget was spent"})
            continue
        case: dict = {"phase": "building the model"}
        worker = threading.Thread(target=_compare_case, args=(stabilizer, backbone, case), daemon=True)
        worker.start()
        worker.join(remaining(deadline))
        if worker.is_alive():
            LINGERING.append(worker)
            rows.append({"stabilizers": stabilizer, "backbone": backbone, "passed": None, "keys": 0,
                         "worst": f"cut at the section's budget during {case['phase']}",
                         "seconds": round(time.time() - case.get("started", time.time()), 1)})
            progress("compare", rows=rows)
            continue  # every later case: "not run"
        if "error" in case:
            raise case["error"]
        rows.append(case["row"])
        progress("compare", rows=rows)
    return summarise(rows)


def _compare_case(stabilizer: str, backbone: str, case: dict) -> None:
    """One parity case; its phase, row or exception go into ``case``."""
    try:
        from stability.classifier import ImageClassifier
        from stability.models import without_dropout
        from stability.testing import parity

        case["started"] = time.time()
        torch.manual_seed(0)
        cpu = without_dropout(ImageClassifier(backbone=backbone, image_size=16, stabilizer=stabilizer).train())
        gen = torch.Generator().manual_seed(1)
        points = COMPARE_POINTS_QUICK if QUICK else COMPARE_POINTS
        images, labels = torch.rand(points, 1, 16, 16, generator=gen), torch.randint(0, 10, (points,), generator=gen)
        case["phase"] = "the training step (CPU reference, then the device)"
        differences, other = parity.compare_training_step(cpu, images, labels, DEVICE)
        case["phase"] = "the measurements on the CPU"
        reference = parity.measurements(cpu, images, labels)
        case["phase"] = "the measurements on the device"
        differences += parity.compare_measurements(reference, parity.measurements(other, images.to(DEVICE),
                                                                                  labels.to(DEVICE)))
        bad = parity.failures(differences)
        worst = max(differences, key=lambda d: d.difference / max(d.tolerance, 1e-300))
        case["row"] = {"stabilizers": stabilizer, "backbone": backbone, "passed": not bad, "keys": len(differences),
                       "worst": str(worst), "failures": [str(d) for d in bad[:10]],
                       "seconds": round(time.time() - case["started"], 1)}
    except BaseException as error:  # raised again in the section's thread
        case["error"] = error


# -------------------------------------------------------------------------------------------- benchmarks
def benchmark_commands(name: str) -> list[list[str]]:
    """The benchmark scripts' command lines; their tables go beside the report."""
    out = REPORT[0].parent
    folder = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    quick = ["--quick"] if DEVICE == "cpu" else []
    if QUICK:
        return [["benchmarks/step_cost.py", "--device", DEVICE, "--backbones", "vit:small", "--tokens", "256",
                 "--precision", "bf16", "--repeats", "3", *quick, "--out", f"{folder}/step_cost_{name}_quick.md"]]
    return [
        ["benchmarks/step_cost.py", "--device", DEVICE, "--backbones", "vit:small,swin:tiny,cswin:tiny",
         "--tokens", "64,256", "--precision", "fp32,bf16", "--repeats", "5", *quick,
         "--out", f"{folder}/step_cost_{name}.md"],
        *[["benchmarks/measurement_cost.py", "--device", DEVICE, "--batch", "256", "--precision", precision, *quick,
           "--out", f"{folder}/measurement_cost_{name}_{precision}.md"] for precision in ("fp32", "bf16")],
    ]


def run_benchmarks(device_name: str, deadline: float | None) -> dict:
    rows = []
    for command in benchmark_commands(slug(device_name)):
        started = time.time()
        try:
            done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True,
                                  timeout=remaining(deadline))
            exit_code, error = done.returncode, done.stderr.strip().splitlines()[-1:] if done.returncode else []
        except subprocess.TimeoutExpired:
            exit_code, error = None, ["cut at the section's budget"]
        rows.append({"command": "python " + " ".join(command), "exit": exit_code,
                     "seconds": round(time.time() - started, 1), "table": command[-1], "error": error,
                     "passed": None if exit_code is None else exit_code == 0})
        progress("benchmarks", rows=rows)
    return summarise(rows)


# --------------------------------------------------------------------------------------------------- ddp
def compare_processes() -> dict:
    if torch.cuda.device_count() < 2:
        return {"passed": True, "skipped": f"{torch.cuda.device_count()} GPU: needs two"}
    run_dir = ROOT / "runs" / "gpu_check" / "ddp"
    fit = [sys.executable, "-m", "stability", "fit", "--stabilizer", "lipsformer", "--trainer.max_epochs", "3",
           "--trainer.enable_progress_bar", "false", "--run_dir", str(run_dir), "--lipschitz.every_n_epochs", "0",
           "--robustness.every_n_epochs", "0"]
    subprocess.run(fit, cwd=ROOT, check=True, capture_output=True)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    measured = {}
    for processes in (1, 2):
        extra = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if processes == 2 else []
        subprocess.run([sys.executable, "-m", "stability", "test", "--ckpt_path", str(checkpoint),
                        "--trainer.enable_progress_bar", "false", "--robustness.test_attacks", "[fgsm, pgd]", *extra],
                       cwd=ROOT, check=True, capture_output=True)
        results = json.loads((checkpoint.parent / "results.json").read_text())
        measured[processes] = {"clean": results["clean_accuracy"], **results["robustness"]["accuracy"],
                               "local_max": results["lipschitz"]["local_max"]}
    points = 270
    differences = {k: abs(measured[2][k] - v) for k, v in measured[1].items()}
    passed = all(d <= (1e-3 * abs(measured[1][k]) if k == "local_max" else 1 / points + 1e-9)
                 for k, d in differences.items())
    return {"passed": passed, "one": measured[1], "two": measured[2]}


# ------------------------------------------------------------------------------------------------ report
def render(state: dict, device: str, gpus: int) -> str:
    lines = [f"# GPU check: {device}", "",
             f"{gpus} GPU(s). Each section below gives the command that made it, its date and wall-clock time (and its "
             "budget under `--quick`); `python benchmarks/gpu_check.py --sections NAME` reruns one section.", ""]
    for section in SECTIONS:
        if section not in state:
            continue
        s = state[section]
        budget = f" of its {s['budget']} s budget" if s.get("budget") else ""
        lines += [f"## {section}: {verdict(s)}", "",
                  f"`{s['command']}` on {s['date']}, {s['seconds']:.0f} s{budget}.", ""]
        if section == "tests" and "summary" in s:
            lines += [f"`{s['pytest']}`: {s['summary']}", ""]
            lines += [f"- {f}" for f in s["failures"]] + ([""] if s["failures"] else [])
            if s.get("errors"):
                lines += ["```", *s["errors"], "```", ""]
        elif section == "runs" and "rows" in s:
            lines += [f"Each run: `{s.get('fit', '')}`", "",
                      "Rows in the order the fits ended; phases: seconds of start-up with training and validation, and "
                      "of each measurement (a cut fit names the phase it was in).", "",
                      "| stabilizers | backbone | exit | s | phases (s) | clean | worst robust | best certified | "
                      "verdict |", "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['stabilizers']} | {r['backbone']} | {r['exit']} | {r['seconds']:.0f} | "
                      f"{phase_summary(r.get('phases') or {})} | "
                      f"{fmt(r.get('clean'))} | {fmt(r.get('worst robust'))} | {fmt(r.get('certified'))} | "
                      f"{'ok' if r['passed'] else '; '.join(r['problems'])} |" for r in s["rows"]]
            lines.append("")
        elif section == "compare" and "rows" in s:
            lines += ["Float32, TF32 off, compared as `stability/testing/parity.py` defines (loss terms, gradients, "
                      "the weights after one step from the same gradients, measurements, attacks). Worst key: the one "
                      "closest to "
                      "its tolerance.", "", "| stabilizers | backbone | s | keys | worst key | verdict |",
                      "|---|---|---|---|---|---|"]
            for r in s["rows"]:
                lines.append(f"| {r['stabilizers']} | {r['backbone']} | {fmt_seconds(r.get('seconds'))} | "
                             f"{r['keys']} | {r['worst']} | "
                             f"{'ok' if r['passed'] else '<br>'.join(r.get('failures') or [r['worst']])} |")
            lines.append("")
        elif section == "benchmarks" and "rows" in s:
            lines += ["| command | exit | s | table |", "|---|---|---|---|"]
            lines += [f"| `{r['command']}` | {r['exit']} | {r['seconds']:.0f} | [{Path(r['table']).name}]"
                      f"({Path(r['table']).name}) |" for r in s["rows"]]
            lines.append("")
        elif section == "ddp" and ("one" in s or "skipped" in s):
            lines += [s.get("skipped") or f"one process: {s['one']}; two: {s['two']}", ""]
    return "\n".join(lines) + "\n"


def phase_summary(phases: dict[str, float]) -> str:
    return "<br>".join(f"{name} {seconds:.0f}" for name, seconds in phases.items()) or "—"


def fmt_seconds(value) -> str:
    return "—" if value is None else f"{value:.0f}"


def fmt(value) -> str:
    return "—" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
