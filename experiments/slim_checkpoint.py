"""A checkpoint to publish: the weights, the model's and data's hyperparameters and the training progress, without
the optimizer's and schedulers' states (twice the weights again, needed only to resume training) — what
`stability test --ckpt_path` reads to re-measure a model, as RobustBench lets people re-measure its models.

    python experiments/slim_checkpoint.py runs/sweeps/certified_long/seed=0/checkpoints/last.ckpt \\
        results/certified_transformers/certified_transformer.ckpt
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

KEPT = ("state_dict", "hyper_parameters", "datamodule_hyper_parameters", "epoch", "global_step",
        "pytorch-lightning_version")


def slim(source: Path, target: Path) -> dict:
    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    kept = {key: checkpoint[key] for key in KEPT if key in checkpoint}
    if "state_dict" not in kept:
        raise ValueError(f"{source}: not a Lightning checkpoint (no state_dict)")
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(kept, target)
    return kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("target", type=Path)
    args = p.parse_args()
    kept = slim(args.source, args.target)
    size = args.target.stat().st_size / 2 ** 20
    print(f"wrote {args.target} ({size:.2f} MiB; epoch {kept.get('epoch')}, step {kept.get('global_step')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
