"""Running a sweep on this machine: one ``stability fit`` subprocess per run in its own directory,
``--workers`` at a time (one GPU each with ``--devices``), stopped cleanly on SIGTERM.

Rerunning a sweep skips complete runs (``done.json``); a run that was interrupted after writing a
checkpoint resumes from its ``checkpoints/last.ckpt`` (Lightning's ``ckpt_path``) in the same
directory, and ends with the numbers an uninterrupted run of the same seed gives; one interrupted
before any checkpoint is moved aside to ``.interrupted/`` and run again from the start."""
from __future__ import annotations

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
from pathlib import Path
from typing import Any

import yaml

from .. import exit_codes
from .spec import Run, Spec


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES where set, else every GPU torch counts."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def shared_gpus(workers: int) -> list[str]:
    """One device slot per worker, the visible GPUs in turn (several runs share a GPU when there are more
    workers than GPUs); empty without GPUs (the runs share the CPU cores)."""
    gpus = visible_gpus()
    return [gpus[i % len(gpus)] for i in range(workers)] if gpus else []


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def child_environment(env: dict[str, str], device: str | None, workers: int) -> dict[str, str]:
    """A run's environment: its GPU (``CUDA_VISIBLE_DEVICES``) where it has one, and, when ``workers`` runs share the
    machine, its share of the CPU cores (``OMP_NUM_THREADS``, unless set already) — on a GPU machine too: each run's
    host work (the training loop, data, the measurements' CPU parts) would otherwise start a thread per core in every
    process, K runs oversubscribing the cores K times."""
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    if workers > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // workers)))
    return env


def run_status(run_dir: Path) -> dict[str, Any] | None:
    """The ``done.json`` of a complete run, else None."""
    done = run_dir / "done.json"
    return json.loads(done.read_text()) if done.is_file() else None


class Sweep:
    def __init__(self, spec: Spec, sweeps_dir: str = "runs/sweeps", workers: int = 1,
                 devices: list[str] | None = None, stream=sys.stdout) -> None:
        if workers < 1:
            raise ValueError(f"--workers must be >= 1; got {workers}")
        self.spec, self.workers, self.devices = spec, workers, devices or []
        self.root = Path(sweeps_dir) / spec.name
        self.stream = stream
        self._free_devices: queue.Queue[str] = queue.Queue()
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

    def select(self, only: list[str] | None = None) -> list[Run]:
        runs = self.spec.runs()
        if only:
            names = {r.name for r in runs}
            missing = [n for n in only if n not in names]
            if missing:
                raise ValueError(f"--only {missing}: not runs of sweep {self.spec.name!r}; valid: {sorted(names)}")
            runs = [r for r in runs if r.name in only]
        return runs

    def execute(self, runs: list[Run], handle_sigterm: bool = True) -> dict[str, str]:
        """Run what is not complete; returns {run name: status}. Stops its children if interrupted
        (on SIGTERM too, unless ``handle_sigterm`` is False: a submitit job leaves signals to submitit)."""
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
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if handle_sigterm and main_thread else None
        if previous is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        pool = ThreadPoolExecutor(max_workers=self.workers)
        try:  # not ``with pool``: its exit waits for the workers, and so for the fits, before they are stopped
            for run, status in zip(pending, pool.map(self._execute_one, pending)):
                statuses[run.name] = status
        except BaseException:
            self._stopping = True
            self._stop_children()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return statuses

    def _on_sigterm(self, signum, frame) -> None:
        raise KeyboardInterrupt("SIGTERM")

    def stop(self) -> None:
        """Stop every running ``stability fit`` (their last checkpoints stay: a rerun resumes them)."""
        self._stopping = True
        self._stop_children()

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
        checkpoint = resume_checkpoint(run_dir)
        if run_dir.exists() and checkpoint is None:  # interrupted before any checkpoint: keep it aside, start clean
            aside = self.root / ".interrupted"
            aside.mkdir(exist_ok=True)
            attempt = len(list(aside.glob(f"{glob_escape(run.name)}.*")))
            shutil.move(str(run_dir), str(aside / f"{run.name}.{attempt}"))
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.spec.command(run, run_dir) + ([f"--ckpt_path={checkpoint}"] if checkpoint else [])
        record_path = run_dir / "sweep_run.json"
        resumed = json.loads(record_path.read_text()).get("resumed", []) if record_path.is_file() else []
        if checkpoint is not None:
            resumed.append({"from": str(checkpoint), "at": time.strftime("%Y-%m-%d %H:%M:%S")})
        device = self._free_devices.get() if self.devices else None
        env = child_environment(dict(os.environ), device, self.workers)
        try:  # from here on, the device goes back whatever fails
            record_path.write_text(json.dumps({
                "sweep": self.spec.name, "run": run.name, "configuration": run.configuration,
                "overrides": dict(run.overrides), "seed": run.seed, "command": cmd, "resumed": resumed,
                # CPU sums split over threads round differently: the same seed repeats its numbers bit for bit
                # only with the same thread count (unset: torch's default, one per physical core)
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS")}, indent=1) + "\n")
            verb = "resume" if checkpoint is not None else "start"
            self._say(f"[{verb}] {run.name}" + (f" on device {device}" if device is not None else ""))
            started = time.time()
            with open(run_dir / "run.log", "a" if checkpoint is not None else "w") as log:
                child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                with self._lock:
                    self._children.add(child)
                    if self._stopping:  # stopped while it started: _stop_children did not see it
                        child.terminate()
                code = child.wait()
                with self._lock:
                    self._children.discard(child)
        finally:
            if device is not None:
                self._free_devices.put(device)
        seconds = round(time.time() - started, 1)
        ended = code in (0, exit_codes.DIVERGED)  # a stopped fit exits INTERRUPTED (or is killed by the signal)
        # an ended fit is recorded even when the sweep is being stopped, or a run whose test had finished as the stop
        # came would be tested again from the start
        if self._stopping and not ended:
            return "interrupted"
        if code == exit_codes.INTERRUPTED:  # the run itself was stopped (SIGTERM from outside): not complete
            self._say(f"[interrupted] {run.name}: stopped by SIGTERM ({seconds} s); rerun the sweep to resume it")
            return "interrupted"
        if ended:
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


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint an unfinished run resumes from: its ``checkpoints/last.ckpt``, if any."""
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    return checkpoint if run_status(run_dir) is None and checkpoint.is_file() else None


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)
