"""Model states in fixed-size chunks, in layer order (Gemini's chunk manager, Fang et al. 2022).

The parameters are cut into *groups*, the units a step uses together: group 0 is every leaf
outside the stacked layers (embeddings, final norm: used at both ends of the forward pass), and
group ``1 + i`` is layer ``i`` of the stacked leaves (its row of each). Each group is packed, in
leaf order, into chunks of one dtype and a fixed number of elements; a tensor never straddles two
chunks, so the end of a chunk may be wasted. A chunk never straddles two groups either: a layer is
fetched, evicted and updated as whole chunks, and the device never holds half of one.

A mixture of experts' expert weights (stacked ``[L, E, ...]``, named by ``experts``) are cut
further, one piece per layer and expert, and each expert's pieces packed in chunks of their own
(``Chunk.expert``, as large as the expert's pieces: the chunk size is searched for the rest), so
that a layer's experts can be fetched one by one, only those its tokens are routed to.

The chunk size is chosen by a search (as Gemini's ``search_chunk_configuration``): among sizes from
the largest tensor to the largest group, the one that wastes the fewest elements, the smallest of
those on a tie, unless the caller fixes it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from colfunc import tree

__all__ = ["Chunk", "ChunkLayout", "Piece", "chunk_layout", "piece_of", "search_chunk_size"]

PyTree = Any
_ALIGN = 256  # elements: sizes searched are multiples of this (or a group's exact size)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor of a chunk: leaf ``leaf`` (flat index), row ``row`` of a stacked leaf (None
    for the others), expert ``expert`` of that row for an expert weight cut per expert (None
    for the others), at ``offset`` elements into the chunk."""

    leaf: int
    row: int | None
    offset: int
    shape: tuple[int, ...]
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``capacity`` elements of ``dtype`` holding ``pieces``; ``group`` is 0 for the leaves
    outside the layers, ``1 + i`` for layer ``i``; ``expert``: the expert whose weights it holds
    (None for the others)."""

    index: int
    group: int
    dtype: torch.dtype
    capacity: int
    pieces: tuple[Piece, ...]
    expert: int | None = None

    @property
    def used(self) -> int:
        return sum(p.numel for p in self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the chunk (its parameters in their own dtype)."""
        return self.capacity * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Every chunk of a parameter tree, and which leaves are stacked layers."""

    chunks: tuple[Chunk, ...]
    groups: tuple[tuple[int, ...], ...]  # group -> its chunks' indices
    stacked: tuple[bool, ...]  # per flat leaf
    chunk_size: int  # elements

    @property
    def num_layers(self) -> int:
        return len(self.groups) - 1

    def eager(self, group: int) -> tuple[int, ...]:
        """The chunks of ``group`` fetched whenever the group is: all but its experts'."""
        return tuple(c for c in self.groups[group] if self.chunks[c].expert is None)

    def expert_chunks(self, group: int) -> dict[int, tuple[int, ...]]:
        """The chunks of each expert of layer group ``group`` (empty: none cut per expert)."""
        return self._expert_chunks[group]

    @functools.cached_property
    def _expert_chunks(self) -> tuple[dict[int, tuple[int, ...]], ...]:
        # (read on every layer call of a routed step: worked out once per layout)
        per_group = []
        for cs in self.groups:
            out: dict[int, list[int]] = {}
            for c in cs:
                e = self.chunks[c].expert
                if e is not None:
                    out.setdefault(e, []).append(c)
            per_group.append({e: tuple(v) for e, v in out.items()})
        return tuple(per_group)

    def group_bytes(self, group: int) -> int:
        return sum(self.chunks[c].nbytes for c in self.groups[group])

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def wasted(self) -> int:
        """Elements of chunk capacity that hold no tensor."""
        return sum(c.capacity - c.used for c in self.chunks)


Item = tuple[int, int | None, int | None, torch.Tensor]  # leaf, row, expert, tensor


def piece_of(leaves: Sequence[Any], p: Piece) -> torch.Tensor:
    """The tensor piece ``p`` is of the flat parameter leaves ``leaves``."""
    x = leaves[p.leaf]
    x = x if p.row is None else x[p.row]
    return x if p.expert is None else x[p.expert]


def _groups(
    params: PyTree, experts: frozenset[int] = frozenset()
) -> tuple[list[list[Item]], list[bool]]:
    """The tensors of each group, in leaf order: (leaf index, row, expert, tensor); the leaves
    ``experts`` (stacked ``[L, E, ...]``) one tensor per layer and expert."""
    flat, _ = tree.flatten_with_paths(params)
    stacked = [path.startswith("blocks") for path, _ in flat]
    layers = {x.shape[0] for (_, x), s in zip(flat, stacked) if s}
    if len(layers) > 1:
        raise ValueError(
            f"offload: stacked leaves under 'blocks' differ in layers: {sorted(layers)}"
        )
    n = layers.pop() if layers else 0
    groups: list[list[Item]] = [[] for _ in range(n + 1)]
    for k, ((path, x), s) in enumerate(zip(flat, stacked)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"offload: every parameter leaf must be a tensor, got {type(x).__name__}"
            )
        if k in experts and (not s or x.dim() < 3):
            raise ValueError(
                f"offload: expert weight {path} must be stacked [layers, experts, ...], got "
                f"{tuple(x.shape)}"
            )
        if k in experts:
            for i in range(n):
                groups[1 + i].extend((k, i, e, x[i][e]) for e in range(x.shape[1]))
        elif s:
            for i in range(n):
                groups[1 + i].append((k, i, None, x[i]))
        else:
            groups[0].append((k, None, None, x))
    return groups, stacked


