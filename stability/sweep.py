"""``stability sweep``: a grid or list of ``stability fit`` runs over config keys and seeds.

A sweep file (YAML) names the study, the configs and overrides every run shares, the
configurations to compare and the seeds::

    name: jasmin_lambda                  # runs go to <sweeps_dir>/<name>/<run>/
    config: [configs/vit_digits.yaml]    # --config files of every run, in order
    args: {trainer.max_epochs: 20, test_after_fit: true}   # overrides of every run
    variants:                            # configurations (default: one, empty)
      - {stabilizer: none}
      - stabilizer: jasmin
        grid: {jasmin.lam: [1e-2, 1e-3], jasmin.k: [0, 10]}   # a variant's own grid
    grid: {}                             # crossed with every variant
    seeds: [0, 1, 2]

The same from the command line (``--grid`` and ``--set`` repeat; they add to a file's)::

    stability sweep --name lr --config configs/vit_digits.yaml --grid model.lr=1e-3,1e-2 \\
        --grid stabilizer=none,lipsformer --set model.warmup_epochs=0 --seeds 0,1

Every run is a normal ``stability fit`` in its own directory (``config.yaml`` is its full resolved
config; ``sweep_run.json`` its overrides and command; ``run.log`` its output). A run is complete
when it holds ``done.json`` (``completed`` or ``diverged``); rerunning the sweep skips complete
runs, moves an unfinished run's directory aside to ``.interrupted/`` and runs it again, and retries
failed ones. ``--workers N`` runs N at once (``--devices 0,1`` gives each its own GPU); ``--emit
slurm`` writes a job-array script with one run per task instead of running anything.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

DIVERGED_EXIT_CODE = 3  # stability.cli.DIVERGED_EXIT_CODE (not imported: keeps this module light)
SPEC_KEYS = {"name", "description", "config", "args", "variants", "grid", "seeds"}


@dataclass(frozen=True)
class Run:
    """One ``stability fit``: its overrides (in order), seed and directory name."""

    overrides: tuple[tuple[str, Any], ...]
    seed: int

    @property
    def name(self) -> str:
        parts = [f"{k}={_short(v)}" for k, v in self.overrides] + [f"seed={self.seed}"]
        name = re.sub(r"[^A-Za-z0-9._=+,-]+", "_", ",".join(parts))
        if len(name) > 120:  # keep it readable and unique
            digest = hashlib.sha1(name.encode()).hexdigest()[:8]
            name = f"{name[:100]}..{digest}"
        return name

    @property
    def configuration(self) -> str:
        """The run's configuration without its seed (what a report groups by)."""
        return ", ".join(f"{k}={_short(v)}" for k, v in self.overrides) or "(base)"


@dataclass
class Spec:
    name: str
    config: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    variants: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    grid: dict[str, list] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    description: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "sweep file") -> "Spec":
        unknown = set(raw) - SPEC_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}; valid keys: {sorted(SPEC_KEYS)}")
        if not raw.get("name"):
            raise ValueError(f"{source}: give the sweep a name (name: ... or --name)")
        config = raw.get("config") or []
        spec = cls(name=str(raw["name"]), config=[config] if isinstance(config, str) else list(config),
                   args=dict(raw.get("args") or {}), variants=list(raw.get("variants") or [{}]),
                   grid=dict(raw.get("grid") or {}), seeds=[int(s) for s in raw.get("seeds", [0])],
                   description=str(raw.get("description", "")))
        for key, values in spec.grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"{source}: grid values of {key!r} must be a non-empty list; got {values!r}")
        for variant in spec.variants:
            if not isinstance(variant, dict):
                raise ValueError(f"{source}: each variant is a mapping of overrides; got {variant!r}")
        if not spec.seeds:
            raise ValueError(f"{source}: seeds must not be empty")
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "config": self.config, "args": self.args,
                "variants": self.variants, "grid": self.grid, "seeds": self.seeds}

    def runs(self) -> list[Run]:
        """Every variant × its own grid × the shared grid × seeds, in that order, without duplicates."""
        runs, seen = [], set()
        for variant in self.variants:
            fixed = {k: v for k, v in variant.items() if k != "grid"}
            own_grid = dict(variant.get("grid") or {})
            for values in _product({**own_grid, **self.grid}):
                overrides = tuple({**fixed, **values}.items())
                for seed in self.seeds:
                    run = Run(overrides, seed)
                    if run.name not in seen:
                        seen.add(run.name)
                        runs.append(run)
        return runs

    def command(self, run: Run, run_dir: Path) -> list[str]:
        """The ``stability fit`` command line of ``run``."""
        cmd = [sys.executable, "-m", "stability", "fit"]
        for path in self.config:
            cmd += ["--config", str(path)]
        for key, value in {**self.args, **dict(run.overrides)}.items():
            cmd.append(f"--{key}={_cli_value(value)}")
        return cmd + [f"--seed_everything={run.seed}", f"--run_dir={run_dir}",
                      "--trainer.enable_progress_bar=false"]


