"""The flat gradient buffers of data parallelism: how the leaves' gradients lie in them, how
they are cut into buckets, and the pool that keeps them from one step to the next.

A layout (:class:`Layout`: the buffers, each leaf's :class:`Place`, the bucket :class:`Cut` s)
follows from the leaves' shapes and dtypes alone, so it is cut once per kind of step
(:func:`cut_layout`) and only materialized per step (:func:`make_views`, from buffers a
:class:`BufferPool` hands out). :class:`colfunc.transforms.data_parallel.buckets.GradBuckets` reduces them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import torch

from colfunc import torch_private
from colfunc.optim.base import packed

__all__ = [
    "FIRST_BUCKET_BYTES",
    "BufferPool",
    "Cut",
    "Layout",
    "Place",
    "Views",
    "cut_layout",
    "first_bucket_bytes",
    "make_views",
    "row_strides",
]

# DDP's first bucket is small, so that communication starts early; see first_bucket_bytes
FIRST_BUCKET_BYTES = 2**20


def first_bucket_bytes(device: torch.device, bucket_bytes: int, total_bytes: int) -> int:
    """The size of the first bucket of a flat gradient buffer of ``total_bytes`` on ``device``.

    DDP's first bucket is small (:data:`FIRST_BUCKET_BYTES`), so that the first ``all_reduce``
    starts early in the backward pass. So it is here, except on CPU ranks whose whole buffer
    fits in one bucket: there a collective runs on the cores the backward pass is using and
    costs a fixed latency per call, and the little it could overlap is worth less than the call,
    so the buffer is reduced in one call at the end. Measured on 2 cores, 2 gloo ranks,
    interleaved in the same processes: ``gpt.Config.tiny`` (3.4 MB of gradients) took
    0.948-0.990x the step time in one bucket that it takes with a small first one (median 0.98,
    4 runs), and its ratio to DDP went from 0.99-1.02 to 0.976-0.989 (medians of 5-9 runs). A
    larger buffer keeps DDP's first bucket: on ``gpt.Config.small`` (43 MB) the two layouts
    measured within noise of each other (0.966-1.023x, 3 runs).
    """
    if device.type == "cpu" and total_bytes <= bucket_bytes:
        return bucket_bytes
    return min(FIRST_BUCKET_BYTES, bucket_bytes)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one leaf's gradient lies: in buffer ``buffer`` from ``offset``; a stacked leaf's
    layer rows lie ``row`` elements apart (``row`` None: a leaf in one piece), each laid out
    with ``strides`` (its parameter's layer strides: row-major, or column-major for weights
    kept in :func:`matmul_order`)."""

    buffer: int
    offset: int
    shape: tuple[int, ...]
    row: int | None = None
    strides: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Cut:
    """One bucket: ``[lo, hi)`` of buffer ``buffer``, holding the rows of ``layers`` of the
    scanned leaves ``paths``; it starts once ``waiting`` layers (or the end) have reported."""

    buffer: int
    lo: int
    hi: int
    layers: range
    waiting: int
    paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The buffers (dtype, device, size), where each leaf lies in them, and the buckets. It
    follows from the leaves' shapes and dtypes alone, so it is cut once per kind of step and
    only materialized (buffers and views) per step."""

    buffers: tuple[tuple[torch.dtype, torch.device, int], ...]
    places: dict[str, Place]
    cuts: tuple[Cut, ...]


def row_strides(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of one layer's block of the stacked ``x`` where it covers its memory once
    (row-major, or any order of its dims: a column-major weight); row-major strides otherwise.
    A gradient row laid out as its parameter's is written by a plain copy, and the optimizer
    reads the two in step (see :func:`colfunc.optim.base.packed`)."""
    inner, strides = tuple(x.shape[1:]), tuple(x.stride()[1:])
    if packed(inner, strides):
        return strides
    return tuple(math.prod(inner[k + 1 :]) for k in range(len(inner)))


def cut_layout(
    leaves: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]]],
    scanned: list[str],
    bucket_bytes: int,
) -> Layout:
    """The layout for ``leaves`` (path -> shape, dtype reduced in, device, a stacked leaf's
    layer strides; the loss's slot among them), of which ``scanned`` are stacked leaves taken
    per layer."""
    n = leaves[scanned[0]][0][0] if scanned else 0
    by_dtype: dict[torch.dtype, tuple[list[str], list[str]]] = {}
    for path in [*scanned, *(p for p in leaves if p not in scanned)]:
        rows, others = by_dtype.setdefault(leaves[path][1], ([], []))
        (rows if path in scanned else others).append(path)
    buffers: list[tuple[torch.dtype, torch.device, int]] = []
    places: dict[str, Place] = {}
    cuts: list[Cut] = []
    for d, (rows, others) in by_dtype.items():
        # the unscanned leaves first, then the scanned leaves' rows layer by layer: the
        # bucket of the first layers (the last to be differentiated) then also holds the
        # unscanned leaves' tail, whose gradients (the embeddings') complete last, as DDP's
        # last bucket holds them with the first layers
        k, end = len(buffers), 0
        for path in others:
            places[path] = Place(k, end, leaves[path][0])
            end += math.prod(leaves[path][0])
        base, at = end, 0
        row = sum(math.prod(leaves[path][0][1:]) for path in rows)  # one layer's elements
        for path in rows:
            places[path] = Place(k, base + at, leaves[path][0], row, leaves[path][3])
            at += math.prod(leaves[path][0][1:])
        device, numel, size = leaves[(rows or others)[0]][2], base + n * row, d.itemsize
        buffers.append((d, device, numel))
        limit = first_bucket_bytes(device, bucket_bytes, numel * size)
        # the unscanned leaves in buckets of whole leaves; the last of them (its start:
        # ``tail``) joins the bucket of the first layers, when there are layers
        starts, lo = [], 0
        for j, path in enumerate(others):
            hi = places[path].offset + math.prod(leaves[path][0])
            if (hi - lo) * size >= bucket_bytes or j == len(others) - 1:
                starts.append((lo, hi))
                lo = hi
        tail = starts.pop()[0] if starts and n and row else base
        hi = n  # the bucket being cut holds layers [lo, hi), from the last down
        for lo in range(n - 1, -1, -1) if row else ():
            if (hi - lo) * row * size >= limit or lo == 0:
                first = tail if lo == 0 else base + lo * row
                # with unscanned leaves in it, it waits for them too: it starts at the end
                waiting = hi - lo + (1 if lo == 0 and tail < base else 0)
                cuts.append(Cut(k, first, base + hi * row, range(lo, hi), waiting, tuple(rows)))
                hi, limit = lo, bucket_bytes
        cuts.extend(Cut(k, lo, hi, range(0), 0, ()) for lo, hi in starts)
    return Layout(tuple(buffers), places, tuple(cuts))


