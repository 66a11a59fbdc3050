"""Running a sweep on this machine: one ``stability fit`` subprocess per run in its own directory,
``--workers`` at a time (one GPU each with ``--devices``), resumable, stopped cleanly on SIGTERM."""
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
        if code in (0, exit_codes.DIVERGED):
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


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)