def _product(grid: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(_short(v) for v in value)
    if isinstance(value, dict):
        return "+".join(f"{k}-{_short(v)}" for k, v in value.items())
    return str(value)


def _cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def load_spec(path: Optional[str], cli: argparse.Namespace) -> Spec:
    """The sweep file (if any) with the command line's name, configs, grids and overrides added."""
    raw: dict[str, Any] = {}
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"sweep file {path!r} not found")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a sweep file is a mapping with keys {sorted(SPEC_KEYS)}")
    if cli.name:
        raw["name"] = cli.name
    if cli.config:
        raw["config"] = [*(raw.get("config") or []), *cli.config]
    for item in cli.set or []:
        key, value = _key_value(item, "--set")
        raw.setdefault("args", {})[key] = yaml.safe_load(value)
    for item in cli.grid or []:
        key, values = _key_value(item, "--grid")
        raw.setdefault("grid", {})[key] = [yaml.safe_load(v) for v in _split_top_level(values)]
    if cli.seeds:
        raw["seeds"] = [int(s) for s in cli.seeds.split(",")]
    return Spec.from_dict(raw, path or "command line")


def _key_value(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} takes KEY=VALUE; got {item!r}")
    return key.lstrip("-"), value


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and braces: ``a,[b,c]`` → ``a``, ``[b,c]``."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


# ------------------------------------------------------------------------------------ running
def run_status(run_dir: Path) -> Optional[dict[str, Any]]:
    """The ``done.json`` of a complete run, else None."""
    done = run_dir / "done.json"
    return json.loads(done.read_text()) if done.is_file() else None


