"""How ZeRO cuts tensors into per-rank chunks, and the packed collectives that move them.

A tensor is flattened (a stacked one layer by layer), zero-padded to a multiple of ``N`` (the
axis size) and cut in ``N`` equal chunks; rank ``i`` keeps chunk ``i``. Many chunks travel in
one collective per dtype, as FSDP's flat parameters do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from colfunc.sharding import Mesh, ShardedTensor, comm, from_local
from colfunc.sharding.mesh import Axes
from colfunc.sharding.placement import Shard
from colfunc.transforms.local import local_piece, rewrap


@dataclasses.dataclass(frozen=True)
class Chunked:
    """How one parameter is cut: its local shape, the chunk length, and stacked or not."""

    shape: tuple[int, ...]
    stacked: bool  # stacked layers keep their leading axis: chunks are [L, c], one per layer
    chunk: int
    template: Any  # the ShardedTensor the parameter was (tensor parallel), else None


def cut_chunk(x: torch.Tensor, n: int, i: int, stacked: bool) -> tuple[torch.Tensor, Chunked]:
    """This rank's chunk of ``x`` (its local shard, flattened and zero-padded to ``n`` chunks)."""
    local = local_piece(x)
    template = x if isinstance(x, ShardedTensor) else None
    flat = local.detach().reshape(local.shape[0], -1) if stacked else local.detach().reshape(-1)
    size = flat.shape[-1]
    c = -(-size // n)
    # only this rank's piece is padded (never a padded copy of the whole tensor)
    piece = flat[..., min(i * c, size) : min((i + 1) * c, size)]
    chunk = torch.nn.functional.pad(piece, (0, c - piece.shape[-1]))
    return chunk, Chunked(tuple(local.shape), stacked, c, template)


def whole(flat: torch.Tensor, meta: Chunked, stacked_layer: bool = False) -> torch.Tensor:
    """Un-pad and reshape a gathered flat parameter (one layer of a stacked one if asked).

    Tensor-parallel parameters come back as ShardedTensors (differentiably, for one layer).
    """
    shape = meta.shape[1:] if stacked_layer else meta.shape
    local = flat[..., : math.prod(shape[1:] if meta.stacked and not stacked_layer else shape)]
    local = local.reshape(shape)
    t = meta.template
    if t is None:
        return local
    if not stacked_layer:
        return rewrap(t, local)
    return layer_of(t, local)


def layer_of(template: ShardedTensor, local: torch.Tensor) -> torch.Tensor:
    """``local``, this rank's piece of one layer of the stacked tensor-parallel parameter
    ``template``, as that layer's ShardedTensor (differentiably): the layer dim dropped from
    the global shape and the placements."""
    placements = [Shard(p.dim - 1) if isinstance(p, Shard) else p for p in template.placements]
    return from_local(local, template.mesh, placements, tuple(template.shape)[1:])


def is_stacked(path: str) -> bool:
    return path == "blocks" or path.startswith("blocks.")


def mesh_axes(mesh: Mesh, axes: set[str]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _by_dtype(xs: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    return groups


class StartedGather:
    """:func:`gather_flat` of a layer's chunks, started asynchronously (no autograd)."""

    def __init__(self, chunks: list[torch.Tensor], axis: str, mesh: Mesh) -> None:
        self.n, self.count = mesh.axis_size(axis), len(chunks)
        self.groups = []
        for idx in _by_dtype(chunks).values():
            sizes = [chunks[i].numel() for i in idx]
            packed = torch.cat([chunks[i].detach().reshape(-1) for i in idx])
            self.groups.append((idx, sizes, comm.all_gather_async(packed, axis, mesh)))

    def wait(self) -> list[torch.Tensor]:
        out: list[Any] = [None] * self.count
        for idx, sizes, pending in self.groups:
            full = pending.wait().view(self.n, -1)
            for i, part in zip(idx, full.split(sizes, dim=1)):
                out[i] = part.reshape(-1)
        return out


class Gathered(torch.autograd.Function):
    """The flats of a started gather, differentiably: the backward reduce-scatters the packed
    gradient (the transpose of the all_gather). A chunk that needs no gradient (a frozen
    parameter's) gives a flat that is not differentiable, and nothing of it is reduced."""

    @staticmethod
    def forward(started: StartedGather, axis: str, mesh: Mesh, *chunks: torch.Tensor) -> Any:
        return tuple(started.wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis, ctx.mesh = inputs[1], inputs[2]
        ctx.trains = [c.requires_grad for c in inputs[3:]]
        frozen = [o for o, t in zip(output, ctx.trains) if not t]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        trained = [i for i, t in enumerate(ctx.trains) if t]
        reduced = reduce_scatter_flat([grads[i] for i in trained], ctx.axis, ctx.mesh, "sum")
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(trained, reduced):
            out[i] = g
        return (None, None, None, *out)


def gather_flat(chunks: list[torch.Tensor], axis: str, mesh: Mesh) -> list[torch.Tensor]:
    """Each 1-D chunk gathered whole (``[N * c]``, rank-major), in one all_gather per dtype.

    Packing the chunks into one buffer turns one collective per parameter into one per layer,
    as FSDP's flat parameters do; the result is differentiable (the backward is one
    reduce_scatter of the packed gradient).
    """
    if not chunks:
        return []
    return list(Gathered.apply(StartedGather(chunks, axis, mesh), axis, mesh, *chunks))


def reduce_scatter_flat(
    flats: list[torch.Tensor], axis: Axes, mesh: Mesh, op: str
) -> list[torch.Tensor]:
    """This rank's chunk of each 1-D tensor (length a multiple of N), reduced; one call per dtype."""
    n = mesh.axis_size(axis)
    out: list[torch.Tensor | None] = [None] * len(flats)
    for idx in _by_dtype(flats).values():
        sizes = [flats[i].numel() // n for i in idx]
        packed = torch.cat([flats[i].reshape(n, -1) for i in idx], dim=1).reshape(-1)
        mine = comm.reduce_scatter(packed, axis, 0, op=op, mesh=mesh)  # [sum c]
        for i, part in zip(idx, mine.split(sizes)):
            out[i] = part
    return [x for x in out if x is not None]


def padded(g: torch.Tensor, n: int) -> torch.Tensor:
    """``g``'s local piece flattened and zero-padded to a multiple of ``n`` (a view when no
    padding is needed)."""
    flat = local_piece(g).reshape(-1)
    c = -(-flat.numel() // n)
    if c * n == flat.numel():
        return flat
    return torch.nn.functional.pad(flat, (0, c * n - flat.numel()))


def by_rank(g: torch.Tensor, stacked: bool, n: int) -> torch.Tensor:
    """``g`` (a whole local tensor) as a flat whose ``(n, -1)`` view holds rank ``r``'s chunk
    in row ``r``: the layout :func:`reduce_scatter_flat` scatters. A stacked tensor is cut per
    layer, as its chunks are (:func:`cut_chunk`)."""
    if not stacked:
        return padded(g, n)
    local = local_piece(g)
    rows = local.reshape(local.shape[0], -1)
    c = -(-rows.shape[1] // n)
    rows = torch.nn.functional.pad(rows, (0, n * c - rows.shape[1]))
    return rows.view(rows.shape[0], n, c).transpose(0, 1).reshape(-1)


def as_chunk(piece: torch.Tensor, g: torch.Tensor, stacked: bool) -> torch.Tensor:
    """This rank's piece of ``g`` in :func:`by_rank`'s layout, shaped as its chunk."""
    return piece.view(g.shape[0], -1) if stacked else piece
