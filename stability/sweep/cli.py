"""``stability sweep``: the command line."""
from __future__ import annotations

import argparse
import sys

from .. import exit_codes
from .emit import write_commands, write_slurm_array
from .runner import Sweep, run_status
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
    p.add_argument("--workers", type=int, default=1, help="runs at once on this machine")
    p.add_argument("--devices", help="comma-separated GPU ids, one per concurrent run (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--only", action="append", help="run only this run name (repeat); used by emitted commands")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their status, run nothing")
    p.add_argument("--emit", choices=("commands", "slurm"),
                   help="write one command per run (commands.txt) or a SLURM job-array script, run nothing")
    p.add_argument("--slurm_option", action="append", default=[],
                   help='extra "#SBATCH" line for --emit slurm, e.g. --slurm_option=--gres=gpu:1 (repeat)')
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec = load_spec(args.spec, args)
        devices = [d for d in (args.devices or "").split(",") if d]
        sweep = Sweep(spec, args.sweeps_dir, args.workers if not devices else max(args.workers, len(devices)),
                      devices)
        runs = sweep.select(args.only)
    except (ValueError, FileNotFoundError) as err:
        print(f"stability sweep: error: {err}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    if args.dry_run:
        for run in runs:
            done = run_status(sweep.run_dir(run))
            print(f"{done['status'] if done else 'pending':10s} {run.name}")
        return 0
    if args.emit:
        spec_path = sweep.write_spec()
        path = (write_commands(sweep.root, runs, spec_path) if args.emit == "commands"
                else write_slurm_array(sweep.root, spec.name, runs, spec_path, args.slurm_option))
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
