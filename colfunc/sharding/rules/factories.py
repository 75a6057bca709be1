"""Tensors made from another tensor's metadata: the ``*_like`` and ``new_*`` factories, and copy.

``zeros_like(x)`` keeps ``x``'s splits (each rank makes its shard's shape) but never its
Partial: a Partial of ones would sum to the number of ranks. ``new_zeros(size)`` is a new
replicated tensor of that (global) size.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placements
from colfunc.sharding.rules.registry import R, Plan, Spec, rule

aten = torch.ops.aten


@rule(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
def like(x: Spec, *args: Any, **kwargs: Any) -> Placements:
    return tuple(R if isinstance(p, Partial) else p for p in x.placements)


@rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.new_empty_strided)
def new(x: Spec, *args: Any, **kwargs: Any) -> Placements:
    return (R,) * len(x.placements)


@rule(aten.copy)
def copy(self: Spec, src: Spec, non_blocking: bool = False) -> Plan:
    # the copy takes self's placements, unless src broadcasts (then each piece would be src)
    pl = self.placements if src.shape == self.shape else (R,) * len(self.placements)
    return Plan(outputs=pl, inputs=[pl, pl])
