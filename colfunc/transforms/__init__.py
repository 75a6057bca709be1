"""Transforms of a training step: each a ``Step -> Step`` that replaces only the pieces it owns."""

from colfunc.transforms.amp import amp
from colfunc.transforms.remat import remat

__all__ = ["amp", "remat"]
