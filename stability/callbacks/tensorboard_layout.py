"""What a run shows in TensorBoard besides its scalars: the HParams tab (every setting of the
run, tied to its final ``hp/val_acc``, ``hp/val_loss`` and ``hp/diverged_at_step``) and the Custom
Scalars tab (clean and robust accuracy, Lipschitz estimates and stability signals overlaid)."""
from __future__ import annotations

from typing import Any

import lightning as L

from .. import tags

CUSTOM_SCALARS = {
    "accuracy": {"clean and robust": ["Multiline", [r"val/acc", rf"{tags.ROBUST}/.*"]],
                 "certified": ["Multiline", [rf"{tags.CERTIFIED}/acc_.*"]],
                 "train": ["Multiline", [tags.TRAIN_ACC]]},
    "lipschitz": {"local estimate": ["Multiline", [rf"{tags.LIPSCHITZ}/local_.*"]],
                  "bounds": ["Multiline", [rf"{tags.LIPSCHITZ}/lower_bound_max", rf"{tags.LIPSCHITZ}/certified_.*"]]},
    "stability": {"loss terms": ["Multiline", [tags.per_step(tags.TRAIN_LOSS), r"loss/.*_step"]],
                  "gradient norms": ["Multiline", [rf"{tags.GRAD_NORM}.*"]],
                  "max |activation|": ["Multiline", [rf"{tags.ACT_MAX}/.*"]],
                  "max attention logit": ["Multiline", [rf"{tags.ATTN_LOGIT_MAX}/.*"]],
                  "attention entropy": ["Multiline", [rf"{tags.ATTN_ENTROPY}/.*"]],
                  "output log Z": ["Multiline", [tags.LOG_Z]],
                  "spikes": ["Multiline", [tags.LOSS_SPIKES, tags.DIVERGED_AT_STEP]],
                  "stabilizers": ["Multiline", [r"stability/(?!grad_norm|act_max|attn_logit_max|attn_entropy|log_z"
                                                r"|loss_spikes|diverged_at_step).+"]]},
}


def run_hparams(pl_module: L.LightningModule, datamodule: L.LightningDataModule | None) -> dict[str, Any]:
    """Flat hyperparameters: the module's, the selected stabilizers' options, the data's — the settings a user
    chose, without the entries LightningCLI adds for itself (``_instantiator``, ``_class_path``)."""
    params = {k: v for k, v in pl_module.hparams.items()
              if k not in ("stabilizer", "stabilizer_options") and not k.startswith("_")}
    params["stabilizer"] = "+".join(s.name for s in pl_module.stabilizers)
    for stab in pl_module.stabilizers:
        params.update({f"{stab.name}.{k}": v for k, v in stab.hparams().items()})
    if datamodule is not None:
        params.update({f"data.{k}": v for k, v in datamodule.hparams.items() if not k.startswith("_")})
        params["data"] = datamodule.name
    return params


class TensorBoardLayout(L.Callback):
    """Writes the HParams and Custom Scalars layouts at the start of fit, and ``hp/val_acc`` /
    ``hp/val_loss`` after every validation."""

    def on_fit_start(self, trainer, pl_module) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, L.pytorch.loggers.TensorBoardLogger):
                logger.log_hyperparams(run_hparams(pl_module, getattr(trainer, "datamodule", None)),
                                       {tags.HP_VAL_ACC: 0.0, tags.HP_VAL_LOSS: 0.0, tags.HP_DIVERGED_AT_STEP: -1})
                if trainer.is_global_zero:
                    logger.experiment.add_custom_scalars(CUSTOM_SCALARS)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        for tag, source in ((tags.HP_VAL_ACC, "val/acc"), (tags.HP_VAL_LOSS, "val/loss")):
            if source in metrics:
                pl_module.log(tag, metrics[source], sync_dist=True)
