"""``stability sweep``: the command line."""
from __future__ import annotations

import argparse
import sys

from .. import exit_codes
from .emit import write_commands
from .runner import Sweep, run_status, shared_gpus
from .spec import load_spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stability sweep", description="a grid or list of stability fit runs",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", help="sweep file (YAML); optional with --name and --grid/--set")
    p.add_argument("--name", help="sweep name (directory under --sweeps_dir)")
    p.add_argument("--config", action="append", help="a --config file of every run (repeat)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="grid over a config key (repeat)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run (repeat)")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--sweeps_dir", default="runs/sweeps", help="root of sweeps (default runs/sweeps)")
    p.add_argument("--workers", type=int, default=1,
                   help="runs at once on this machine (with GPUs and no --devices: spread over the visible GPUs, "
                        "one GPU per run)")
    p.add_argument("--devices", help="comma-separated GPU ids, one per concurrent run (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--only", action="append", help="run only this run name (repeat); used by emitted commands")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their status, run nothing")
    p.add_argument("--emit", choices=("commands",),
                   help="write one `stability sweep FILE --only RUN` line per run (commands.txt), run nothing")
    cluster = p.add_argument_group("submitting to a cluster (submitit)")
    cluster.add_argument("--submit", choices=("slurm", "local"),
                         help="submit one job per run instead of running here: a SLURM job array, or local "
                              "processes; preempted or timed-out jobs are requeued and resume")
    cluster.add_argument("--timeout_min", type=int, default=240, help="time limit of each job (minutes)")
    cluster.add_argument("--array_parallelism", type=int, default=16, help="jobs of the array running at once")
    cluster.add_argument("--gpus_per_node", type=int, default=0, help="GPUs per job")
    cluster.add_argument("--cpus_per_task", type=int, default=None, help="CPUs per job")
    cluster.add_argument("--partition", help="SLURM partition")
    cluster.add_argument("--slurm_option", action="append", default=[], metavar="KEY=VALUE",
                         help="any other sbatch option, e.g. --slurm_option=account=myproject (repeat)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec = load_spec(args.spec, args)
        devices = [d for d in (args.devices or "").split(",") if d]
        if not devices and args.workers > 1 and not args.submit:
            devices = shared_gpus(args.workers)  # without --devices: one GPU per run, not every GPU for every run
        sweep = Sweep(spec, args.sweeps_dir, args.workers if not devices else max(args.workers, len(devices)),
                      devices)
        runs = sweep.select(args.only)
        slurm_options = dict(_key_value(o) for o in args.slurm_option)
    except (ValueError, FileNotFoundError) as err:
        print(f"stability sweep: error: {err}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    if args.dry_run:
        for run in runs:
            done = run_status(sweep.run_dir(run))
            print(f"{done['status'] if done else 'pending':10s} {run.name}")
        return 0
    if args.emit:
        path = write_commands(sweep.root, runs, sweep.write_spec())
        print(f"wrote {path} ({len(runs)} runs)")
        return 0
    if args.submit:
        from .submit import submit

        jobs = submit(sweep, runs, args.submit, args.sweeps_dir, timeout_min=args.timeout_min,
                      array_parallelism=args.array_parallelism, gpus_per_node=args.gpus_per_node,
                      cpus_per_task=args.cpus_per_task, partition=args.partition, slurm_options=slurm_options)
        print(f"submitted {len(jobs)} jobs ({args.submit}): {', '.join(j.job_id for j in jobs)}; logs in "
              f"{sweep.root / 'submitit'}; rerun `stability sweep {args.spec or '...'} --dry_run` to follow them")
        return 0
    try:
        statuses = sweep.execute(runs)
    except KeyboardInterrupt:
        print("stability sweep: interrupted; complete runs are kept, rerun the same command to finish",
              file=sys.stderr)
        return 130
    counts = {s: sum(v == s for v in statuses.values()) for s in sorted(set(statuses.values()))}
    print(f"sweep {spec.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" — in {sweep.root}")
    return 1 if counts.get("failed") or counts.get("interrupted") else 0  # every run done, or not


def _key_value(option: str) -> tuple[str, str]:
    key, sep, value = option.lstrip("-").partition("=")
    if not sep or not key:
        raise ValueError(f"--slurm_option takes KEY=VALUE (an sbatch option without its dashes); got {option!r}")
    return key, value