class Sweep:
    def __init__(self, spec: Spec, sweeps_dir: str = "runs/sweeps", workers: int = 1,
                 devices: Optional[list[str]] = None, stream=sys.stdout) -> None:
        if workers < 1:
            raise ValueError(f"--workers must be >= 1; got {workers}")
        self.spec, self.workers, self.devices = spec, workers, devices or []
        self.root = Path(sweeps_dir) / spec.name
        self.stream = stream
        self._free_devices: "queue.Queue[str]" = queue.Queue()
        for device in self.devices:
            self._free_devices.put(device)
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def run_dir(self, run: Run) -> Path:
        return self.root / run.name

    def write_spec(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "sweep.yaml"
        path.write_text(yaml.safe_dump(self.spec.to_dict(), sort_keys=False))
        return path

    def select(self, only: Optional[list[str]] = None) -> list[Run]:
        runs = self.spec.runs()
        if only:
            names = {r.name for r in runs}
            missing = [n for n in only if n not in names]
            if missing:
                raise ValueError(f"--only {missing}: not runs of sweep {self.spec.name!r}; valid: {sorted(names)}")
            runs = [r for r in runs if r.name in only]
        return runs

    def execute(self, runs: list[Run]) -> dict[str, str]:
        """Run what is not complete; returns {run name: status}. Stops its children if interrupted."""
        self.write_spec()
        statuses: dict[str, str] = {}
        pending = []
        for run in runs:
            done = run_status(self.run_dir(run))
            if done is not None:
                statuses[run.name] = done["status"]
                self._say(f"[skip] {run.name}: {done['status']}")
            else:
                pending.append(run)
        self._say(f"sweep {self.spec.name}: {len(runs)} runs, {len(runs) - len(pending)} already complete, "
                  f"{len(pending)} to run in {self.root}")
        previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if previous is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                for run, status in zip(pending, pool.map(self._execute_one, pending)):
                    statuses[run.name] = status
        except BaseException:
            self._stopping = True
            self._stop_children()
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return statuses

    def _on_sigterm(self, signum, frame) -> None:
        raise KeyboardInterrupt("SIGTERM")

    def _stop_children(self) -> None:
        with self._lock:
            children = list(self._children)
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()

    def _execute_one(self, run: Run) -> str:
        if self._stopping:
            return "not started"
        run_dir = self.run_dir(run)
        if run_dir.exists():  # an unfinished or failed attempt: keep it aside, start clean
            aside = self.root / ".interrupted"
            aside.mkdir(exist_ok=True)
            attempt = len(list(aside.glob(f"{glob_escape(run.name)}.*")))
            shutil.move(str(run_dir), str(aside / f"{run.name}.{attempt}"))
        run_dir.mkdir(parents=True)
        cmd = self.spec.command(run, run_dir)
        (run_dir / "sweep_run.json").write_text(json.dumps({
            "sweep": self.spec.name, "run": run.name, "configuration": run.configuration,
            "overrides": dict(run.overrides), "seed": run.seed, "command": cmd}, indent=1) + "\n")
        env = dict(os.environ)
        device = self._free_devices.get() if self.devices else None
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        elif self.workers > 1:  # share the CPU cores instead of oversubscribing them
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.workers)))
        self._say(f"[start] {run.name}" + (f" on device {device}" if device is not None else ""))
        started = time.time()
        try:
            with open(run_dir / "run.log", "w") as log:
                child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                with self._lock:
                    self._children.add(child)
                code = child.wait()
                with self._lock:
                    self._children.discard(child)
        finally:
            if device is not None:
                self._free_devices.put(device)
        seconds = round(time.time() - started, 1)
        if self._stopping:
            return "interrupted"
        if code in (0, DIVERGED_EXIT_CODE):
            status = "completed" if code == 0 else "diverged"
            record = {"status": status, "seconds": seconds}
            if status == "diverged" and (run_dir / "diverged.json").is_file():
                record.update(json.loads((run_dir / "diverged.json").read_text()))
            (run_dir / "done.json").write_text(json.dumps(record) + "\n")
            self._say(f"[{status}] {run.name} ({seconds} s)")
            return status
        tail = (run_dir / "run.log").read_text()[-1500:]
        self._say(f"[failed] {run.name}: exit status {code} ({seconds} s); its log ends:\n{tail}")
        return "failed"

    def _say(self, line: str) -> None:
        with self._lock:
            print(line, file=self.stream, flush=True)

    # ----------------------------------------------------------------------- emitting
    def emit(self, kind: str, runs: list[Run], spec_path: Path, slurm_options: list[str]) -> Path:
        """One ``stability sweep SPEC --only RUN`` line per run; for ``slurm`` also a job-array script."""
        self.root.mkdir(parents=True, exist_ok=True)
        lines = [" ".join([sys.executable, "-m", "stability", "sweep", str(spec_path), "--sweeps_dir",
                           str(self.root.parent), "--only", _quote(run.name)]) for run in runs]
        commands = self.root / "commands.txt"
        commands.write_text("\n".join(lines) + "\n")
        if kind == "commands":
            return commands
        logs = self.root / "slurm"
        logs.mkdir(exist_ok=True)
        script = self.root / "slurm_array.sh"
        options = "".join(f"#SBATCH {o}\n" for o in slurm_options)
        script.write_text(
            "#!/bin/bash\n"
            f"#SBATCH --job-name={self.spec.name}\n"
            f"#SBATCH --array=0-{len(runs) - 1}\n"
            f"#SBATCH --output={logs.resolve()}/%A_%a.out\n"
            f"{options}"
            f"# one run of sweep {self.spec.name} per array task; rerunning a task skips a complete run\n"
            f"cd {Path.cwd()}\n"
            f'sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {commands.resolve()} | bash\n')
        script.chmod(0o755)
        return script


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stability sweep", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", help="sweep file (YAML); optional with --name and --grid/--set")
    p.add_argument("--name", help="sweep name (directory under --sweeps_dir)")
    p.add_argument("--config", action="append", help="a --config file of every run (repeat)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="grid over a config key (repeat)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run (repeat)")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--sweeps_dir", default="runs/sweeps", help="root of sweeps (default runs/sweeps)")
    p.add_argument("--workers", type=int, default=1, help="runs at once on this machine")
    p.add_argument("--devices", help="comma-separated GPU ids, one per concurrent run (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--only", action="append", help="run only this run name (repeat); used by emitted commands")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their status, run nothing")
    p.add_argument("--emit", choices=("commands", "slurm"),
                   help="write one command per run (commands.txt) or a SLURM job-array script, run nothing")
    p.add_argument("--slurm_option", action="append", default=[],
                   help='extra "#SBATCH" line for --emit slurm, e.g. --slurm_option=--gres=gpu:1 (repeat)')
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec = load_spec(args.spec, args)
        devices = [d for d in (args.devices or "").split(",") if d]
        sweep = Sweep(spec, args.sweeps_dir, args.workers if not devices else max(args.workers, len(devices)),
                      devices)
        runs = sweep.select(args.only)
    except (ValueError, FileNotFoundError) as err:
        print(f"stability sweep: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for run in runs:
            done = run_status(sweep.run_dir(run))
            print(f"{done['status'] if done else 'pending':10s} {run.name}")
        return 0
    if args.emit:
        spec_path = sweep.write_spec()
        path = sweep.emit(args.emit, runs, spec_path, args.slurm_option)
        print(f"wrote {path} ({len(runs)} runs)" + (f"; submit with: sbatch {path}" if args.emit == "slurm" else ""))
        return 0
    try:
        statuses = sweep.execute(runs)
    except KeyboardInterrupt:
        print("stability sweep: interrupted; complete runs are kept, rerun the same command to finish",
              file=sys.stderr)
        return 130
    counts = {s: sum(v == s for v in statuses.values()) for s in sorted(set(statuses.values()))}
    print(f"sweep {spec.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" — in {sweep.root}")
    return 1 if counts.get("failed") else 0
