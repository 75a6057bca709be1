"""Reductions: sum, mean, amax/max (over dims or everything), logsumexp, max/min over one dim
and top-k.

A split dim that is reduced leaves a Partial: each rank reduces its chunk, and the pieces
combine by the reduction (sum for sum and mean, max for max). A split dim that is kept stays
split (renumbered when dims are dropped). A Partial input passes through a reduction that
commutes with it (sums and means of Partial sums or averages, max of Partial max); otherwise it
is reduced first. ``max.dim`` and ``min.dim`` also return indices, which a chunk cannot know, so
their reduced dim is gathered; so is logsumexp's (a router's z-loss reduces over the experts,
which no layout splits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placement, Placements, Shard
from colfunc.sharding.rules.registry import OpSharding, R, Spec, rule

aten = torch.ops.aten


def _dims(x: Spec, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, Sequence) and len(dim) == 0):
        return list(range(x.ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % max(x.ndim, 1) for d in dims)


def _place(
    x: Spec, dims: list[int], keepdim: bool, combine: str | None
) -> tuple[Placements, Placements]:
    """(input placements needed, output placements); ``combine``: the Partial op a reduced split
    dim leaves, or None where the reduced dim must be whole."""
    ins: list[Placement] = []
    outs: list[Placement] = []
    passes = {"sum": ("sum", "avg"), "max": ("max",)}.get(combine or "", ())
    for p in x.placements:
        if isinstance(p, Shard) and p.dim in dims:
            if combine is None:
                ins.append(R)
                outs.append(R)
            else:
                ins.append(p)
                outs.append(Partial(combine))
        elif isinstance(p, Shard):
            ins.append(p)
            outs.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in dims)))
        elif isinstance(p, Partial) and p.op not in passes:
            ins.append(R)
            outs.append(R)
        else:
            ins.append(p)
            outs.append(p)
    return tuple(ins), tuple(outs)


def _split_reduced(x: Spec, dims: list[int], pl: Placements) -> bool:
    return any(isinstance(p, Shard) and p.dim in dims for p in pl)


@rule(aten.sum)
def sum_(x: Spec, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> OpSharding:
    ins, outs = _place(x, _dims(x, dim), keepdim, "sum")
    return OpSharding(outputs=outs, inputs=[ins])


@rule(aten.mean)
def mean(x: Spec, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> OpSharding:
    dims = _dims(x, dim)
    ins, outs = _place(x, dims, keepdim, "sum")
    if not _split_reduced(x, dims, ins):
        return OpSharding(outputs=outs, inputs=[ins])
    # uneven chunks would weigh their means unequally: sum locally, divide by the global count
    count = 1
    for d in dims:
        count *= x.shape[d]

    def compute(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.sum(t, dims, keepdim, dtype=dtype) / count

    return OpSharding(outputs=outs, inputs=[ins], compute=compute)


def _amax_local(dims: list[int], keepdim: bool) -> Any:
    def compute(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if all(t.shape[d] > 0 for d in dims):
            return torch.amax(t, dims, keepdim)
        # an empty chunk's maximum is the identity of max
        shape = [1 if d in dims else n for d, n in enumerate(t.shape) if keepdim or d not in dims]
        low = -torch.inf if t.is_floating_point() else torch.iinfo(t.dtype).min
        return t.new_full(shape, low)

    return compute


@rule(aten.amax)
def amax(x: Spec, dim: Any = (), keepdim: bool = False) -> OpSharding:
    dims = _dims(x, dim)
    ins, outs = _place(x, dims, keepdim, "max")
    return OpSharding(outputs=outs, inputs=[ins], compute=_amax_local(dims, keepdim))


@rule(aten.logsumexp)
def logsumexp(x: Spec, dim: Any, keepdim: bool = False) -> OpSharding:
    ins, outs = _place(x, _dims(x, dim), keepdim, None)
    return OpSharding(outputs=outs, inputs=[ins])


@rule(aten.max.default)
def max_all(x: Spec) -> OpSharding:
    ins, outs = _place(x, list(range(x.ndim)), False, "max")
    return OpSharding(outputs=outs, inputs=[ins], compute=_amax_local(list(range(x.ndim)), False))


@rule(aten.max.dim, aten.min.dim)
def max_dim(x: Spec, dim: int, keepdim: bool = False) -> OpSharding:
    ins, outs = _place(x, _dims(x, dim), keepdim, None)
    return OpSharding(outputs=(outs, outs), inputs=[ins])


@rule(aten.topk)
def topk(x: Spec, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> OpSharding:
    """The ``k`` largest along ``dim``, which a chunk cannot know: that dim whole, the others
    as they are (keepdim: the dim stays, ``k`` long)."""
    ins, outs = _place(x, _dims(x, dim), True, None)
    return OpSharding(outputs=(outs, outs), inputs=[ins])
