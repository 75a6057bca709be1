"""Fetching each layer's chunks from host memory inside the scan, one layer ahead, and
writing its gradients home (see :mod:`colfunc.transforms.offload`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import torch_private, tree
from colfunc.sharding import from_local
from colfunc.transforms.data_parallel.chunks import (
    Gathered,
    StartedGather,
    layer_of,
    whole,
)
from colfunc.transforms.data_parallel.layer_gather import restored, saved_piece, start_gather
from colfunc.transforms.offload.experts import Experts
from colfunc.transforms.offload.state import OffloadState

if TYPE_CHECKING:
    from colfunc.transforms.data_parallel.layout import ZeroLayout

PyTree = Any


class _Holder:
    """A chunk's device buffer as the fetch node sees it (a non-tensor argument, so that the
    node's outputs are views of a tensor it did not receive)."""

    def __init__(self, state: OffloadState, c: int, buf: torch.Tensor) -> None:
        self.state, self.c = state, c
        self.buf: torch.Tensor | None = buf


class _Fetch(torch.autograd.Function):
    """A chunk's tensors, as views of its device buffer; the backward pass writes their
    gradients to the chunk's home and ends the layer's hold on the device."""

    @staticmethod
    def forward(holder: _Holder, frame: Streaming, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
        chunk = holder.state.layout.chunks[holder.c]
        buf, holder.buf = holder.buf, None  # the node must not keep the chunk alive
        assert buf is not None
        return tuple(buf[p.offset : p.offset + p.numel].view(p.shape) for p in chunk.pieces)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.holder, ctx.frame = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)
        state = ctx.holder.state
        if state.frozen:  # a frozen leaf's views need no gradient: none is computed for them
            pieces = state.layout.chunks[ctx.holder.c].pieces
            frozen = [t for p, t in zip(pieces, output) if not state.trains[p.leaf]]
            if frozen:
                ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        holder: _Holder = ctx.holder
        holder.state.write_grad(holder.c, grads)
        ctx.frame.chunk_done(holder.state.layout.chunks[holder.c].group)
        return None, None, None


