"""Placements: how one mesh axis lays out a tensor, and the chunk arithmetic behind them.

A sharded tensor has one placement per mesh axis:

- ``Shard(dim)``: the axis splits tensor dim ``dim`` into chunks, ``torch.chunk`` style: chunks of
  ``ceil(n / k)`` elements, the last non-empty one possibly shorter and any after it empty.
- ``Replicate()``: every rank of the axis holds the same values.
- ``Partial(op)``: every rank holds a piece; the value is the ``op`` ("sum", "avg", "max") of the
  pieces over the axis. Partial axes of one tensor must commute (sum with avg, max with max).

When several axes shard one dim, the earlier mesh axis splits first (major) and each later axis
splits the chunk it is given, so ``P(("dp", "tp"))`` on a ``{"dp": 2, "tp": 2}`` mesh gives rank
``(dp=i, tp=j)`` the ``j``-th half of the ``i``-th half.

A partition spec (:class:`colfunc.core.P`) names, per tensor dim, the axes that split it; it holds
no Partial. :func:`placements_from_spec` and :func:`spec_from_placements` convert between the two.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from colfunc.core import P
from colfunc.sharding.mesh import Mesh

__all__ = [
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "Shard",
    "chunk",
    "dim_chunks",
    "grad_placements",
    "local_shape",
    "normalize_placements",
    "placements_from_spec",
    "shard_range",
    "spec_from_placements",
]

PARTIAL_OPS = ("sum", "avg", "max")


@dataclasses.dataclass(frozen=True)
class Shard:
    """The mesh axis splits tensor dim ``dim`` into ``torch.chunk`` chunks."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard: dim must be an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the whole value."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclasses.dataclass(frozen=True)
class Partial:
    """Every rank of the mesh axis holds a piece; the value is the ``op`` of the pieces."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial: op must be one of {PARTIAL_OPS}, got {self.op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.op!r})"


Placement: TypeAlias = Shard | Replicate | Partial
Placements: TypeAlias = tuple[Placement, ...]
_PLACEMENT_TYPES = (Shard, Replicate, Partial)


def normalize_placements(mesh: Mesh, placements: Any, ndim: int) -> Placements:
    """One validated placement per mesh axis, Shard dims made non-negative.

    ``placements`` is a sequence with one placement per mesh axis, a mapping ``{axis: placement}``
    (axes not named are replicated) or a partition spec :class:`P`.
    """
    if isinstance(placements, P):
        return placements_from_spec(mesh, placements, ndim)
    names = mesh.axis_names
    if isinstance(placements, Mapping):
        unknown = [a for a in placements if a not in names]
        if unknown:
            raise ValueError(
                f"placements name axes {unknown} that the mesh does not have; mesh axes are {names}"
            )
        placements = [placements.get(a, Replicate()) for a in names]
    if not isinstance(placements, Sequence) or isinstance(placements, str):
        raise TypeError(
            f"placements must be a sequence (one per mesh axis), a mapping {{axis: placement}} or "
            f"a P spec; got {placements!r}"
        )
    if len(placements) != len(names):
        raise ValueError(
            f"got {len(placements)} placements {tuple(placements)} for a mesh with {len(names)} "
            f"axes {names}; give one placement per axis (Replicate() where the axis does not split)"
        )
    out: list[Placement] = []
    for axis, p in zip(names, placements):
        if not isinstance(p, _PLACEMENT_TYPES):
            raise TypeError(
                f"placement for axis {axis!r} must be Shard(dim), Replicate() or Partial(op); "
                f"got {p!r}"
            )
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"Shard({p.dim}) on axis {axis!r} is out of range for a tensor with {ndim} dims"
                )
            p = Shard(p.dim % ndim)
        out.append(p)
    ops = {p.op for p in out if isinstance(p, Partial)}
    if "max" in ops and len(ops) > 1:
        raise ValueError(
            f"placements {tuple(out)} mix Partial('max') with {sorted(ops - {'max'})}: reducing the "
            "axes in different orders would give different values; reduce one of them first"
        )
    return tuple(out)


def placements_from_spec(mesh: Mesh, spec: P, ndim: int | None = None) -> Placements:
    """The placements of partition spec ``spec`` on ``mesh`` (``ndim`` checks the spec's length).

    Axes named together for one dim must follow the mesh's axis order (the major axis first),
    since that is the only nesting a tuple of placements can express.
    """
    if not isinstance(spec, P):
        raise TypeError(f"spec must be a colfunc.P, got {spec!r}")
    if ndim is not None and len(spec) > ndim:
        raise ValueError(f"spec {spec!r} names {len(spec)} dims but the tensor has {ndim}")
    names = mesh.axis_names
    out: list[Placement] = [Replicate()] * len(names)
    for dim, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        for a in axes:
            if a not in names:
                raise ValueError(
                    f"spec {spec!r} names axis {a!r} that the mesh does not have; mesh axes are "
                    f"{names}"
                )
        order = [names.index(a) for a in axes]
        if order != sorted(order):
            raise ValueError(
                f"spec {spec!r} splits dim {dim} over {axes}, not in the mesh's axis order {names}; "
                f"list them major first as the mesh does: {tuple(sorted(axes, key=names.index))}"
            )
        for i in order:
            out[i] = Shard(dim)
    return tuple(out)


def spec_from_placements(mesh: Mesh, placements: Placements) -> P:
    """The partition spec of Shard/Replicate ``placements`` (Partial has no spec)."""
    dims: dict[int, list[str]] = {}
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, Partial):
            raise ValueError(f"{p!r} on axis {axis!r} has no partition spec; reduce it first")
        if isinstance(p, Shard):
            dims.setdefault(p.dim, []).append(axis)
    n = max(dims, default=-1) + 1
    entries = [dims.get(d) for d in range(n)]
    return P(*(None if e is None else e[0] if len(e) == 1 else tuple(e) for e in entries))


def grad_placements(placements: Placements) -> Placements:
    """Where a gradient goes back to: Partial becomes Replicate (its transpose), the rest stay."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


# --- chunk arithmetic ---------------------------------------------------------------------------


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``(offset, size)`` of chunk ``i`` of ``n`` elements split ``torch.chunk`` style into ``k``."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, min(c, n - start)


def shard_range(n: int, mesh: Mesh, placements: Placements, dim: int) -> tuple[int, int]:
    """``(offset, size)`` of this rank's part of tensor dim ``dim`` (global size ``n``)."""
    start, size = 0, n
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, Shard) and p.dim == dim:
            off, size = chunk(size, mesh.axis_size(axis), mesh.coords[axis])
            start += off
    return start, size


def local_shape(shape: Sequence[int], mesh: Mesh, placements: Placements) -> tuple[int, ...]:
    """The shape of this rank's local part of a tensor of global ``shape``."""
    out = list(shape)
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, Shard):
            out[p.dim] = chunk(out[p.dim], mesh.axis_size(axis), mesh.coords[axis])[1]
    return tuple(out)


def dim_chunks(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Every rank's ``(offset, size)`` of a dim of ``n`` split by nested axes of ``sizes``."""
    out = []
    for idx in itertools.product(*(range(k) for k in sizes)):
        start, size = 0, n
        for k, i in zip(sizes, idx):
            off, size = chunk(size, k, i)
            start += off
        out.append((start, size))
    return out
