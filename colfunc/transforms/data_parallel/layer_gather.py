"""ZeRO-3's per-layer gathers inside :func:`colfunc.scan_layers`: started ``prefetch`` layers
ahead, freed after the layer's forward pass, and gathered again for its backward pass through
saved-tensor hooks, without recomputing the layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from colfunc import core, torch_private, tree
from colfunc.sharding import ShardedTensor
from colfunc.sharding.dispatch import is_param
from colfunc.transforms.data_parallel.chunks import Gathered, StartedGather, gather_flat, whole
from colfunc.transforms.local import local_piece

if TYPE_CHECKING:
    from colfunc.transforms.data_parallel.layout import ZeroLayout

PyTree = Any


def start_gather(chunks: list[torch.Tensor], axis: str, mesh: Any) -> StartedGather:
    """:class:`StartedGather` of ``chunks``; inside a checkpoint, whose recomputation must replay
    the same ops, started out of sight of its dispatch modes (which layers are started ahead
    differs between the forward pass and the recomputation)."""
    if not torch_private.saving_hooks_active():
        return StartedGather(chunks, axis, mesh)
    with torch_private.disable_current_modes():
        return StartedGather(chunks, axis, mesh)


def saved_piece(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A tensor the backward pass saves, as its local piece and what wraps that piece back
    (None for a plain tensor): saved-tensor hooks that stand in for weights keep these."""
    local = local_piece(t)
    if not isinstance(t, ShardedTensor):
        return local, None
    return local, (t.mesh, t.placements, tuple(t.shape), t.stride(), is_param(t))


def restored(local: torch.Tensor, wrap: Any) -> torch.Tensor:
    """The inverse of :func:`saved_piece`, on ``local`` (the piece fetched or gathered again)."""
    if wrap is None:
        return local
    mesh, placements, shape, stride, param = wrap
    out = ShardedTensor(local, mesh, placements, shape, stride)
    out._param = param  # the rules keep a parameter where it is, as they did
    return out


class _Regathered:
    """Layer ``i``'s gathered weights, gathered again on first use in the backward pass.

    Saved-tensor hooks replace each view of the gathered buffers that the layer's backward would
    keep by a token naming the buffer and the view, so the buffers are freed after the forward
    pass; the first token unpacked gathers the layer again. The copy lives as long as tokens
    that use it, i.e. until the layer's backward ends.
    """

    def __init__(self, owner: _LayerGathers, i: int) -> None:
        self.owner, self.i = owner, i
        self.buffers: list[torch.Tensor] | None = None

    def get(self, k: int) -> torch.Tensor:
        if self.buffers is None:
            self.buffers = self.owner.take(self.i, backward=True).wait()
        return self.buffers[k]


class _LayerGathers:
    """The gathers of one scan's layers, each started ``prefetch`` layers ahead of its use: the
    next layers in the forward pass, the previous ones in the backward pass."""

    def __init__(self, z: ZeroLayout, blocks: PyTree, prefetch: int) -> None:
        self.z, self.prefetch = z, prefetch
        leaves = tree.leaves(blocks)
        self.n = core.num_layers(blocks)
        self.rows = [[x.detach()[i] for x in leaves] for i in range(self.n)]
        self.index = {row[0].data_ptr(): i for i, row in enumerate(self.rows)} if leaves else {}
        self.ahead: tuple[dict[int, StartedGather], dict[int, StartedGather]] = ({}, {})
        self.taken: tuple[set[int], set[int]] = (set(), set())

    def layer_of(self, chunks: list[torch.Tensor]) -> int | None:
        """Which layer ``chunks`` (views of the stacked chunks) are, if they are one."""
        i = self.index.get(chunks[0].data_ptr()) if chunks else None
        return i if i is not None and chunks[0].shape == self.rows[i][0].shape else None

    def _start(self, i: int) -> StartedGather:
        return start_gather(self.rows[i], self.z.axis, self.z.mesh)

    def take(self, i: int, backward: bool) -> StartedGather:
        ahead, taken = self.ahead[backward], self.taken[backward]
        started = ahead.pop(i, None) or self._start(i)
        taken.add(i)
        step = -1 if backward else 1
        for d in range(1, self.prefetch + 1):
            j = i + step * d
            if 0 <= j < self.n and j not in ahead and j not in taken:
                ahead[j] = self._start(j)
        return started


class LayerGather:
    """Context frame for stage 3: gather each layer's chunks inside ``scan_layers``."""

    def __init__(self, layout: ZeroLayout, prefetch: int) -> None:
        self.z, self.prefetch = layout, prefetch

    def scan_layers(
        self, block: Any, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Any
    ) -> tuple[PyTree, PyTree]:
        metas = tree.leaves(self.z.metas["blocks"])
        gathers = _LayerGathers(self.z, blocks, self.prefetch)

        def layer(layer_chunks: PyTree) -> PyTree:
            flat, treedef = tree.flatten_with_paths(layer_chunks)
            chunks = [c for _, c in flat]
            i = gathers.layer_of(chunks)
            if i is None:  # not one of this scan's layers as stacked: gather it now
                flats = gather_flat(chunks, self.z.axis, self.z.mesh)
            else:
                started = gathers.take(i, backward=torch_private.in_backward())
                flats = list(Gathered.apply(started, self.z.axis, self.z.mesh, *chunks))
            layer_params = [whole(f, m, stacked_layer=True) for f, m in zip(flats, metas)]
            return tree.unflatten(treedef, layer_params)

        def gathered_block(layer_chunks: PyTree, c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            if not torch.is_grad_enabled() or torch_private.saving_hooks_active():
                # inference, or inside a checkpoint (remat): that drops the gathered weights
                # after the forward pass and gathers them again when it recomputes the layer
                return block(layer(layer_chunks), c, x)
            i = gathers.layer_of(tree.leaves(layer_chunks))
            if i is None or core.innermost(core.SplitBackward) is not None:
                # the checkpoint gathers the weights again for the backward pass (a split
                # backward would keep a regathered layer alive between its two parts)
                return checkpoint(
                    lambda ch, c_, x_: block(layer(ch), c_, x_),
                    layer_chunks,
                    c,
                    x,
                    use_reentrant=False,
                )
            full = layer(layer_chunks)
            # a view is rebuilt from the storage it was saved from (the offset is the storage's),
            # so leaves that share one storage may name either; a tensor-parallel weight is
            # known by its local piece's storage, and rewrapped as it was
            storages = {
                local_piece(w).untyped_storage().data_ptr(): k
                for k, w in enumerate(tree.leaves(full))
            }
            again = _Regathered(gathers, i)

            def pack(t: torch.Tensor) -> Any:
                local, wrap = saved_piece(t)
                k = storages.get(local.untyped_storage().data_ptr())
                if k is None:
                    return t
                view = (local.size(), local.stride(), local.storage_offset())
                return (again, k, view, wrap)

            def unpack(packed: Any) -> torch.Tensor:
                if isinstance(packed, torch.Tensor):
                    return packed
                holder, k, view, wrap = packed
                return restored(holder.get(k).as_strided(*view), wrap)

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return block(full, c, x)

        return inner(gathered_block, carry, blocks, xs)
