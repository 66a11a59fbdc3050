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
from .cli import main
from .runner import Sweep, run_status
from .spec import Run, Spec, load_spec

__all__ = ["Run", "Spec", "Sweep", "load_spec", "main", "run_status"]
