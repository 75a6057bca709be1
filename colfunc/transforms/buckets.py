"""Gradient buckets: many tensors reduced in a few large collectives, started as they fill.

Data parallelism (``shard``, ZeRO stage 0) all-reduces its gradients this way, and ZeRO stages
1-2 reduce-scatter them the same way; both take each scanned layer's gradients from the backward
pass through :class:`~colfunc.core.LayerGrads`, as DDP's reducer takes them from autograd hooks.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, comm
from colfunc.transforms.local import in_placement, local_piece, rewrap

PyTree = Any
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket is small, so that communication starts early


def all_reduce_buckets(
    xs: list[torch.Tensor], axis: str, mesh: Mesh, op: str = "avg"
) -> list[torch.Tensor]:
    """``all_reduce`` of many tensors over ``axis`` now, in the buckets of :class:`GradBuckets`."""
    buckets = GradBuckets(mesh, axis, BUCKET_BYTES, op=op)
    for k, x in enumerate(xs):
        buckets._add(k, x)
    got = buckets._wait()
    return [got[k][0] for k in range(len(xs))]


def all_reduce_tree(grads: PyTree, axis: str, mesh: Mesh) -> PyTree:
    """Every gradient of ``grads`` averaged over ``axis`` (after the backward pass), local
    pieces of tensor-parallel ones included."""
    flat, treedef = tree.flatten_with_paths(grads)
    gs = [g for _, g in flat]
    reduced = all_reduce_buckets([local_piece(g) for g in gs], axis, mesh)
    return tree.unflatten(treedef, [rewrap(g, r) for g, r in zip(gs, reduced)])


class GradBuckets:
    """Data-parallel gradient reduction that starts during the backward pass (DDP's buckets).

    Its :class:`~colfunc.core.LayerGrads` frame (``frame``) takes each scanned layer's gradients
    when they are computed; they are packed by dtype into flat buckets, and a bucket's
    ``all_reduce`` starts as soon as it holds ``bucket_bytes`` (the first one sooner, so that
    communication starts early). :meth:`finish` adds the other gradients, waits, and builds the
    reduced tree. A layer scanned twice contributes twice, and a stacked parameter also used
    outside the scan has that part reduced at the end: the sum is the same either way. Gradients
    are reduced in the dtype that :class:`~colfunc.core.WidenGrads` names (``amp``'s masters),
    as they would be if widened first and reduced after the backward pass.
    """

    def __init__(self, mesh: Mesh, axis: str, bucket_bytes: int, op: str = "avg") -> None:
        self.mesh, self.axis, self.bucket_bytes, self.op = mesh, axis, bucket_bytes, op
        self.limit = min(FIRST_BUCKET_BYTES, bucket_bytes)
        wide = core.innermost(core.WidenGrads)
        self.wide = wide.dtype if wide is not None else None
        self.frame = core.LayerGrads(self.on_layer)
        self.open: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
        self.open_bytes: dict[torch.dtype, int] = {}
        self.started: list[tuple[comm.Pending, list[tuple[Any, torch.Tensor]]]] = []

    def _dtype(self, g: torch.Tensor) -> torch.dtype:
        return self.wide if self.wide is not None and g.is_floating_point() else g.dtype

    def _widen(self, g: torch.Tensor) -> torch.Tensor:
        return g.to(self._dtype(g))

    def _add(self, key: Any, g: torch.Tensor) -> None:
        g = self._widen(g)
        self.open.setdefault(g.dtype, []).append((key, g))
        size = self.open_bytes.get(g.dtype, 0) + g.numel() * g.element_size()
        self.open_bytes[g.dtype] = size
        if size >= self.limit:
            self._start(g.dtype)
            self.limit = self.bucket_bytes

    def _start(self, dtype: torch.dtype) -> None:
        entries = self.open.pop(dtype)
        del self.open_bytes[dtype]
        self.started.append((self._launch([g for _, g in entries]), entries))

    def _launch(self, gs: list[torch.Tensor]) -> comm.Pending:
        """Start the reduction of one bucket."""
        flat = torch.cat([g.reshape(-1) for g in gs])
        return comm.all_reduce_async(flat, self.axis, self.op, self.mesh)

    def _pieces(self, result: torch.Tensor, gs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One bucket's result, cut back into its entries."""
        return [p.view_as(g) for p, g in zip(result.split([g.numel() for g in gs]), gs)]

    def on_layer(self, i: int, grads: dict[str, Any], params: dict[str, torch.Tensor]) -> None:
        for path, g in grads.items():
            if g is not None:
                self._add((path, i), local_piece(in_placement(g, params[path])))

    def _wait(self) -> dict[Any, list[torch.Tensor]]:
        for dtype in list(self.open):
            self._start(dtype)
        out: dict[Any, list[torch.Tensor]] = {}
        for pending, entries in self.started:
            pieces = self._pieces(pending.wait(), [g for _, g in entries])
            for (key, _), piece in zip(entries, pieces):
                out.setdefault(key, []).append(piece)
        self.started = []
        return out

    def finish(self, grads: PyTree, params: PyTree) -> PyTree:
        """The reduced gradients, from the backward pass's ``grads`` for ``params``."""
        handed = self.frame.handed
        flat, treedef = tree.flatten_with_paths(grads)
        placed = dict(tree.flatten_with_paths(params)[0])
        for path, g in flat:
            # a scanned leaf's own gradient is the zeros handed back, unless something outside
            # the scan added to it: that part is reduced too
            if path not in handed or g is not handed[path]:
                self._add(("rest", path), local_piece(in_placement(g, placed[path])))
        got = self._wait()

        def total(key: Any) -> torch.Tensor | None:
            parts = got.get(key)
            if not parts:
                return None
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)

        out = []
        for path, _ in flat:
            rest = total(("rest", path))
            if path not in handed:
                assert rest is not None
                out.append(rewrap(placed[path], rest))
                continue
            zeros = local_piece(handed[path])
            buf = torch.empty(zeros.shape, dtype=self._dtype(zeros), device=zeros.device)
            for i in range(zeros.shape[0]):
                row = total((path, i))
                if row is None:  # a layer that gave this leaf no gradient
                    buf[i].zero_()
                else:
                    buf[i].copy_(row)
            if rest is not None:
                buf += rest
            out.append(rewrap(placed[path], buf))
        return tree.unflatten(treedef, out)
