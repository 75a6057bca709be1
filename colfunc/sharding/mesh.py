"""``Mesh``: named axes over the ranks of a world, and this rank's place in them.

Ranks are laid out row-major over the axes in order: in ``Mesh({"dp": 2, "tp": 4})`` rank
``r`` has ``dp = r // 4`` and ``tp = r % 4``, so the ``tp`` groups are ``(0,1,2,3)`` and
``(4,5,6,7)`` and the ``dp`` groups ``(0,4)``, ``(1,5)``, ... A group over a tuple of axes is
ordered row-major in the order of the tuple: over ``("tp", "dp")`` rank 0's group is
``(0, 4, 1, 5, 2, 6, 3, 7)``.

A mesh is an immutable value of one rank's view. The backend world that carries the actual
communicators travels on it (``mesh.world``, not part of equality), so a mesh carried on a tensor
or an autograd context works from any thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from colfunc import core
from colfunc.sharding.ledger import Ledger

__all__ = ["Axes", "Mesh", "current_mesh"]

Axes = str | tuple[str, ...]


def _shape_items(shape: Any) -> tuple[tuple[str, int], ...]:
    if isinstance(shape, Mesh):
        return tuple(shape.shape.items())
    items = list(shape.items()) if isinstance(shape, Mapping) else list(shape)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"Mesh: shape must be a mapping {{axis: size}} or (axis, size) pairs; got {shape!r}"
            )
    if not items:
        raise ValueError("Mesh: a mesh needs at least one axis, e.g. {'dp': 1}")
    names = [name for name, _ in items]
    for name, size in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Mesh: axis names must be non-empty strings; got {name!r} in {items}")
        if names.count(name) > 1:
            raise ValueError(
                f"Mesh: axis name {name!r} appears {names.count(name)} times in {names}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"Mesh: size of axis {name!r} must be a positive int; got {size!r}")
    return tuple(items)


class Mesh:
    """Named axes and sizes, this rank, and the backend world (``Mesh({"dp": 2, "tp": 2}, rank=3)``).

    ``world`` is the backend's communicators (set by :func:`colfunc.sharding.launch`); a mesh
    without one describes a layout and runs collectives only over groups of one rank.
    """

    __slots__ = ("_cache", "_coords", "_items", "_rank", "_size", "ledger", "world")

    _items: tuple[tuple[str, int], ...]
    _rank: int
    _size: int
    _coords: tuple[int, ...]
    _cache: dict[Axes, tuple[tuple[str, ...], tuple[int, ...]]]
    world: Any
    ledger: Ledger

    def __init__(
        self,
        shape: Mapping[str, int] | Iterable[tuple[str, int]] | Mesh,
        rank: int = 0,
        *,
        world: Any = None,
    ) -> None:
        items = _shape_items(shape)
        size = math.prod(s for _, s in items)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(
                f"Mesh: rank must be an int in [0, {size}) for {dict(items)}; got {rank!r}"
            )
        if world is not None and world.size != size:
            raise ValueError(
                f"Mesh: the axis sizes {dict(items)} multiply to {size} ranks but the world has "
                f"{world.size}; make the product of the sizes equal the world size"
            )
        coords, rest = [], rank
        for _, s in reversed(items):
            coords.append(rest % s)
            rest //= s
        sets = object.__setattr__
        sets(self, "_items", items)
        sets(self, "_rank", rank)
        sets(self, "_size", size)
        sets(self, "_coords", tuple(reversed(coords)))
        sets(self, "_cache", {})
        sets(self, "world", world)
        sets(self, "ledger", world.ledger(rank) if world is not None else Ledger())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Mesh is immutable; cannot set {name!r}")

    # --- the value ---------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` in axis order (a fresh dict)."""
        return dict(self._items)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._items)

    @property
    def size(self) -> int:
        """The world size: the product of the axis sizes."""
        return self._size

    @property
    def rank(self) -> int:
        """This rank's global rank (row-major over the axes in order)."""
        return self._rank

    @property
    def coords(self) -> dict[str, int]:
        """``{axis: index}`` of this rank."""
        return dict(zip(self.axis_names, self._coords))

    @property
    def backend(self) -> str:
        """The world's backend name (``"threads"``, ``"gloo"``, ...), or ``"none"``."""
        return self.world.name if self.world is not None else "none"

    def _lookup(self, axes: Axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
        # cached per argument as given: collectives look their group up on every call
        try:
            hit = self._cache.get(axes)
        except TypeError:  # unhashable: validation below says what is wrong
            hit = None
        if hit is None:
            names = (axes,) if isinstance(axes, str) else axes
            if not isinstance(names, tuple) or not all(isinstance(a, str) for a in names):
                raise TypeError(f"axis must be an axis name or a tuple of axis names; got {axes!r}")
            known = self.axis_names
            for a in names:
                if a not in known:
                    raise ValueError(f"unknown mesh axis {a!r}; this mesh has axes {known}")
            if len(set(names)) != len(names):
                raise ValueError(f"axis tuple {names!r} names an axis twice")
            hit = self._cache[axes] = (names, self._group_of(self._coords, names))
        return hit

    def axes(self, axes: Axes) -> tuple[str, ...]:
        """``axes`` as a validated tuple of axis names (a name gives a 1-tuple)."""
        return self._lookup(axes)[0]

    def axis_size(self, axes: Axes) -> int:
        """The size of an axis, or the product of the sizes of a tuple of axes."""
        return len(self._lookup(axes)[1])

    def group_ranks(self, axes: Axes) -> tuple[int, ...]:
        """The global ranks of this rank's group over ``axes``, ordered by group coordinate.

        The group coordinate is row-major over ``axes`` in the order given; the other axes are
        held at this rank's coordinates.
        """
        return self._lookup(axes)[1]

    def axis_index(self, axes: Axes) -> int:
        """This rank's index within its group over ``axes``."""
        return self.group_ranks(axes).index(self._rank)

    def groups(self, axes: Axes) -> tuple[tuple[int, ...], ...]:
        """Every group over ``axes`` (a partition of the world), ordered by lowest member."""
        names = self.axes(axes)
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self._size):
            g = self._group_of(self._coords_of(r), names)
            seen.setdefault(g, None)
        return tuple(sorted(seen, key=min))

    def _coords_of(self, rank: int) -> tuple[int, ...]:
        out = []
        for _, s in reversed(self._items):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def _group_of(self, coords: tuple[int, ...], names: tuple[str, ...]) -> tuple[int, ...]:
        sizes = [s for _, s in self._items]
        strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        pos = {name: i for i, (name, _) in enumerate(self._items)}
        base = sum(c * st for c, st in zip(coords, strides)) - sum(
            coords[pos[a]] * strides[pos[a]] for a in names
        )
        ranks = [base]
        for a in names:  # row-major: the first axis in `names` varies slowest
            i = pos[a]
            ranks = [r + k * strides[i] for r in ranks for k in range(sizes[i])]
        return tuple(ranks)

    # --- equality ----------------------------------------------------------------------------
    def _key(self) -> tuple[Any, ...]:
        return (self._items, self._rank)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key() == other._key() and self.world is other.world

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Mesh({dict(self._items)}, rank={self._rank}, backend={self.backend!r})"

    def __reduce__(self):  # a mesh sent to another process carries no communicators
        return (Mesh, (self._items, self._rank))


def current_mesh() -> Mesh:
    """The innermost mesh on this thread's context stack (set by ``launch`` inside ``fn``)."""
    mesh = core.innermost(Mesh)
    if mesh is None:
        raise RuntimeError(
            "no current mesh: call this inside a function run by colfunc.sharding.launch, inside "
            "`with colfunc.core.context(mesh):`, or pass mesh= explicitly"
        )
    return mesh
