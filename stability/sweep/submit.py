"""Submitting a sweep to a cluster through submitit (Meta's job-submission library): one job per
run — a SLURM job array, or local processes — at most ``array_parallelism`` at a time. Each job does
the bookkeeping of ``stability sweep FILE --only RUN`` (a complete run is skipped, an interrupted one
resumes); a job that is preempted or reaches its time limit is requeued by submitit and resumes its
run from the last checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from .runner import Sweep
from .spec import Run, Spec

CLUSTERS = ("slurm", "local")


class RunJob(Checkpointable):
    """One sweep run as a submitit job (picklable: the spec as a dict, the run by name)."""

    def __init__(self, spec: dict[str, Any], run: str, sweeps_dir: str) -> None:
        self.spec, self.run, self.sweeps_dir = spec, run, sweeps_dir
        self._sweep: Sweep | None = None

    def __call__(self) -> str:
        self._sweep = Sweep(Spec.from_dict(self.spec, "submitted sweep"), self.sweeps_dir)
        return self._sweep.execute(self._sweep.select([self.run]), handle_sigterm=False)[self.run]

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """On preemption or time-out: stop the run (its last checkpoint stays) and requeue this job,
        which resumes it."""
        if self._sweep is not None:
            self._sweep.stop()
        return DelayedSubmission(RunJob(self.spec, self.run, self.sweeps_dir))

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "run": self.run, "sweeps_dir": self.sweeps_dir, "_sweep": None}


def submit(sweep: Sweep, runs: list[Run], cluster: str, sweeps_dir: str, *, timeout_min: int = 240,
           array_parallelism: int = 16, gpus_per_node: int = 0, cpus_per_task: int | None = None,
           partition: str | None = None, slurm_options: dict[str, str] | None = None) -> list[submitit.Job]:
    """Submit one job per run; submitit writes its logs under ``<sweep>/submitit/``."""
    if cluster not in CLUSTERS:
        raise ValueError(f"--submit {cluster!r}: choose one of {CLUSTERS}")
    sweep.write_spec()
    executor = submitit.AutoExecutor(folder=sweep.root / "submitit" / "%j", cluster=cluster)
    parameters: dict[str, Any] = {"name": sweep.spec.name, "timeout_min": timeout_min,
                                  "slurm_array_parallelism": array_parallelism}
    if gpus_per_node:
        parameters["gpus_per_node"] = gpus_per_node
    if cpus_per_task:
        parameters["cpus_per_task"] = cpus_per_task
    if partition:
        parameters["slurm_partition"] = partition
    if slurm_options:
        parameters["slurm_additional_parameters"] = dict(slurm_options)
    executor.update_parameters(**parameters)
    spec = sweep.spec.to_dict()
    with executor.batch():
        jobs = [executor.submit(RunJob(spec, run.name, str(Path(sweeps_dir)))) for run in runs]
    return jobs
