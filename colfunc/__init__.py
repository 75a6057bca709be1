"""colfunc: large-model training as composable transforms of a pure training step, on PyTorch."""

from colfunc import (
    adapters,
    checkpoint,
    config,
    data,
    diffusion,
    hf,
    memory,
    models,
    nn,
    ops,
    optim,
    random,
    sharding,
    testing,
    transforms,
    tree,
)
from colfunc.adapters import lora
from colfunc.core import Layered, P, layered, scan_layers
from colfunc.sharding import Mesh, launch, shard_map
from colfunc.step import Step, TrainState, full_state, train_step
from colfunc.transforms import amp, offload, pipeline, remat, shard, zero

__version__ = "0.1.0"

__all__ = [
    "Layered",
    "Mesh",
    "P",
    "Step",
    "TrainState",
    "adapters",
    "amp",
    "checkpoint",
    "config",
    "data",
    "diffusion",
    "full_state",
    "hf",
    "launch",
    "layered",
    "lora",
    "memory",
    "models",
    "nn",
    "offload",
    "ops",
    "optim",
    "pipeline",
    "random",
    "remat",
    "scan_layers",
    "shard",
    "shard_map",
    "sharding",
    "testing",
    "train_step",
    "transforms",
    "tree",
    "zero",
]
