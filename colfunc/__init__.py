"""colfunc: large-model training as composable transforms of a pure training step, on PyTorch."""

from colfunc import ops, optim, random, tree
from colfunc.core import Layered, P, layered, scan_layers
from colfunc.step import Step, TrainState, full_state, train_step

__version__ = "0.1.0"

__all__ = [
    "Layered",
    "P",
    "Step",
    "TrainState",
    "full_state",
    "layered",
    "ops",
    "optim",
    "random",
    "scan_layers",
    "train_step",
    "tree",
]
