"""Thin Lightning callbacks around stability.lipschitz, stability.robustness and the training signals."""
from .cost import CostMeter
from .divergence import DivergenceDetector, DivergenceMonitor
from .lipschitz_monitor import LipschitzMonitor
from .results_file import TestResults
from .robustness_monitor import RobustnessMonitor
from .tensorboard_layout import TensorBoardLayout
from .timing import EpochTimer
from .training_stability import TrainingStability

__all__ = ["CostMeter", "DivergenceDetector", "DivergenceMonitor", "EpochTimer", "LipschitzMonitor",
           "RobustnessMonitor", "TensorBoardLayout", "TestResults", "TrainingStability"]