@dataclasses.dataclass
class _Kept:
    """Buffers a pool keeps, what was built on them, and how many tensors refer to each
    buffer's memory when nothing but the pool and those views does."""

    buffers: list[torch.Tensor]
    views: Any
    users: list[int]


class BufferPool:
    """Flat gradient buffers kept from one step for the next, as DDP keeps its buckets, with
    the views a step cuts from them (each leaf's place, each layer's rows, each bucket).

    A fresh buffer per step costs the allocator: past glibc's mmap threshold (32 MiB at most)
    every step maps new pages and faults each one in as the gradients are written; and cutting
    the views again costs a few microseconds of Python per leaf and layer. A buffer is handed
    out again only once nothing refers to its memory beyond the pool and its kept views (no
    gradient handed out, no optimizer state, no saved tensor, no caller still working on it):
    a caller that keeps the gradients of a step (``optim.accumulate``, a user's own loop) gets
    a new buffer, never one being written over. Safe across threads (each rank of the threads
    backend takes its own). A buffer's contents are undefined, as ``torch.empty``'s.
    """

    KEPT = 2  # buffers kept per layout and dtype (two ranks' threads, say)

    def __init__(self) -> None:
        self.kept: dict[Any, list[_Kept]] = {}
        self.lock = threading.Lock()

    def take(
        self,
        key: Any,
        specs: list[tuple[torch.dtype, torch.device, int]],
        build: Any,
    ) -> tuple[Any, list[torch.Tensor]]:
        """Flat 1-d buffers for ``specs`` (dtype, device, elements each) and ``build(buffers)``,
        the views of them that the caller works through, both reused from an earlier call
        under ``key`` when that one is free; and one *lease* per buffer (a view of it): while
        a lease or anything cut from the buffers outside ``build`` lives, they are not handed
        out again. The caller keeps the leases until what it hands out refers to the buffers."""
        with self.lock:
            kept = self.kept.setdefault(key, [])
            for entry in kept:
                if all(
                    torch_private.storage_users(b) == n for b, n in zip(entry.buffers, entry.users)
                ):
                    return entry.views, [b.view(-1) for b in entry.buffers]  # taken under the lock
            buffers = [torch.empty(numel, dtype=d, device=dev) for d, dev, numel in specs]
            views = build(buffers)
            if len(kept) < self.KEPT:
                users = [torch_private.storage_users(b) for b in buffers]
                kept.append(_Kept(buffers, views, users))
            return views, [b.view(-1) for b in buffers]

    def empty(self, key: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-d buffer of ``numel`` elements, reused if one kept under ``key`` is free."""
        _, (lease,) = self.take(key, [(dtype, device, numel)], lambda buffers: None)
        return lease


@dataclasses.dataclass
class Views:
    """What a step cuts from its flat buffers: every leaf's gradient in place (``whole``), a
    stacked leaf's rows per layer, each bucket's range, and which buckets hold each layer."""

    whole: dict[str, torch.Tensor]
    rows: dict[str, tuple[torch.Tensor, ...]]
    buckets: list[torch.Tensor]
    of_layer: dict[int, list[int]]  # layer -> indices of the buckets holding its rows
    bucket_of: dict[str, dict[int, int]]  # scanned leaf -> layer -> index of its bucket


def make_views(layout: Layout, buffers: list[torch.Tensor]) -> Views:
    whole: dict[str, torch.Tensor] = {}
    rows: dict[str, tuple[torch.Tensor, ...]] = {}
    for path, place in layout.places.items():
        buffer, shape = buffers[place.buffer], place.shape
        if place.row is not None:
            w = buffer.as_strided(shape, (place.row, *place.strides), place.offset)
            whole[path], rows[path] = w, w.unbind(0)
        else:
            whole[path] = buffer[place.offset : place.offset + math.prod(shape)].view(shape)
    views = [buffers[cut.buffer][cut.lo : cut.hi] for cut in layout.cuts]
    of_layer: dict[int, list[int]] = {}
    bucket_of: dict[str, dict[int, int]] = {}
    for c, cut in enumerate(layout.cuts):
        for i in cut.layers:
            of_layer.setdefault(i, []).append(c)
            for path in cut.paths:
                bucket_of.setdefault(path, {})[i] = c
    return Views(whole, rows, views, of_layer, bucket_of)
