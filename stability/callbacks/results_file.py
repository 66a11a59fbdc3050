"""``results.json``: one machine-readable record of a test run, in the spirit of RobustBench's
model-info files, written beside the checkpoint that was tested (or into the run directory).

It holds the clean test accuracy; per attack, norm and ε the robust accuracy and the number of
points; the worst case over attacks per budget; certified accuracy with the certified bound and its
label; local-Lipschitz statistics; the architecture, the stabilizers and their options, the data;
and the command, seed and library versions. ``stability report`` reads it where present.
"""
from __future__ import annotations

import json
import shlex
import sys
from importlib.metadata import version
from typing import Any

import lightning as L

from .. import tags
from .lipschitz_monitor import LipschitzMonitor
from .measuring import results_path
from .robustness_monitor import RobustnessMonitor


class TestResults(L.Callback):
    """Writes ``results.json`` at the end of every test (on the first process only)."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A test stopped by SIGTERM during a measurement still says what it measured (``complete``: false)."""
        monitors = [c for c in trainer.callbacks if isinstance(c, (RobustnessMonitor, LipschitzMonitor))]
        if trainer.testing and any(m.last_results.get("test", {}).get("complete") is False for m in monitors):
            self.on_test_end(trainer, pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        path = results_path(trainer)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record(trainer, pl_module), indent=1, default=str) + "\n")

    @staticmethod
    def record(trainer, pl_module) -> dict[str, Any]:
        metrics = trainer.callback_metrics
        accuracy = metrics.get(tags.stage_metric("test", "acc"))
        robustness = next((c for c in trainer.callbacks if isinstance(c, RobustnessMonitor)), None)
        lipschitz = next((c for c in trainer.callbacks if isinstance(c, LipschitzMonitor)), None)
        hparams = dict(pl_module.hparams)
        datamodule = getattr(trainer, "datamodule", None)
        records = [m.last_results.get("test") for m in (robustness, lipschitz) if m is not None]
        return {
            "complete": not any(r and r.get("complete") is False for r in records),
            "clean_accuracy": None if accuracy is None else float(accuracy),
            "test_points": _test_points(trainer),
            "robustness": (robustness.last_results.get("test") if robustness else None),
            "lipschitz": (lipschitz.last_results.get("test") if lipschitz else None),
            "model": {k: v for k, v in hparams.items() if k not in ("stabilizer", "stabilizer_options")},
            "stabilizers": {s.name: s.hparams() for s in pl_module.stabilizers},
            "data": None if datamodule is None else {"name": datamodule.name, **dict(datamodule.hparams)},
            "checkpoint": str(trainer.ckpt_path) if trainer.ckpt_path else None,
            "precision": str(trainer.precision),
            "processes": trainer.world_size,
            "command": shlex.join(sys.argv),
            "versions": {name: version(name) for name in ("torch", "timm", "lightning", "pyautoattack",
                                                          "torchattacks")},
        }


def _test_points(trainer) -> int | None:
    loaders = trainer.test_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return len(loader.dataset) if loader is not None else None
