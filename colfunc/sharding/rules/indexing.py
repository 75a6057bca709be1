"""Indexing along one dim: index_select (and index_add, its backward), gather, scatter; and
advanced indexing ``x[..., idx, ...]`` by one block of adjacent index tensors.

The other dims pass their splits through. The indexed dim of the source may be split: then
index_select is a masked lookup (zeros for indices another rank holds) leaving a Partial sum,
as for a vocabulary-parallel embedding. Linear in the tensor being indexed or written, so
Partial passes through where the indices are replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding.placement import Partial, Shard
from colfunc.sharding.rules.embedding import masked_lookup
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten
LINEAR = ("sum", "avg")


def _other_dims(x: Spec, dim: int, *same: Spec) -> list[int]:
    """Dims of ``x`` other than ``dim`` where every tensor in ``same`` has the same size."""
    return [d for d in range(x.ndim) if d != dim and all(s.shape[d] == x.shape[d] for s in same)]


@rule(aten.index_select)
def index_select(x: Spec, dim: int, index: Spec) -> OpSharding:
    dim = dim % max(x.ndim, 1)
    opts: list[Option] = [(R, (R, R)), (Shard(dim), (R, Shard(0)))]
    opts += [(Shard(d), (Shard(d), R)) for d in range(x.ndim) if d != dim]
    opts += [(Partial("sum"), (Shard(dim), R))]
    opts += [(Partial(op), (Partial(op), R)) for op in LINEAR]
    choice = pick([x, index], opts, out_numel=x.numel // max(x.shape[dim], 1) * index.numel)
    assert choice.inputs is not None and choice.inputs[0] is not None
    source = choice.inputs[0]
    if Shard(dim) not in source:
        return choice
    offset = x.shard_range(dim, source)[0]

    def compute(t: torch.Tensor, d: int, i: torch.Tensor) -> torch.Tensor:
        out = masked_lookup(t.movedim(d, 0), i, 0, offset, lambda s, j: s.index_select(0, j))
        return out.movedim(0, d)

    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)


@rule(aten.index.Tensor)
def index(x: Spec, indices: Any) -> OpSharding:
    """``x[indices]`` with index tensors on adjacent dims: a split dim outside them stays split
    (shifted by the index tensors' rank), the index tensors whole."""
    at = [d for d, t in enumerate(indices) if t is not None]
    given = [t for t in indices if t is not None]
    whole: tuple[Any, ...] = (R,) * len(given)
    opts: list[Option] = [(R, (R, *whole))]
    if at == list(range(at[0], at[-1] + 1)):
        rank = max(t.ndim for t in given)
        for d in range(x.ndim):
            if d < at[0]:
                opts.append((Shard(d), (Shard(d), *whole)))
            elif d > at[-1]:
                opts.append((Shard(d - len(at) + rank), (Shard(d), *whole)))
    return pick([x, *given], opts)


@rule(aten.index_add)
def index_add(x: Spec, dim: int, index: Spec, source: Spec, *, alpha: Any = 1) -> OpSharding:
    dim = dim % max(x.ndim, 1)
    opts: list[Option] = [(R, (R, R, R))]
    opts += [(Shard(d), (Shard(d), R, Shard(d))) for d in _other_dims(x, dim, source)]
    opts += [(Partial(op), (Partial(op), R, Partial(op))) for op in LINEAR]
    return pick([x, index, source], opts, out_numel=x.numel)


@rule(aten.gather)
def gather(x: Spec, dim: int, index: Spec, *, sparse_grad: bool = False) -> OpSharding:
    dim = dim % max(x.ndim, 1)
    opts: list[Option] = [(R, (R, R))]
    opts += [(Shard(d), (Shard(d), Shard(d))) for d in _other_dims(x, dim, index)]
    opts += [(Partial(op), (Partial(op), R)) for op in LINEAR]
    return pick([x, index], opts, out_numel=index.numel)


@rule(aten.scatter)
def scatter(
    x: Spec, dim: int, index: Spec, src: Any = None, *rest: Any, **kwargs: Any
) -> OpSharding:
    dim = dim % max(x.ndim, 1)
    specs = [x, index] + ([src] if isinstance(src, Spec) else [])
    opts: list[Option] = [(R, [R] * len(specs))]
    opts += [(Shard(d), [Shard(d)] * len(specs)) for d in _other_dims(x, dim, *specs[1:])]
    if isinstance(src, Spec) and not rest and not kwargs:  # linear in (x, src) together
        opts += [(Partial(op), (Partial(op), R, Partial(op))) for op in LINEAR]
    return pick(specs, opts, out_numel=x.numel)
