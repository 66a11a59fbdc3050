"""Lipschitz measurements, usable without Lightning: local estimates, lower bounds, certified bounds."""
from .local import empirical_lower_bound, jacobian_norm, jacobian_norm_one_pass

__all__ = ["empirical_lower_bound", "jacobian_norm", "jacobian_norm_one_pass"]
