"""Emitting a sweep for other machines or schedulers: one ``stability sweep FILE --only RUN`` command
per run (the same bookkeeping wherever it runs). SLURM clusters: ``--submit slurm`` (submitit)."""
from __future__ import annotations

import sys
from pathlib import Path

from .spec import Run


def write_commands(root: Path, runs: list[Run], spec_path: Path) -> Path:
    """``commands.txt``: one ``stability sweep SPEC --only RUN`` line per run."""
    root.mkdir(parents=True, exist_ok=True)
    lines = [" ".join([sys.executable, "-m", "stability", "sweep", str(spec_path), "--sweeps_dir",
                       str(root.parent), "--only", _quote(run.name)]) for run in runs]
    commands = root / "commands.txt"
    commands.write_text("\n".join(lines) + "\n")
    return commands


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
