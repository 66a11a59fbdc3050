"""Certified training: the losses that train margins a Lipschitz bound certifies (GloRo, EMMA, Lipschitz margin)
and the schedule of the radius they ask for. The stabilizers ``gloro``, ``emma`` and ``lipschitz_margin`` use them;
the model's bound reaches them through :class:`~stability.lipschitz.training_bound.TrainingBound`."""
from .losses import EMMA_FLOOR, MarginBound, bottom_kl, emma_logits, emma_loss, gloro_logits, gloro_loss, margin_logits
from .schedule import RAMPS, EpsilonSchedule, linear_weight

__all__ = ["EMMA_FLOOR", "RAMPS", "EpsilonSchedule", "MarginBound", "bottom_kl", "emma_logits", "emma_loss",
           "gloro_logits", "gloro_loss", "linear_weight", "margin_logits"]
