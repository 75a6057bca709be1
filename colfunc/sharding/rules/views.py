"""Views and reshapes: view/reshape, expand, transpose/permute, (un)squeeze, slice/select (and
their backward), split/unbind, cat/stack.

A split dim keeps its split when it survives the op whole: renumbered by transposes and
(un)squeezes, carried through slices and splits of *other* dims, and through a slice of the
split dim itself when each rank's part of the slice is its chunk of the result (``x[:, :-1]`` of
a sequence split in equal chunks: the last rank drops its last position). A reshape maps groups
of input dims onto groups of output dims (``[B, T, H*E] -> [B, T, H, E]``: the group
``(H*E) -> (H, E)``); a split on the group's major dim carries over to the major output dim when
every rank's chunk boundaries fall on the same elements, which for a head split means whole heads
per rank (H divisible by the axis size). Anything else is gathered first. Partial passes through
all of them: they only move elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.placement import (
    Partial,
    Placement,
    Placements,
    Shard,
    dim_chunks,
    local_shape,
    shard_range,
)
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten


def _norm(d: int, n: int) -> int:
    return d % max(n, 1)


def _remap(x: Spec, where: dict[int, int | None]) -> tuple[Placements, Placements]:
    """Move each split dim ``d`` to ``where[d]`` (None: the dim cannot stay split: gather it)."""
    ins: list[Placement] = []
    outs: list[Placement] = []
    for p in x.placements:
        if isinstance(p, Shard):
            new = where.get(p.dim, p.dim)
            ins.append(p if new is not None else R)
            outs.append(Shard(new) if new is not None else R)
        else:
            ins.append(p)
            outs.append(p)
    return tuple(ins), tuple(outs)


def _local_size_call(
    x: Spec, out_shape: Sequence[int], ins: Placements, outs: Placements, fn: Any
) -> OpSharding:
    """A OpSharding whose local call is ``fn(local, local output shape)``."""
    size = local_shape(out_shape, x.mesh, outs)

    def compute(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fn(t, size)

    return OpSharding(outputs=outs, inputs=[ins], compute=compute)


# --- reshape ----------------------------------------------------------------------------------


def _infer(shape: Sequence[int], numel: int) -> list[int]:
    out = list(shape)
    if -1 in out:
        rest = math.prod(s for s in out if s != -1)
        out[out.index(-1)] = numel // rest if rest else 0
    return out


def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of shape ``a`` with runs of dims of shape ``b`` of equal product."""
    if 0 in a or 0 in b:
        return [(list(range(len(a))), list(range(len(b))))]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j == len(b) or b[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i == len(a) or a[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(i)
                pa *= a[i]
                i += 1
            else:
                outs.append(j)
                pb *= b[j]
                j += 1
        groups.append((ins, outs))
    return groups


def _reshape_target(x: Spec, out_shape: list[int], dim: int) -> int | None:
    """Where a split of input ``dim`` goes in ``out_shape``, or None if it cannot stay split."""
    for ins, outs in view_groups(x.shape, out_shape):
        if dim not in ins:
            continue
        major_in = next((d for d in ins if x.shape[d] > 1), None)
        major_out = next((d for d in outs if out_shape[d] > 1), None)
        if dim != major_in or major_out is None:
            return None
        sizes = [x.mesh.axis_size(a) for a in x.axes_on(dim)]
        rest_in = math.prod(x.shape[d] for d in ins if d > dim)
        rest_out = math.prod(out_shape[d] for d in outs if d > major_out)
        chunks_in = [(o * rest_in, s * rest_in) for o, s in dim_chunks(x.shape[dim], sizes)]
        chunks_out = [
            (o * rest_out, s * rest_out) for o, s in dim_chunks(out_shape[major_out], sizes)
        ]
        return major_out if chunks_in == chunks_out else None
    return None


@rule(aten.view, aten._unsafe_view, aten.reshape)
def view(x: Spec, size: Sequence[int]) -> OpSharding:
    out_shape = _infer(size, x.numel)
    split = {p.dim for p in x.placements if isinstance(p, Shard)}
    ins, outs = _remap(x, {d: _reshape_target(x, out_shape, d) for d in split})
    return _local_size_call(x, out_shape, ins, outs, lambda t, s: t.reshape(s))


# --- dims renumbered --------------------------------------------------------------------------


@rule(aten.transpose.int)
def transpose(x: Spec, dim0: int, dim1: int) -> Placements:
    d0, d1 = _norm(dim0, x.ndim), _norm(dim1, x.ndim)
    return _remap(x, {d0: d1, d1: d0})[1]


@rule(aten.t)
def t(x: Spec) -> Placements:
    return _remap(x, {0: 1, 1: 0} if x.ndim == 2 else {})[1]


@rule(aten.permute)
def permute(x: Spec, dims: Sequence[int]) -> Placements:
    order = [_norm(d, x.ndim) for d in dims]
    return _remap(x, {d: order.index(d) for d in range(x.ndim)})[1]


@rule(aten.unsqueeze)
def unsqueeze(x: Spec, dim: int) -> Placements:
    dim = _norm(dim, x.ndim + 1)
    return _remap(x, {d: d + (d >= dim) for d in range(x.ndim)})[1]


@rule(aten.squeeze)
def squeeze(x: Spec, dim: Any = None) -> OpSharding:
    asked = range(x.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    gone = sorted({_norm(d, x.ndim) for d in asked if x.shape[_norm(d, x.ndim)] == 1})
    ins, outs = _remap(
        x, {d: None if d in gone else d - sum(g < d for g in gone) for d in range(x.ndim)}
    )

    def compute(t: torch.Tensor, *args: Any) -> torch.Tensor:
        # by the global size-1 dims: a chunk of a longer split dim may also have size 1
        return t.squeeze(tuple(gone)) if gone else t.view_as(t)

    return OpSharding(outputs=outs, inputs=[ins], compute=compute)


@rule(aten.expand)
def expand(x: Spec, size: Sequence[int], *, implicit: bool = False) -> OpSharding:
    lead = len(size) - x.ndim
    out_shape = [x.shape[d - lead] if s == -1 else s for d, s in enumerate(size)]
    where = {d: None if x.shape[d] != out_shape[d + lead] else d + lead for d in range(x.ndim)}
    ins, outs = _remap(x, where)
    return _local_size_call(x, out_shape, ins, outs, lambda t, s: t.expand(s))


# --- one dim cut: that dim must be whole, or its chunks survive the cut -----------------------


def _bounds(n: int, start: Any, end: Any) -> tuple[int, int]:
    """``[start, end)`` of a unit-step slice of ``n`` elements, as Python slicing reads them."""
    lo, hi, _ = slice(start, end).indices(n)
    return lo, max(lo, hi)


def _cut_keeps_chunks(n: int, lo: int, hi: int, sizes: Sequence[int]) -> bool:
    """Whether every rank's part of ``[lo, hi)`` of a dim of ``n`` split by axes of ``sizes`` is
    its chunk of the ``hi - lo`` elements (``[:, :-1]`` of a sequence split in equal chunks is:
    only the last rank's chunk is one shorter)."""
    for (o, s), (o2, s2) in zip(dim_chunks(n, sizes), dim_chunks(hi - lo, sizes)):
        a, b = max(o, lo), min(o + s, hi)
        if max(b - a, 0) != s2 or (s2 and a - lo != o2):
            return False
    return True


def _local_cut(mesh: Any, n: int, pl: Placements, dim: int, lo: int, hi: int) -> tuple[int, int]:
    """This rank's part of ``[lo, hi)`` of the split dim, in local coordinates."""
    o, s = shard_range(n, mesh, pl, dim)
    a = min(max(lo - o, 0), s)
    return a, max(a, min(hi - o, s))


@rule(aten.slice.Tensor)
def slice_(x: Spec, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> OpSharding:
    dim = _norm(dim, x.ndim)
    lo, hi = _bounds(x.shape[dim], start, end)
    sizes = [x.mesh.axis_size(a) for a in x.axes_on(dim)]
    if step == 1 and sizes and _cut_keeps_chunks(x.shape[dim], lo, hi, sizes):
        a, b = _local_cut(x.mesh, x.shape[dim], x.placements, dim, lo, hi)
        return OpSharding(outputs=x.placements, compute=lambda t, *args: t.narrow(dim, a, b - a))
    ins, outs = _remap(x, {dim: None})
    return OpSharding(outputs=outs, inputs=[ins])


@rule(aten.select.int)
def select(x: Spec, dim: int, index: int) -> OpSharding:
    dim = _norm(dim, x.ndim)
    ins, outs = _remap(x, {d: None if d == dim else d - (d > dim) for d in range(x.ndim)})
    return OpSharding(outputs=outs, inputs=[ins])


@rule(aten.slice_backward)
def slice_backward(
    g: Spec, input_sizes: Sequence[int], dim: int, start: int, end: int, step: int
) -> OpSharding:
    dim = _norm(dim, g.ndim)
    n = input_sizes[dim]
    lo, hi = _bounds(n, start, end)
    sizes = [g.mesh.axis_size(a) for a in g.axes_on(dim)]
    if step == 1 and sizes and _cut_keeps_chunks(n, lo, hi, sizes):
        a, b = _local_cut(g.mesh, n, g.placements, dim, lo, hi)
        size = local_shape(input_sizes, g.mesh, g.placements)
        return OpSharding(outputs=g.placements, args=(g, size, dim, a, b, 1))
    ins, outs = _remap(g, {dim: None})
    size = local_shape(input_sizes, g.mesh, outs)
    return OpSharding(outputs=outs, inputs=[ins], args=(g, size, dim, start, end, step))


@rule(aten.select_backward)
def select_backward(g: Spec, input_sizes: Sequence[int], dim: int, index: int) -> OpSharding:
    dim = _norm(dim, len(input_sizes))
    ins, outs = _remap(g, {d: d + (d >= dim) for d in range(g.ndim)})
    size = local_shape(input_sizes, g.mesh, outs)
    return OpSharding(outputs=outs, inputs=[ins], args=(g, size, dim, index))


@rule(aten.split.Tensor, aten.split_with_sizes)
def split(x: Spec, sizes: Any, dim: int = 0) -> OpSharding:
    ins, outs = _remap(x, {_norm(dim, x.ndim): None})
    return OpSharding(outputs=outs, inputs=[ins])


@rule(aten.unbind.int)
def unbind(x: Spec, dim: int = 0) -> OpSharding:
    dim = _norm(dim, x.ndim)
    ins, outs = _remap(x, {d: None if d == dim else d - (d > dim) for d in range(x.ndim)})
    return OpSharding(outputs=outs, inputs=[ins])


# --- several tensors joined -------------------------------------------------------------------


def _join_options(specs: list[Spec], dim: int, new_dim: bool) -> list[Option]:
    n = specs[0].ndim
    opts: list[Option] = [(R, [R] * len(specs))]
    for d in range(n):
        if d != dim or new_dim:
            out = d + (new_dim and d >= dim)
            opts.append((Shard(out), [Shard(d)] * len(specs)))
    for op in ("sum", "avg"):
        opts.append((Partial(op), [Partial(op)] * len(specs)))
    return opts


@rule(aten.cat)
def cat(tensors: Sequence[Spec], dim: int = 0) -> OpSharding:
    # legacy: 1-D empty tensors are skipped by cat whatever the others' shapes
    specs = [s for s in tensors if s.shape != (0,)] or list(tensors)
    total = sum(s.numel for s in specs)
    choice = pick(specs, _join_options(specs, _norm(dim, specs[0].ndim), False), out_numel=total)
    assert choice.inputs is not None
    want, kept = iter(choice.inputs), {id(s) for s in specs}
    return OpSharding(
        outputs=choice.outputs, inputs=[next(want) if id(s) in kept else None for s in tensors]
    )


@rule(aten.stack)
def stack(tensors: Sequence[Spec], dim: int = 0) -> OpSharding:
    specs = list(tensors)
    total = sum(s.numel for s in specs)
    return pick(specs, _join_options(specs, _norm(dim, specs[0].ndim + 1), True), out_numel=total)
