"""Tensors made from another tensor's metadata: the ``*_like`` and ``new_*`` factories, and copy.

``zeros_like(x)`` keeps ``x``'s splits (each rank makes its shard's shape) but never its
Partial: a Partial of ones would sum to the number of ranks. ``x.new_zeros(size)`` likewise when
``size`` is ``x``'s shape (autograd builds gradient buffers so), else a replicated tensor. A copy
into ``x`` takes ``x``'s placements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placements
from colfunc.sharding.rules.registry import OpSharding, R, Spec, rule

aten = torch.ops.aten


@rule(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
def like(x: Spec, *args: Any, **kwargs: Any) -> Placements:
    return tuple(R if isinstance(p, Partial) else p for p in x.placements)


@rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
def new(x: Spec, size: Sequence[int], *args: Any, **kwargs: Any) -> OpSharding:
    if tuple(size) != x.shape:
        return OpSharding(outputs=(R,) * len(x.placements))
    pl = like(x)
    return OpSharding(outputs=pl, args=(x, x.local_shape(pl), *args), kwargs=kwargs)


@rule(aten.new_empty_strided)
def new_empty_strided(
    x: Spec, size: Sequence[int], stride: Sequence[int], **kwargs: Any
) -> OpSharding:
    if tuple(size) != x.shape:
        return OpSharding(outputs=(R,) * len(x.placements))
    # the global strides describe the wrapper; a shard is laid out contiguously
    pl = like(x)
    shape = x.local_shape(pl)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return OpSharding(outputs=pl, args=(x, shape, strides), kwargs=kwargs)


@rule(aten.copy)
def copy(self: Spec, src: Spec, non_blocking: bool = False) -> OpSharding:
    # the copy takes self's placements, unless src broadcasts (then each piece would be src)
    pl = self.placements if src.shape == self.shape else (R,) * len(self.placements)
    return OpSharding(outputs=pl, inputs=[pl, pl])
