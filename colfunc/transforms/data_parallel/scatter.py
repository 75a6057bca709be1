"""ZeRO 1-2's gradient reduce-scatter in buckets started during the backward pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, comm
from colfunc.sharding.mesh import Axes
from colfunc.transforms.data_parallel.buckets import PackedBuckets
from colfunc.transforms.data_parallel.chunks import as_chunk, by_rank, is_stacked, padded
from colfunc.transforms.data_parallel.grad_layout import first_bucket_bytes
from colfunc.transforms.local import in_placement, local_piece

__all__ = ["ScatterBuckets"]

PyTree = Any


class ScatterBuckets(PackedBuckets):
    """ZeRO 1-2's gradient reduce-scatter, started during the backward pass.

    Packed buckets (:class:`~colfunc.transforms.data_parallel.buckets.PackedBuckets`) in which each gradient
    is laid out by rank (:func:`by_rank`; a scanned layer's row is cut as that layer's
    chunk is) and a bucket is reduce-scattered, so each rank receives only its averaged chunks.
    """

    def __init__(self, mesh: Mesh, axis: Axes, bucket_bytes: int, params: PyTree = None) -> None:
        super().__init__(mesh, axis, bucket_bytes)
        if params is not None:  # the first bucket as data parallelism's (first_bucket_bytes)
            ts = [local_piece(p) for p in tree.tensors(params)]
            if ts:
                total = sum(t.numel() * self.dtype_of(t).itemsize for t in ts)
                self.limit = first_bucket_bytes(ts[0].device, bucket_bytes, total)
        self.frame = core.LayerGrads(self.on_layer)
        self.n = mesh.axis_size(axis)
        self.kept: dict[str, dict[int, list[torch.Tensor]]] = {}

    def launch(self, gs: list[torch.Tensor]) -> comm.Pending:
        packed = torch.cat([g.view(self.n, -1) for g in gs], dim=1).reshape(-1)
        return comm.reduce_scatter_async(packed, self.axis, "avg", self.mesh)

    def pieces(self, result: torch.Tensor, gs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(result.split([g.numel() // self.n for g in gs]))

    def on_layer(self, i: int, grads: dict[str, Any], params: Mapping[str, torch.Tensor]) -> None:
        for path, g in grads.items():
            if g is None:
                continue
            row = local_piece(in_placement(g, params[path]))
            if is_stacked(path):
                self.add((path, i), padded(row, self.n))
            else:  # scanned, but cut whole: kept until the whole gradient is known
                self.kept.setdefault(path, {}).setdefault(i, []).append(row)

    def finish(self, grads: PyTree, params: PyTree) -> PyTree:
        """This rank's averaged gradient chunks, from the backward pass's ``grads``."""
        handed = self.frame.handed
        flat, treedef = tree.flatten_with_paths(grads)
        placed = dict(tree.flatten_with_paths(params)[0])
        for path, g in flat:
            g = local_piece(in_placement(g, placed[path]))
            cut_whole = path not in handed or not is_stacked(path)
            if path in handed and not is_stacked(path):  # the rows taken, and what else came
                rows = self.kept.get(path, {})
                total = torch.stack(
                    [
                        torch.stack(rows[i]).sum(0) if i in rows else torch.zeros_like(g[i])
                        for i in range(len(g))
                    ]
                )
                g = total if g is local_piece(handed[path]) else total + g
            if cut_whole:
                self.add(("rest", path), by_rank(g, is_stacked(path), self.n))
            elif g is not local_piece(handed[path]):  # something outside the scan added to it
                for i in range(g.shape[0]):
                    self.add((path, i), padded(g[i], self.n))
        got = self.wait()
        self.frame.close()  # no cycle keeps the backend's results alive until a collection
        out = []
        for path, g in flat:
            if path not in handed or not is_stacked(path):
                (piece,) = got[("rest", path)]
                out.append(as_chunk(piece, local_piece(g), is_stacked(path)))
                continue
            local = local_piece(handed[path])
            c = -(-local[0].numel() // self.n)
            chunk = torch.zeros(
                (local.shape[0], c), dtype=self.dtype_of(local), device=local.device
            )
            for i in range(local.shape[0]):
                for part in got.get((path, i), ()):
                    chunk[i] += part
            out.append(chunk)
        return tree.unflatten(treedef, out)
