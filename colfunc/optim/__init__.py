"""Optimizers in the optax shape, with PyTorch's argument names and defaults."""

from colfunc.optim.base import GradientTransformation, Schedule, apply_updates, chain

__all__ = ["GradientTransformation", "Schedule", "apply_updates", "chain"]
