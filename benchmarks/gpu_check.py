"""One command that proves the suite on a GPU.

    python benchmarks/gpu_check.py                        # every section
    python benchmarks/gpu_check.py --sections runs,compare   # some of them (the others keep their last results)

Sections:

* ``tests``: the tests marked ``gpu`` (``pytest -m gpu``): no synchronisation inside a training step of any
  stabilizer (CUDA's own sync check), GPU against CPU for every stabilizer and backbone, measurements against
  the CPU under fp32 and bf16-mixed.
* ``runs``: every registered stabilizer (with what it needs, and the compositions the tests train) on every
  backbone it applies to, ``stability fit`` for 2 epochs in bf16-mixed on one GPU with the test-time
  measurements (FGSM, PGD, official AutoAttack, certified accuracy where a bound exists). Each must exit 0 with
  a finite training loss and a ``results.json`` in which every robust accuracy is at most the clean accuracy of
  the same points, and certified at most clean.
* ``compare``: each stabilizer's loss terms and one optimizer step with its projection, the same weights and
  batch in float32 (TF32 off) on the GPU and on the CPU: relative differences within 1e-4.
* ``benchmarks``: ``step_cost.py`` at batch 256 in fp32 and bf16 (ViT-S, Swin-T, CSwin-T, 64 and 256 tokens;
  memory after a warm-up step) and ``measurement_cost.py`` at batch 256 against an fp32 and a bf16 training step.
* ``ddp`` (two GPUs or more): ``stability test`` of one checkpoint on one process and on two.

Results go to ``results/benchmarks/gpu_check_<device>.md`` (and ``.json``, which keeps each section's last
result so that sections can run in separate calls), with the device, the commands and the times. Without a
CUDA GPU the script prints one line and exits with status 2; with a failed check, status 1.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("tests", "runs", "compare", "benchmarks", "ddp")
COMPOSITIONS = ["lipsformer,jasmin", "lipschitz_transformer,muon", "lipschitz_transformer,muon,lipschitz_margin"]
BACKBONES = ("vit", "swin", "cswin")  # each at its micro preset, on 16 × 16 digits
DEVICE = "cuda"  # "cpu" for --cpu_dry_run
SELECTED: set[tuple[str, str]] | None = None  # --cases
SIZES = {"epochs": 2, "attack_points": 256, "autoattack_points": 32}  # of the runs (options of the same names)
TOLERANCE = 1e-4  # GPU vs CPU, relative, float32 with TF32 off
MUON_TOLERANCE = 1e-3  # for weights after a Muon step: torch.optim.Muon orthogonalises in bf16 on either device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {SECTIONS}")
    parser.add_argument("--cases", default=None, help="only these STABILIZERS:BACKBONE (comma-separated, + between "
                                                      "stabilizers), e.g. none:vit,muon:swin")
    parser.add_argument("--workers", type=int, default=4, help="fits run at once on the GPU (section runs)")
    for option, value in SIZES.items():
        parser.add_argument(f"--{option}", type=int, default=value, help=f"of each fit (section runs; default {value})")
    parser.add_argument("--out", default=None, help="default results/benchmarks/gpu_check_<device>.md")
    parser.add_argument("--cpu_dry_run", action="store_true",
                        help="run the sections on the CPU against itself: tests this script without a GPU, proves "
                             "nothing about one")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check")
        raise SystemExit(2)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown section(s) {unknown}; choose from {SECTIONS}")
    sys.path.insert(0, str(ROOT))
    global DEVICE, SELECTED
    DEVICE = "cpu" if args.cpu_dry_run else "cuda"
    SIZES.update({option: getattr(args, option) for option in SIZES})
    SELECTED = None if args.cases is None else {tuple(c.replace("+", ",").split(":")) for c in args.cases.split(",")}
    device_name = "cpu dry run" if args.cpu_dry_run else torch.cuda.get_device_name(0)
    out = Path(args.out) if args.out else ROOT / "results" / "benchmarks" / f"gpu_check_{slug(device_name)}.md"
    state_path = out.with_suffix(".json")
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/gpu_check.py", *sys.argv[1:]])
    for section in sections:
        started = time.time()
        print(f"gpu_check: {section} …", flush=True)
        result = {"tests": run_gpu_tests, "runs": lambda: run_fits(args.workers), "compare": compare_with_cpu,
                  "benchmarks": lambda: run_benchmarks(device_name), "ddp": compare_processes}[section]()
        result.update(seconds=round(time.time() - started, 1), command=command,
                      date=time.strftime("%Y-%m-%d %H:%M"))
        state[section] = result
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(json.dumps(state, indent=1) + "\n")  # a later failure keeps what is done
        print(f"gpu_check: {section}: {'passed' if result['passed'] else 'FAILED'} ({result['seconds']:.0f} s)",
              flush=True)
    from stability.machine import describe

    out.write_text(render(state, describe(DEVICE), torch.cuda.device_count()))
    print(out.read_text())
    print(f"wrote {out}")
    raise SystemExit(0 if all(s["passed"] for s in state.values()) else 1)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cases() -> list[tuple[str, str]]:
    """(stabilizers, backbone) for every registered stabilizer with what it needs, and the tested compositions."""
    from stability.stabilizers import REGISTRY

    names = [",".join([*REGISTRY[n].needs, n]) for n in REGISTRY] + COMPOSITIONS
    every = [(s, b) for s in names for b in BACKBONES if all(b in REGISTRY[n].backbones for n in s.split(","))]
    return every if SELECTED is None else [case for case in every if case in SELECTED]


# ------------------------------------------------------------------------------------------------- tests
def run_gpu_tests() -> dict:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider", "tests"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"passed": done.returncode == 0, "summary": lines[-1] if lines else done.stderr.strip()[-300:],
            "failures": failures[:40], "pytest": "python " + " ".join(command[1:])}


# -------------------------------------------------------------------------------------------------- runs
def fit_command(stabilizer: str, backbone: str, run_dir: Path) -> list[str]:
    accelerator = "gpu" if DEVICE == "cuda" else "cpu"
    return [sys.executable, "-m", "stability", "fit", "--stabilizer", stabilizer, "--model.backbone", backbone,
            "--data.image_size", "16", "--trainer.max_epochs", str(SIZES["epochs"]),
            "--trainer.precision", "bf16-mixed", "--trainer.accelerator", accelerator, "--trainer.devices", "1",
            "--trainer.enable_progress_bar", "false",
            "--run_dir", str(run_dir), "--test_after_fit", "true",
            "--robustness.test_attacks", "[fgsm, pgd, autoattack]",
            "--robustness.attack_num_points", str(SIZES["attack_points"]),
            "--robustness.autoattack_num_points", str(SIZES["autoattack_points"]), "--lipschitz.test_num_points", "128",
            "--lipschitz.attention_points", "8"]


def run_fits(workers: int) -> dict:
    root = ROOT / "runs" / "gpu_check"
    todo = cases()

    def one(case):
        stabilizer, backbone = case
        run_dir = root / f"{backbone}_{stabilizer.replace(',', '+')}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts clean
        started = time.time()
        done = subprocess.run(fit_command(stabilizer, backbone, run_dir), cwd=ROOT, capture_output=True, text=True)
        return check_run(stabilizer, backbone, run_dir, done, time.time() - started)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        rows = list(pool.map(one, todo))
    return {"passed": all(r["passed"] for r in rows), "rows": rows,
            "fit": " ".join(fit_command("<stabilizers>", "<backbone>", Path("<dir>"))[1:])}


def check_run(stabilizer: str, backbone: str, run_dir: Path, done: subprocess.CompletedProcess,
              seconds: float) -> dict:
    row = {"stabilizers": stabilizer, "backbone": backbone, "seconds": round(seconds, 1), "exit": done.returncode}
    problems = []
    if done.returncode != 0:
        problems.append(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}")
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
def compare_with_cpu() -> dict:
    from stability.classifier import CROSS_ENTROPY, ImageClassifier
    from stability.models import without_dropout
    from stability.nn.precision import ieee_float32

    rows = []
    for stabilizer, backbone in cases():
        torch.manual_seed(0)
        cpu = without_dropout(ImageClassifier(backbone=backbone, image_size=16, stabilizer=stabilizer).train())
        gpu = copy.deepcopy(cpu).to(DEVICE)
        gen = torch.Generator().manual_seed(1)
        images, labels = torch.rand(32, 1, 16, 16, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        with ieee_float32():
            terms = {}
            for side, module, device in (("cpu", cpu, "cpu"), ("device", gpu, DEVICE)):
                optimizer = module.build_optimizer()
                optimizer.zero_grad(set_to_none=True)
                _, terms[side] = module.losses(images.to(device), labels.to(device))
                sum(t for n, t in terms[side].items() if n != CROSS_ENTROPY).backward()
                optimizer.step()
                module.after_optimizer_step(0)
        on_cpu = {k: float(v.detach()) for k, v in terms["cpu"].items()}
        loss_error = max(abs(float(terms["device"][k].detach()) - v) / max(abs(v), 1e-6) for k, v in on_cpu.items())
        pairs = [(a.detach(), b.detach().cpu()) for a, b in zip(cpu.parameters(), gpu.parameters())]
        weight_error = max(float((b - a).abs().max()) / max(float(a.abs().max()), 1e-6) for a, b in pairs)
        weight_tolerance = MUON_TOLERANCE if "muon" in stabilizer else TOLERANCE
        rows.append({"stabilizers": stabilizer, "backbone": backbone, "loss terms": sorted(terms["cpu"]),
                     "loss error": loss_error, "weight error": weight_error, "weight tolerance": weight_tolerance,
                     "passed": loss_error <= TOLERANCE and weight_error <= weight_tolerance})
    return {"passed": all(r["passed"] for r in rows), "rows": rows}


# -------------------------------------------------------------------------------------------- benchmarks
def run_benchmarks(device_name: str) -> dict:
    name, folder = slug(device_name), "results/benchmarks"
    quick = ["--quick"] if DEVICE == "cpu" else []
    commands = [
        ["benchmarks/step_cost.py", "--device", DEVICE, "--backbones", "vit:small,swin:tiny,cswin:tiny",
         "--tokens", "64,256", "--precision", "fp32,bf16", "--repeats", "5", *quick,
         "--out", f"{folder}/step_cost_{name}.md"],
        *[["benchmarks/measurement_cost.py", "--device", DEVICE, "--batch", "256", "--precision", precision, *quick,
           "--out", f"{folder}/measurement_cost_{name}_{precision}.md"] for precision in ("fp32", "bf16")],
    ]
    rows = []
    for command in commands:
        started = time.time()
        done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
        rows.append({"command": "python " + " ".join(command), "exit": done.returncode,
                     "seconds": round(time.time() - started, 1), "table": command[-1],
                     "error": done.stderr.strip().splitlines()[-1:] if done.returncode else [],
                     "passed": done.returncode == 0})
    return {"passed": all(r["passed"] for r in rows), "rows": rows}


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
             f"{gpus} GPU(s). Each section below gives the command that made it, its date and wall-clock time; "
             "`python benchmarks/gpu_check.py --sections NAME` reruns one section.", ""]
    for section in SECTIONS:
        if section not in state:
            continue
        s = state[section]
        lines += [f"## {section}: {'passed' if s['passed'] else 'FAILED'}", "",
                  f"`{s['command']}` on {s['date']}, {s['seconds']:.0f} s.", ""]
        if section == "tests":
            lines += [f"`{s['pytest']}`: {s['summary']}", ""]
            lines += [f"- {f}" for f in s["failures"]] + ([""] if s["failures"] else [])
        elif section == "runs":
            lines += [f"Each run: `{s['fit']}`", "",
                      "| stabilizers | backbone | exit | s | clean | worst robust | best certified | verdict |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['stabilizers']} | {r['backbone']} | {r['exit']} | {r['seconds']:.0f} | "
                      f"{fmt(r.get('clean'))} | {fmt(r.get('worst robust'))} | {fmt(r.get('certified'))} | "
                      f"{'ok' if r['passed'] else '; '.join(r['problems'])} |" for r in s["rows"]]
            lines.append("")
        elif section == "compare":
            lines += [f"Float32, TF32 off; tolerance {TOLERANCE:g} relative ({MUON_TOLERANCE:g} for the weights after "
                      "a Muon step, which torch.optim.Muon orthogonalises in bf16).", "",
                      "| stabilizers | backbone | loss terms | max loss difference | max weight difference after a "
                      "step | verdict |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['stabilizers']} | {r['backbone']} | {', '.join(r['loss terms'])} | "
                      f"{r['loss error']:.1e} | {r['weight error']:.1e} | {'ok' if r['passed'] else 'over'} |"
                      for r in s["rows"]]
            lines.append("")
        elif section == "benchmarks":
            lines += ["| command | exit | s | table |", "|---|---|---|---|"]
            lines += [f"| `{r['command']}` | {r['exit']} | {r['seconds']:.0f} | [{Path(r['table']).name}]"
                      f"({Path(r['table']).name}) |" for r in s["rows"]]
            lines.append("")
        elif section == "ddp":
            lines += [s.get("skipped") or f"one process: {s['one']}; two: {s['two']}", ""]
    return "\n".join(lines) + "\n"


def fmt(value) -> str:
    return "—" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
