"""Gradient buckets: many tensors reduced in a few large collectives, started as they fill.

Data parallelism (``shard``, ZeRO stage 0) all-reduces its gradients in :class:`GradBuckets`:
views into one flat gradient buffer per dtype, as DDP's ``gradient_as_bucket_view``, so each
gradient is written once (where the backward pass hands it over) and reduced where it lies.
ZeRO stages 1-2 reduce-scatter theirs in :class:`PackedBuckets`, whose buckets are packed when
they start. Both take each scanned layer's gradients from the backward pass through
:class:`~colfunc.core.LayerGrads`, as DDP's reducer takes them from autograd hooks.

Where the step call takes them (:func:`finish_buckets`, :class:`~colfunc.core.StepRun`), the
flat buffers' gradients are handed over before their last buckets have arrived, as an
:class:`InFlight`: the optimizer updates each bucket's layers once that bucket is reduced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping
from typing import Any

import torch

from colfunc import core, torch_private, tree
from colfunc.sharding import Mesh, comm
from colfunc.sharding.mesh import Axes
from colfunc.transforms.data_parallel import grad_layout
from colfunc.transforms.data_parallel.grad_layout import (
    BufferPool,
    Layout,
    Views,
    cut_layout,
    make_views,
    row_strides,
)
from colfunc.transforms.local import in_placement, local_piece, rewrap

__all__ = [
    "BUCKET_BYTES",
    "GradBuckets",
    "InFlight",
    "PackedBuckets",
    "all_reduce_buckets",
    "all_reduce_tree",
    "finish_buckets",
]

PyTree = Any
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
LOSS = "\x00loss"  # the path of the loss's slot in a buffer (no parameter's path)


def all_reduce_buckets(
    xs: list[torch.Tensor], axis: Axes, mesh: Mesh, op: str = "avg"
) -> list[torch.Tensor]:
    """``all_reduce`` of many tensors over ``axis`` now, in the buckets of :class:`PackedBuckets`."""
    buckets = PackedBuckets(mesh, axis, BUCKET_BYTES, op=op)
    for k, x in enumerate(xs):
        buckets.add(k, x)
    got = buckets.wait()
    return [got[k][0] for k in range(len(xs))]


def all_reduce_tree(grads: PyTree, axis: Axes, mesh: Mesh) -> PyTree:
    """Every gradient of ``grads`` averaged over ``axis`` (after the backward pass), local
    pieces of tensor-parallel ones included."""
    flat, treedef = tree.flatten_with_paths(grads)
    gs = [g for _, g in flat]
    reduced = all_reduce_buckets([local_piece(g) for g in gs], axis, mesh)
    return tree.unflatten(treedef, [rewrap(g, r) for g, r in zip(gs, reduced)])


def _wide_dtype() -> torch.dtype | None:
    """The dtype the gradients are widened to afterwards (``amp``'s masters), if any."""
    wide = core.innermost(core.WidenGrads)
    return wide.dtype if wide is not None else None


class PackedBuckets:
    """Keyed tensors packed by dtype into flat buckets, each reduced as soon as it is full.

    :meth:`add` takes a tensor under a key; a bucket's collective (:meth:`launch`, an
    ``all_reduce`` here) starts as soon as it holds ``bucket_bytes`` (the first one sooner, so
    that communication starts early); :meth:`wait` starts the rest, waits, and returns each key's
    reduced pieces (a key added twice has two). Floating tensors are reduced in the dtype that
    :class:`~colfunc.core.WidenGrads` names, as they would be if widened first.
    """

    def __init__(self, mesh: Mesh, axis: Axes, bucket_bytes: int, op: str = "avg") -> None:
        self.mesh, self.axis, self.bucket_bytes, self.op = mesh, axis, bucket_bytes, op
        self.limit = min(grad_layout.FIRST_BUCKET_BYTES, bucket_bytes)
        self.wide = _wide_dtype()
        self.open: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
        self.open_bytes: dict[torch.dtype, int] = {}
        self.started: list[tuple[comm.Pending, list[tuple[Any, torch.Tensor]]]] = []

    def dtype_of(self, g: torch.Tensor) -> torch.dtype:
        """The dtype ``g`` is reduced in."""
        return self.wide if self.wide is not None and g.is_floating_point() else g.dtype

    def add(self, key: Any, g: torch.Tensor) -> None:
        g = g.to(self.dtype_of(g))
        self.open.setdefault(g.dtype, []).append((key, g))
        size = self.open_bytes.get(g.dtype, 0) + g.numel() * g.element_size()
        self.open_bytes[g.dtype] = size
        if size >= self.limit:
            self.start(g.dtype)
            self.limit = self.bucket_bytes

    def start(self, dtype: torch.dtype) -> None:
        entries = self.open.pop(dtype)
        del self.open_bytes[dtype]
        self.started.append((self.launch([g for _, g in entries]), entries))

    def launch(self, gs: list[torch.Tensor]) -> comm.Pending:
        """Start the reduction of one bucket."""
        flat = torch.cat([g.reshape(-1) for g in gs])
        return comm.all_reduce_async(flat, self.axis, self.op, self.mesh)

    def pending(self) -> bool:
        """Whether anything was added since the last :meth:`wait`."""
        return bool(self.open or self.started)

    def pieces(self, result: torch.Tensor, gs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One bucket's result, cut back into its entries."""
        return [p.view_as(g) for p, g in zip(result.split([g.numel() for g in gs]), gs)]

    def wait(self) -> dict[Any, list[torch.Tensor]]:
        for dtype in list(self.open):
            self.start(dtype)
        out: dict[Any, list[torch.Tensor]] = {}
        for pending, entries in self.started:
            pieces = self.pieces(pending.wait(), [g for _, g in entries])
            for (key, _), piece in zip(entries, pieces):
                out.setdefault(key, []).append(piece)
        self.started = []
        return out


@dataclasses.dataclass
class _Bucket:
    """A contiguous range of one dtype's buffer, reduced in place once it is complete: once
    every layer whose rows it holds has reported, or at the end for the unscanned leaves."""

    view: torch.Tensor
    layers: range  # the scanned layers whose rows it holds (empty for unscanned leaves)
    waiting: int
    paths: tuple[str, ...] = ()  # the scanned leaves in it
    pending: comm.Pending | None = None


_LAYOUTS: dict[Any, Layout] = {}  # (leaves, scanned, bucket sizes) -> their layout
_LAYOUTS_KEPT = 256


class GradBuckets:
    """Data-parallel gradient ``all_reduce`` started during the backward pass (DDP's buckets),
    over views into one flat gradient buffer per dtype.

    Its :class:`~colfunc.core.LayerGrads` frame (``frame``) takes each scanned layer's gradients
    when they are computed. The first layer to report fixes the layout: per dtype, one buffer
    holding every unscanned leaf, then the scanned leaves' rows layer by layer (layer ``i``'s rows
    of every scanned leaf side by side). Each gradient is written once, into its place (widened
    there to the dtype :class:`~colfunc.core.WidenGrads` names, ``amp``'s masters): a weight's
    gradient is computed apart and copied in, since a matmul writing it into its row itself
    (``out=``) made the step 1.009-1.016x as long as the copy does on ``gpt.Config.small`` (2 gloo
    ranks on 2 cores, 4 runs in fresh processes, interleaved, in either order). A bucket is a
    contiguous range of whole layers, cut from the last layer down (the first one small, as DDP's,
    unless a CPU buffer fits in one: :func:`first_bucket_bytes`), and is reduced in place as soon
    as its last layer has reported; the bucket of the first layers also holds the last unscanned
    leaves (the embeddings, whose gradients complete last), as DDP's last bucket does, so it starts
    at the end. :meth:`finish` writes the unscanned leaves, reduces what is left in buckets of
    whole leaves, waits, and returns gradients that are views into the buffers (a stacked leaf's is
    strided, its rows contiguous): no pass packs buckets and none copies results back. With
    ``early=False`` (``shard(overlap=False)``) every bucket starts in :meth:`finish`: the same
    buffers and the same sums, after the backward pass. The buffers come from ``pool`` when one is
    given. With ``only_own`` the frame takes the layers' gradients of ``params``' leaves only,
    leaving the others' (experts, reduced over other axes) to the backward pass.

    A layer scanned twice contributes twice, and a stacked parameter also used outside the scan
    has that part reduced at the end: what arrives after its bucket has started is reduced apart
    (in :class:`PackedBuckets`) and added at the end. The sum is the same either way.
    """

    def __init__(
        self,
        mesh: Mesh,
        axis: Axes,
        bucket_bytes: int,
        params: PyTree,
        op: str = "avg",
        *,
        carry_loss: bool = False,
        pool: BufferPool | None = None,
        early: bool = True,
        only_own: bool = False,
    ) -> None:
        self.mesh, self.axis, self.bucket_bytes, self.op = mesh, axis, bucket_bytes, op
        # an average seeds the backward pass with 1/n (the frame's scale: see
        # core.loss_scale), so every gradient arrives divided, is copied into its place and
        # the buckets sum: no pass divides, as DDP divides as it copies into its buckets
        n = mesh.axis_size(axis)
        average = op == "avg" and n > 1
        self.loss_div = 1.0 / n if average else None  # the carried loss is divided on its write
        self.reduce = "sum" if op == "avg" else op
        self.early = early  # start buckets as they fill (False: all of them in finish)
        self.pool = pool  # where the flat buffers come from (None: fresh ones every step)
        self.flat, self.treedef = tree.flatten_with_paths(params)
        self.frame = core.LayerGrads(
            self.on_layer,
            scale=1.0 / n if average else 1.0,
            early=self.early_layers,
            wants=[p for p, _ in self.flat] if only_own else None,
        )
        self.placed = dict(self.flat)
        self.local = {path: local_piece(p) for path, p in self.flat}
        # carry_loss: one more element, in the last bucket of the gradients' dtype, reduces the
        # loss with them (one collective fewer); :meth:`finish` then sets ``loss``
        self.carry_loss = carry_loss
        self.loss: torch.Tensor | None = None
        self.buckets: list[_Bucket] | None = None  # None until the layout is fixed
        self.views: Views | None = None  # the views cut from this step's buffers
        self.layout_paths: tuple[str, ...] = ()  # the scanned leaves that fixed the layout
        self.leases: list[torch.Tensor] = []  # the buffers, held while this step works on them
        self.whole: dict[str, torch.Tensor] = {}  # every leaf's gradient, in its buffer
        self.rows: dict[str, tuple[torch.Tensor, ...]] = {}  # a scanned leaf's rows, per layer
        self.filled: dict[int, set[str]] = {}  # per layer, the scanned leaves written
        self.reported: set[int] = set()
        # what arrives after its bucket started is reduced apart (summed: it arrives divided);
        # it also names the dtype each gradient is reduced in (amp's masters)
        self.late = PackedBuckets(mesh, axis, bucket_bytes, self.reduce)
        self.elsewhere: dict[str, list[tuple[int, torch.Tensor]]] = {}  # rows of another scan
        self.order: list[_Bucket] = []  # the buckets in the order their collectives started
        # finish(defer=True): the gradients handed over in flight, until they have arrived
        self.arrival: InFlight | None = None

    def _plan(self, scanned: list[str]) -> list[_Bucket]:
        """Lay out the buffers and cut the buckets; ``scanned`` are the leaves taken per layer."""
        reduced_in = self.late.dtype_of
        leaves = {
            p: (tuple(x.shape), reduced_in(x), x.device, row_strides(x) if p in scanned else ())
            for p, x in self.local.items()
        }
        floating = [x for x in self.local.values() if x.is_floating_point()]
        if self.carry_loss and floating:  # the loss's slot: last of the unscanned leaves
            leaves[LOSS] = ((), reduced_in(floating[0]), floating[0].device, ())
        key = (tuple(scanned), tuple(leaves.items()), self.bucket_bytes)
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = cut_layout(leaves, scanned, self.bucket_bytes)
            if len(_LAYOUTS) >= _LAYOUTS_KEPT:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
        specs = list(layout.buffers)
        build = functools.partial(make_views, layout)
        if self.pool is None:
            buffers = [torch.empty(numel, dtype=d, device=dev) for d, dev, numel in specs]
            views, self.leases = build(buffers), buffers
        else:
            views, self.leases = self.pool.take(key, specs, build)
        self.views, self.whole, self.rows = views, views.whole, views.rows
        self.layout_paths = tuple(scanned)
        self.buckets = [
            _Bucket(view, cut.layers, cut.waiting, cut.paths)
            for view, cut in zip(views.buckets, layout.cuts)
        ]
        return self.buckets

    def early_layers(self, paths: tuple[str, ...], n: int) -> Collection[int]:
        """The layers of a scan whose gradients are wanted as soon as they are computed: those
        of the buckets that start before the backward pass ends. The last bucket (it holds the
        first layers and the unscanned leaves' tail) starts in :meth:`finish` anyway, so its
        layers' gradients may come together once the scan's backward pass is through; without
        ``early``, every bucket starts there. A scan of other leaves than the one that fixed
        the layout gets every layer early, as any does before the layout is fixed."""
        if not self.early:
            return ()
        if self.buckets is None:
            self._plan(list(paths))
        assert self.buckets is not None
        if tuple(self.layout_paths) != paths:
            return range(n)
        return {i for b in self.buckets if b.waiting == len(b.layers) for i in b.layers}

    def _start(self, bucket: _Bucket) -> None:
        for i in bucket.layers:  # rows no gradient came for are zero
            filled = self.filled.get(i, ())
            for path in bucket.paths:
                if path not in filled:
                    self.rows[path][i].zero_()
        bucket.pending = comm.all_reduce_async(bucket.view, self.axis, self.reduce, self.mesh)
        self.order.append(bucket)

    def on_layer(self, i: int, grads: dict[str, Any], params: Mapping[str, torch.Tensor]) -> None:
        buckets = self._plan(list(grads)) if self.buckets is None else self.buckets
        views = self.views
        assert views is not None
        filled = self.filled.setdefault(i, set())
        into: list[torch.Tensor] = []  # this layer's rows, written together
        given: list[torch.Tensor] = []
        for path, g in grads.items():
            if g is None:
                continue
            row = g if type(g) is torch.Tensor else local_piece(in_placement(g, params[path]))
            rows = self.rows.get(path)
            if rows is None:  # not a leaf of the scan that fixed the layout
                self.elsewhere.setdefault(path, []).append((i, row))
            elif buckets[views.bucket_of[path][i]].pending is not None:
                self.late.add(("row", path, i), row)  # its bucket has started
            elif path in filled:
                rows[i].add_(row)
            else:
                into.append(rows[i])
                given.append(row)
                filled.add(path)
        if into:
            torch_private.foreach_copy_(into, given)  # widened in place (amp's masters)
        if i in self.reported or not any(p in self.rows for p in grads) or not self.early:
            return
        self.reported.add(i)
        for c in views.of_layer.get(i, ()):
            bucket = buckets[c]
            bucket.waiting -= 1
            if bucket.waiting == 0:
                self._start(bucket)

    def finish(
        self,
        grads: PyTree,
        params: PyTree,
        loss: torch.Tensor | None = None,
        *,
        defer: bool = False,
    ) -> PyTree:
        """The reduced gradients, from the backward pass's ``grads`` for ``params``: views into
        the flat buffers, distributed like ``params``. With ``carry_loss``, ``loss`` (a 0-d
        tensor) is reduced in the last bucket and ``self.loss`` is the result, unless its dtype
        is not the gradients' (``self.loss`` is then None: reduce it apart).

        With ``defer``, it returns as soon as every bucket has started, without waiting:
        ``self.arrival`` (an :class:`InFlight`) then says which parts are still in flight, and
        its ``wait_all()`` settles the rest (``self.loss`` included, whose value is written
        then). It waits here anyway where a part arrives apart (a gradient that came after its
        bucket started, a leaf used outside its scan): ``self.arrival`` stays None."""
        buckets = self.buckets if self.buckets is not None else self._plan([])
        slot = self.whole.get(LOSS)
        carried = slot is not None and loss is not None and loss.dtype == slot.dtype
        if slot is not None:
            value = loss.detach() if carried and loss is not None else torch.zeros(())
            slot.copy_(value)
            if self.loss_div is not None:
                slot.mul_(self.loss_div)
        handed = self.frame.handed
        for path, g in tree.flatten_with_paths(grads)[0]:
            local = local_piece(in_placement(g, self.placed[path]))
            if path in self.rows:
                # a scanned leaf's own gradient is the zeros handed back, unless something
                # outside the scan added to it: that part is reduced too
                if path not in handed or g is not handed[path]:
                    self.late.add(("whole", path), local)
                continue
            whole = self.whole[path]
            whole.copy_(local)
            for i, row in self.elsewhere.get(path, ()):
                whole[i].add_(row)
        for bucket in buckets:  # what is still open: the unscanned leaves, and layers that
            if bucket.pending is None:  # never reported
                self._start(bucket)
        # fresh tensors on the buffers for the caller: while it holds them, the pool hands the
        # buffers to no one
        out = tree.unflatten(
            self.treedef, [rewrap(p, self.whole[path].detach()) for path, p in self.flat]
        )
        self.loss = None
        if carried and slot is not None:
            self.loss = slot.new_empty(())
        if defer and not self.late.pending():
            self.arrival = InFlight(out, self.order, self._settle)
            return out
        for bucket in self.order:
            _arrive(bucket)
        for key, parts in self.late.wait().items():
            target = self.whole[key[1]] if key[0] == "whole" else self.rows[key[1]][key[2]]
            for part in parts:
                target += part
        self._settle()
        return out

    def _settle(self) -> None:
        """What a step owes once every bucket has arrived: the carried loss, and letting go."""
        slot = self.whole.get(LOSS)
        if self.loss is not None and slot is not None:
            self.loss.copy_(slot)
        self.frame.close()  # no cycle keeps the backend's results alive until a collection
        self.leases = []


def finish_buckets(
    buckets: GradBuckets, grads: PyTree, params: PyTree, loss: torch.Tensor | None = None
) -> PyTree:
    """``buckets.finish(grads, params, loss)``, handing the gradients over in flight to the step
    call running (:class:`colfunc.core.StepRun`) where it takes them: the step's update then
    waits for each part as it needs it."""
    run = core.innermost(core.StepRun)
    defer = run is not None and run.overlap and run.arrival is None
    out = buckets.finish(grads, params, loss, defer=defer)
    if buckets.arrival is not None and run is not None:
        run.hand(buckets.arrival)
    return out


def _arrive(bucket: _Bucket) -> None:
    """Wait for ``bucket``'s reduction; its result in its view."""
    if bucket.pending is None:
        return
    got = bucket.pending.wait()
    if got.data_ptr() != bucket.view.data_ptr():  # a backend that reduced elsewhere
        bucket.view.copy_(got)
    bucket.pending = None


class InFlight:
    """Data-parallel gradients handed over before their buckets have all arrived
    (:meth:`GradBuckets.finish` with ``defer``): a :class:`colfunc.core.GradArrival` whose parts
    are the buckets, in the order their reductions started.

    A part is a range of a flat buffer; a tensor's part is found from the memory it spans
    (its data pointer, sizes and strides), so any view into the buffers can be asked about.
    """

    def __init__(self, grads: PyTree, buckets: list[_Bucket], settle: Any) -> None:
        self.grads = grads
        self.buckets = list(buckets)
        self.parts = len(self.buckets)
        self.ranges = [
            (b.view.data_ptr(), b.view.data_ptr() + b.view.numel() * b.view.element_size())
            for b in self.buckets
        ]
        self.arrived = 0  # parts 0 .. arrived - 1 have arrived
        self.settle: Any = settle

    def part_of(self, t: torch.Tensor) -> int:
        if t.numel() == 0:
            return -1
        lo = t.data_ptr()
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        hi = lo + span * t.element_size()
        found = -1
        for k, (a, b) in enumerate(self.ranges):
            if lo < b and a < hi:
                found = k
        return found

    def wait(self, part: int) -> None:
        while self.arrived <= min(part, self.parts - 1):
            _arrive(self.buckets[self.arrived])
            self.arrived += 1

    def wait_for(self, t: torch.Tensor) -> None:
        self.wait(self.part_of(t))

    def wait_all(self) -> None:
        self.wait(self.parts - 1)
        if self.settle is not None:
            settle, self.settle = self.settle, None
            settle()
