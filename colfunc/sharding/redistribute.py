"""Redistribution of a local shard between any two placements, one mesh axis at a time.

Each axis whose placement changes takes one collective from :mod:`colfunc.sharding.comm` (so the
ledger counts it):

==========================  ====================================================================
Shard(i) -> Replicate        all_gather (pad to the largest chunk, gather, trim)
Shard(i) -> Shard(j)         all_to_all (padded likewise), when no other axis splits i or j
Partial -> Replicate         all_reduce
Partial -> Shard(i)          reduce_scatter (padded; ``max`` all_reduces and slices)
Replicate -> Shard(i)        a local slice, no communication
Replicate -> Partial(sum)    the value on group index 0, zeros elsewhere (avg, max: kept as is)
==========================  ====================================================================

Nesting decides the order. When several axes split one dim, an inner axis's chunk lies inside the
outer axis's, so an outer axis cannot change while an inner one still splits the same dim. The
redistribution therefore marks such inner axes as changing too, undoes shards from the innermost axis
outwards (phase 1), then builds the target from the outermost axis inwards (phase 2).

These functions work on plain local tensors and are not differentiable themselves; the autograd
functions in :mod:`colfunc.sharding.tensor` wrap them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from colfunc.sharding import comm
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import (
    Partial,
    Placement,
    Placements,
    Replicate,
    Shard,
    chunk,
    local_shape,
)

__all__ = ["redistribute_local"]


def _shard_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


def _changing_axes(src: Placements, dst: Placements) -> list[bool]:
    # An axis changes if its placement does, or if it splits a dim that an outer changing axis
    # splits before or after (its chunk must be rebuilt inside the outer axis's new chunk).
    changing: list[bool] = []
    for a, (p, q) in enumerate(zip(src, dst)):
        d = _shard_dim(p)
        forced = d is not None and any(
            changing[b] and d in (_shard_dim(src[b]), _shard_dim(dst[b])) for b in range(a)
        )
        changing.append(p != q or forced)
    return changing


def _pad(x: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    if x.shape[dim] == to:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = to - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def _parent_size(shape: Sequence[int], mesh: Mesh, cur: list[Placement], a: int, dim: int) -> int:
    """The size of ``dim`` in the chunk that axis ``a`` splits (the outer axes' chunk)."""
    outer = [*cur]
    outer[a] = Replicate()
    return local_shape(shape, mesh, tuple(outer))[dim]


def _gather(
    x: torch.Tensor, shape: Sequence[int], mesh: Mesh, cur: list[Placement], a: int
) -> torch.Tensor:
    dim = _shard_dim(cur[a])
    assert dim is not None
    axis = mesh.axis_names[a]
    n = _parent_size(shape, mesh, cur, a, dim)
    c = -(-n // mesh.axis_size(axis))
    # torch.chunk leaves padding only after the last non-empty chunk's data, so the first n
    # gathered elements are exactly the dim in order.
    return comm.all_gather(_pad(x, dim, c), axis, dim, mesh).narrow(dim, 0, n)


def _slice(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    off, size = chunk(x.shape[dim], mesh.axis_size(axis), mesh.coords[axis])
    return x.narrow(dim, off, size).clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: torch.Tensor, mesh: Mesh, axis: str, dim: int, op: str) -> torch.Tensor:
    k, n = mesh.axis_size(axis), x.shape[dim]
    if op == "max":
        return _slice(comm.all_reduce(x, axis, "max", mesh), mesh, axis, dim)
    c = -(-n // k)
    out = comm.reduce_scatter(_pad(x, dim, k * c), axis, dim, op, mesh)
    return out.narrow(dim, 0, chunk(n, k, mesh.coords[axis])[1])


def _all_to_all(
    x: torch.Tensor, shape: Sequence[int], mesh: Mesh, cur: list[Placement], a: int, j: int
) -> torch.Tensor:
    """Shard(i) -> Shard(j) on axis ``a``; no other axis splits dim i or j."""
    i = _shard_dim(cur[a])
    assert i is not None
    axis = mesh.axis_names[a]
    k = mesh.axis_size(axis)
    ni, nj = _parent_size(shape, mesh, cur, a, i), x.shape[j]
    ci, cj = -(-ni // k), -(-nj // k)
    y = comm.all_to_all(_pad(_pad(x, i, ci), j, k * cj), axis, j, i, mesh)
    # the chunks received along i are padded to ci each; as in _gather, the first ni are the data
    return y.narrow(i, 0, ni).narrow(j, 0, chunk(nj, k, mesh.coords[axis])[1]).contiguous()


def _to_partial(x: torch.Tensor, mesh: Mesh, axis: str, op: str) -> torch.Tensor:
    # avg and max of identical pieces are the value itself; a sum needs it exactly once.
    if op == "sum" and mesh.coords[axis] != 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return x


def redistribute_local(
    x: torch.Tensor, shape: Sequence[int], mesh: Mesh, src: Placements, dst: Placements
) -> torch.Tensor:
    """This rank's local part under ``dst`` of the tensor whose local part under ``src`` is ``x``.

    ``shape`` is the global shape. Every rank of the mesh must call this with the same arguments
    except ``x`` (the collectives run on the axes that change).
    """
    if src == dst:
        return x
    names = mesh.axis_names
    changing = _changing_axes(src, dst)
    cur = list(src)

    def splits_elsewhere(a: int, dim: int) -> bool:
        return any(
            b != a and dim in (_shard_dim(cur[b]), _shard_dim(dst[b])) for b in range(len(names))
        )

    for a in reversed(range(len(names))):  # phase 1: undo shards, innermost axis first
        p, q = cur[a], dst[a]
        if not changing[a] or not isinstance(p, Shard):
            continue
        if (
            isinstance(q, Shard)
            and q != p
            and not (splits_elsewhere(a, p.dim) or splits_elsewhere(a, q.dim))
        ):
            x, cur[a] = _all_to_all(x, shape, mesh, cur, a, q.dim), q
        else:
            x, cur[a] = _gather(x, shape, mesh, cur, a), Replicate()

    # averages commute with sums: an average reduced into replicas or shards is reduced as a
    # sum, and the exact total divided once at the end (an average taken first divides each
    # rank's piece, and rounds)
    factor = 1
    if all(p.op in ("sum", "avg") for p in cur if isinstance(p, Partial)):
        for a in range(len(names)):
            if cur[a] == Partial("avg") and not isinstance(dst[a], Partial):
                cur[a] = Partial("sum")
                factor *= mesh.axis_size(names[a])
    for a in range(len(names)):  # phase 2: build the target, outermost axis first
        p, q, axis = cur[a], dst[a], names[a]
        if p == q:
            continue
        if isinstance(p, Partial):
            if isinstance(q, Shard):
                x, cur[a] = _reduce_scatter(x, mesh, axis, q.dim, p.op), q
                continue
            x = comm.all_reduce(x.contiguous(), axis, p.op, mesh)
        if isinstance(q, Shard):
            x = _slice(x, mesh, axis, q.dim)
        elif isinstance(q, Partial):
            x = _to_partial(x, mesh, axis, q.op)
        cur[a] = q
    return x / factor if factor != 1 else x
