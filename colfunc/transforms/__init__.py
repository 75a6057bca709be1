"""Transforms of a training step: each a ``Step -> Step`` that replaces only the pieces it owns."""

from colfunc.transforms.amp import amp
from colfunc.transforms.offload import offload
from colfunc.transforms.pipeline import pipeline
from colfunc.transforms.remat import remat
from colfunc.transforms.shard import shard
from colfunc.transforms.zero import zero

__all__ = ["amp", "offload", "pipeline", "remat", "shard", "zero"]