class _InputDone(torch.autograd.Function):
    """The identity on a layer's input carry, whose backward says that the layer's input
    gradient is computed: with frozen leaves, what ends the layer's backward hold on its
    chunks when no fetch of a trainable chunk does (a layer of frozen weights still needs them
    for its input's gradient)."""

    @staticmethod
    def forward(frame: Streaming, group: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.frame, ctx.group = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.frame.chunk_done(ctx.group)
        return (None, None, *grads)


class _Regathered:
    """Group ``g``'s buffers, fetched again on first use in the backward pass (and, under ZeRO-3,
    gathered again into the layer's whole weights)."""

    def __init__(self, frame: Streaming, group: int) -> None:
        self.frame, self.group = frame, group
        self.bufs: dict[int, torch.Tensor] | None = None
        self.flats: list[torch.Tensor] | None = None

    def get(self, c: int) -> torch.Tensor:
        if self.bufs is None:
            self.bufs = self.frame.require(self.group, backward=True)
            self.frame.regathered[self.group] = self
        return self.bufs[c]

    def flat(self, k: int) -> torch.Tensor:
        """The ``k``-th gathered flat of this layer (no autograd: the backward pass reads it)."""
        if self.flats is None:
            c0 = self.frame.state.layout.eager(self.group)[0]
            self.get(c0)
            assert self.bufs is not None
            views = self.frame.plain_views(self.group, self.bufs)
            i = self.group - 1
            self.flats = self.frame.start(
                [views[(k, i)] for k in self.frame.state.block_leaves]
            ).wait()
        return self.flats[k]

    def drop(self) -> None:
        self.bufs = self.flats = None


def _where(t: torch.Tensor) -> tuple[int, int]:
    return id(t.untyped_storage()), int(t.storage_offset())


def _wrapped(template: Any, piece: torch.Tensor, row: bool) -> torch.Tensor:
    """``piece`` as the tensor-parallel tensor ``template`` (one layer of it if ``row``) it is
    this rank's piece of, differentiably; ``piece`` itself without a template."""
    if template is None:
        return piece
    if row:
        return layer_of(template, piece)
    return from_local(piece, template.mesh, template.placements, tuple(template.shape))


class Streaming:
    """Context frame of an offloaded step: fetch each scanned layer's chunks (a
    :class:`~colfunc.core.ScanInterceptor`) and hold group 0 for the whole step. Under ZeRO-3
    (``zero``) the fetched chunks are this rank's ZeRO chunks, all-gathered into whole weights;
    under tensor parallelism they are local pieces, wrapped back as the ShardedTensors they are
    pieces of (differentiably: a Partial gradient is reduced to the parameter's placements)."""

    def __init__(
        self,
        state: OffloadState,
        leaves: list[torch.Tensor],
        token: torch.Tensor | None,
        zero: ZeroLayout | None = None,
    ) -> None:
        self.state, self.leaves, self.token, self.zero = state, leaves, token, zero
        self.metas = tree.leaves(zero.metas) if zero is not None else []
        self.pool = state.pool
        self.pending: dict[int, int] = {}  # group -> chunks whose gradients are still due
        self.held_backward: set[int] = set()
        self.regathered: dict[int, _Regathered] = {}
        first = state.block_leaves[0] if state.block_leaves else None
        rows = leaves[first].unbind(0) if first is not None else ()
        # rows are known by storage and offset, not address: meta tensors (a dry run) all have
        # address 0, and a storage keeps one Python object for its whole life
        self.layer_index = {_where(r): i for i, r in enumerate(rows)}

    def require(self, group: int, backward: bool) -> dict[int, torch.Tensor]:
        bufs = self.pool.require(group, backward)
        if backward:
            self.held_backward.add(group)
        return bufs

    def chunk_done(self, group: int) -> None:
        """One chunk of ``group`` has its gradients: at the last, release the backward hold."""
        left = self.pending.get(group, 0) - 1
        if left > 0:
            self.pending[group] = left
            return
        self.pending.pop(group, None)
        if group in self.held_backward:
            self.held_backward.discard(group)
            self.pool.release(group)
            holder = self.regathered.pop(group, None)
            if holder is not None:
                holder.drop()

    def plain_views(
        self, group: int, bufs: dict[int, torch.Tensor]
    ) -> dict[tuple[int, int | None], torch.Tensor]:
        """(leaf, row) -> a view of the fetched buffer (no autograd)."""
        out: dict[tuple[int, int | None], torch.Tensor] = {}
        for c in self.state.layout.eager(group):
            for p in self.state.layout.chunks[c].pieces:
                out[(p.leaf, p.row)] = bufs[c][p.offset : p.offset + p.numel].view(p.shape)
        return out

    def views(
        self, group: int, bufs: dict[int, torch.Tensor]
    ) -> dict[tuple[int, int | None], torch.Tensor]:
        """(leaf, row) -> the tensor the model sees: fetch nodes when gradients are wanted."""
        grad = self.token is not None and torch.is_grad_enabled()
        if not grad:
            return self.plain_views(group, bufs)
        out: dict[tuple[int, int | None], torch.Tensor] = {}
        for c in self.state.layout.eager(group):
            chunk = self.state.layout.chunks[c]
            ts = _Fetch.apply(_Holder(self.state, c, bufs[c]), self, self.token)
            for p, t in zip(chunk.pieces, ts):
                out[(p.leaf, p.row)] = t
        if not torch_private.in_backward():  # the fetches whose backward ends the hold
            chunks = self.state.layout.eager(group)
            self.pending[group] = sum(1 for c in chunks if self.state.chunk_trains(c))
        return out

    # --- ZeRO-3: gathering the fetched chunks ------------------------------------------------
    def start(self, chunks: list[torch.Tensor]) -> StartedGather:
        """All-gather ``chunks`` over the ZeRO axis, started as ZeRO-3's own gathers are."""
        z = self.zero
        assert z is not None
        return start_gather(chunks, z.axis, z.mesh)

    def gather(self, keys: list[int], chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flats of ``chunks`` (leaves ``keys``) gathered, differentiably when they need
        gradients: the backward pass reduce-scatters (sums) the gradients onto the chunks."""
        z = self.zero
        assert z is not None
        if torch.is_grad_enabled() and any(c.requires_grad for c in chunks):
            return list(Gathered.apply(self.start(chunks), z.axis, z.mesh, *chunks))
        return self.start(chunks).wait()

    def wrap(self, k: int, piece: torch.Tensor, row: bool) -> torch.Tensor:
        """Leaf ``k``'s fetched local piece (one layer's row of it if ``row``) as the
        tensor-parallel tensor it is a piece of."""
        return _wrapped(self.state.templates[k], piece, row)

    def whole(self, k: int, flat: torch.Tensor, row: bool) -> torch.Tensor:
        """Leaf ``k``'s gathered ZeRO-3 flat (one layer's if ``row``) as the parameter,
        differentiably (a tensor-parallel one wrapped back as its ShardedTensor)."""
        meta = self.metas[k]
        local = whole(flat, dataclasses.replace(meta, template=None), stacked_layer=row)
        return _wrapped(meta.template, local, row)

    def outer(self) -> dict[int, torch.Tensor]:
        """Group 0's leaves on the device, held until the step ends."""
        bufs = self.require(0, backward=False)
        views = {leaf: self.wrap(leaf, t, False) for (leaf, _), t in self.views(0, bufs).items()}
        if self.zero is None or not views:
            return views
        keys = sorted(views)
        flats = self.gather(keys, [views[k] for k in keys])
        return {k: self.whole(k, f, False) for k, f in zip(keys, flats)}

    def scan_layers(self, block: Any, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Any) -> Any:
        state = self.state

        def fetched(layer_rows: PyTree, c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            flat, treedef = tree.flatten_with_paths(layer_rows)
            i = self.layer_index.get(_where(flat[0][1])) if flat else None
            if i is None or len(flat) != len(state.block_leaves):
                raise ValueError(
                    "offload: scan_layers ran over a tree that is not the step's params['blocks']; "
                    "an offloaded loss must scan exactly its stacked layers (cf.layered)"
                )
            group, backward = 1 + i, torch_private.in_backward()
            bufs = self.require(group, backward)
            views = self.views(group, bufs)
            # (the experts fetched when routed to: stand-ins the model's moe_ffn runs them by)
            experts = Experts(self, group) if state.routed else None
            rows: list[Any] = [
                experts.stand_in(k, self.leaves[k][i])
                if experts is not None and k in state.routed
                else self.wrap(k, views[(k, i)], True)
                for k in state.block_leaves
            ]
            flats: list[torch.Tensor] = []
            if self.zero is not None:
                flats = self.gather(state.block_leaves, rows)
                rows = [self.whole(k, f, True) for f, k in zip(flats, state.block_leaves)]
            layer = tree.unflatten(treedef, rows)
            c = self._input_done(group, c, backward)
            try:
                if (
                    not torch.is_grad_enabled()
                    or self.token is None
                    or torch_private.saving_hooks_active()
                ):
                    # inference, or inside a checkpoint (remat): that drops the weights after the
                    # forward pass and fetches them again when it recomputes the layer
                    return block(layer, c, x)
                with torch.autograd.graph.saved_tensors_hooks(*self._hooks(group, bufs, flats)):
                    return block(layer, c, x)
            finally:
                if not backward:
                    self.pool.release(group)

        return inner(fetched, carry, blocks, xs)

    def _input_done(self, group: int, carry: PyTree, backward: bool) -> PyTree:
        """With frozen leaves, the layer's input carry through :class:`_InputDone`, counted
        among the layer's pending backward parts (its recomputation under remat makes its own,
        counted by the forward pass that remat discarded)."""
        if not self.state.frozen or self.token is None or not torch.is_grad_enabled():
            return carry
        flat, treedef = tree.flatten_with_paths(carry)
        needs = [
            i for i, (_, x) in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not needs:
            return carry
        done = _InputDone.apply(self, group, *[flat[i][1] for i in needs])
        leaves = [x for _, x in flat]
        for i, x in zip(needs, done):
            leaves[i] = x
        if not backward:
            self.pending[group] = self.pending.get(group, 0) + 1
        return tree.unflatten(treedef, leaves)

    def _hooks(
        self, group: int, bufs: dict[int, torch.Tensor], flats: list[torch.Tensor]
    ) -> tuple[Any, Any]:
        # the backward pass keeps, instead of a cached chunk's views (or, under ZeRO-3, of the
        # layer's gathered weights), a token that fetches (and gathers) the chunk again; mirrors
        # stay on the device: kept as they are
        storages: dict[int, tuple[bool, int]] = {
            id(b.untyped_storage()): (False, c)
            for c, b in bufs.items()
            if c not in self.pool.mirrors or b is not self.pool.mirrors[c].param
        }
        storages.update({id(f.untyped_storage()): (True, k) for k, f in enumerate(flats)})
        again = _Regathered(self, group)

        def pack(t: torch.Tensor) -> Any:
            local, wrap = saved_piece(t)  # a tensor-parallel weight is known by its piece
            where = (
                storages.get(id(local.untyped_storage())) if type(local) is torch.Tensor else None
            )
            if where is None:
                return t
            return (again, where, local.size(), local.stride(), local.storage_offset(), wrap)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            holder, (gathered, k), size, stride, offset, wrap = packed
            src = holder.flat(k) if gathered else holder.get(k)
            return restored(src.as_strided(size, stride, offset), wrap)

        return pack, unpack