def _pack(numels: Sequence[int], size: int) -> list[list[int]]:
    """Indices of ``numels`` packed in order into bins of ``size`` (a new bin when one is full)."""
    bins: list[list[int]] = []
    room = 0
    for i, n in enumerate(numels):
        if not bins or n > room:
            bins.append([])
            room = size
        bins[-1].append(i)
        room -= n
    return bins


def _waste(groups: Sequence[Sequence[int]], size: int) -> int:
    return sum(len(_pack(g, size)) * size - sum(g) for g in groups if g)


def search_chunk_size(groups: Sequence[Sequence[int]], floor: int = 0) -> int:
    """The chunk size (elements) that wastes least packing each group's tensor sizes in order.

    Candidates run from the largest tensor (or ``floor``, if larger) to the largest group in
    steps of 256 elements, plus each group's exact size; ties go to the smaller size (finer
    eviction).
    """
    sizes = [n for g in groups for n in g]
    if not sizes:
        raise ValueError("offload: the parameters have no tensor to place in chunks")
    low = max(*sizes, floor)
    high = max(low, *(sum(g) for g in groups))
    candidates = set(range(-(-low // _ALIGN) * _ALIGN, high + 1, _ALIGN))
    candidates |= {low, high} | {sum(g) for g in groups if sum(g) >= low}
    return min(sorted(candidates), key=lambda s: _waste(groups, s))


def _parts(group: list[Item]) -> list[tuple[int | None, list[Item]]]:
    """A group's tensors as packed apart: the whole layer's, then each expert's."""
    experts = sorted({e for _, _, e, _ in group if e is not None})
    parts: list[tuple[int | None, list[Item]]] = [(None, [t for t in group if t[2] is None])]
    return parts + [(e, [t for t in group if t[2] == e]) for e in experts]


def chunk_layout(
    params: PyTree, chunk_size: int | None = None, experts: frozenset[int] = frozenset()
) -> ChunkLayout:
    """The chunks of ``params`` (a dict with stacked layers under ``"blocks"``, or any tree).

    ``chunk_size`` in elements (None: :func:`search_chunk_size`); it must hold the largest tensor.
    Each dtype's tensors are packed separately, so a chunk has one dtype. ``experts``: the flat
    indices of the expert weights to cut per layer and expert (see the module docs).
    """
    groups, stacked = _groups(params, experts)
    by_dtype: dict[torch.dtype, list[list[int]]] = {}
    for g in groups:
        for expert, part in _parts(g):
            if expert is not None:  # (an expert's chunks are as large as its pieces: no waste)
                continue
            for dtype in {t.dtype for *_, t in part}:
                sizes = [t.numel() for *_, t in part if t.dtype == dtype]
                by_dtype.setdefault(dtype, []).append(sizes)
    largest = max(t.numel() for g in groups for *_, t in g) if any(groups) else 0
    if chunk_size is None:  # (at least an expert's largest piece, which packs apart)
        searched = [search_chunk_size(gs, largest) for gs in by_dtype.values() if any(gs)]
        chunk_size = max(searched, default=largest)
    if chunk_size < largest:
        raise ValueError(
            f"offload: chunk size {chunk_size} elements is below the largest tensor "
            f"({largest} elements); a tensor never straddles two chunks: pass chunk_mb of at "
            f"least {largest * 4 / 2**20:.3f} (fp32) or leave it None to search"
        )
    chunks: list[Chunk] = []
    group_chunks: list[tuple[int, ...]] = []
    for gi, g in enumerate(groups):
        mine: list[int] = []
        for expert, part in _parts(g):
            for dtype in sorted({t.dtype for *_, t in part}, key=str):
                items = [item for item in part if item[3].dtype == dtype]
                for bin_ in _pack([t.numel() for *_, t in items], chunk_size):
                    offset, pieces = 0, []
                    for j in bin_:
                        k, row, e, t = items[j]
                        pieces.append(Piece(k, row, offset, tuple(t.shape), e))
                        offset += t.numel()
                    mine.append(len(chunks))
                    size = chunk_size if expert is None else offset  # (an expert's: exact)
                    chunk = Chunk(len(chunks), gi, dtype, size, tuple(pieces), expert)
                    chunks.append(chunk)
        group_chunks.append(tuple(mine))
    return ChunkLayout(tuple(chunks), tuple(group_chunks), tuple(stacked), chunk_size)
