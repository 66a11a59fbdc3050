"""Thin Lightning callbacks around stability.lipschitz, stability.robustness and the stability signals."""
from .lipschitz_monitor import LipschitzMonitor
from .robustness_monitor import RobustnessMonitor
from .training_stability import DivergenceDetector, TrainingStability

__all__ = ["DivergenceDetector", "LipschitzMonitor", "RobustnessMonitor", "TrainingStability"]
