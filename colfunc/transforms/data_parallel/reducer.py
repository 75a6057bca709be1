"""The one owner of data-parallel reduction: :class:`Reduction`, chosen once per composition.

``shard`` splits nothing and reduces nothing of its own: it places parameters and pushes its
tensor and sequence frames. ``zero`` chooses the reduction mode and the state layout. ``offload``
moves chunks. Everything data-parallel — the batch split, the loss mean, the gradient buckets
(all-reduced, reduce-scattered, or reduced by the backward pass of a gather on use), the overlap
with the backward pass and with the update — is here, decided from the composition when it is
built, as data:

- ``mode``: ``"all_reduce"`` (data parallel, ZeRO stage 0), ``"reduce_scatter"`` (ZeRO 1-2:
  each rank receives its averaged chunks) or ``"gather"`` (ZeRO 3: the stacked layers' gradients
  arrive as chunks from the backward pass of their per-layer gathers, the rest is reduce-scattered
  after the backward pass);
- ``when``: ``"backward"`` (buckets start as each layer's gradients are computed), ``"after"``
  (the same buckets, started after the backward pass: ``shard(overlap=False)``) or ``"sync"``
  (a pipeline beneath hands its microbatches' sums to the step's ``sync``);
- per leaf, :meth:`Reduction.leaf`: the mesh axes it is reduced over and how (none for a frozen
  leaf, which gets no buffer, no bytes on the wire and no optimizer state; under expert
  parallelism an expert weight, split over the expert axis, is reduced over the data-parallel
  axis only: its gradient holds every expert-axis rank's tokens already).

:meth:`Reduction.wrap` is the data-parallel layer of the step, applied by
:class:`~colfunc.transforms.composition.Composition` right above ``zero`` (and ``shard``);
``offload``, which replaces the forward-backward pass with its own, calls the same reduction on
its host rows (:meth:`Reduction.reduce_rows`, :meth:`Reduction.scatter_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, ShardedTensor, comm, current_mesh
from colfunc.sharding.placement import Shard
from colfunc.step import Step
from colfunc.transforms.data_parallel.buckets import (
    BUCKET_BYTES,
    GradBuckets,
    all_reduce_buckets,
    all_reduce_tree,
    finish_buckets,
)
from colfunc.transforms.data_parallel.chunks import (
    as_chunk,
    by_rank,
    is_stacked,
    padded,
    reduce_scatter_flat,
)
from colfunc.transforms.data_parallel.grad_layout import BufferPool
from colfunc.transforms.data_parallel.layer_gather import LayerGather
from colfunc.transforms.data_parallel.scatter import ScatterBuckets
from colfunc.transforms.local import as_full, in_placement, local_piece, rewrap

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition
    from colfunc.transforms.data_parallel.layout import ZeroLayout

__all__ = ["LeafReduction", "Reduction", "reduce_leaves", "split_batch"]


def _names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


PyTree = Any
Mode = Literal["all_reduce", "reduce_scatter", "gather"]
When = Literal["backward", "after", "sync"]


def split_batch(batch: PyTree, axis: str | tuple[str, ...], mesh: Mesh) -> PyTree:
    """This rank's rows of every batch tensor, split over the data-parallel ``axis`` (or
    axes: the data-parallel and the expert axis, row-major)."""
    n, i = mesh.axis_size(axis), mesh.axis_index(axis)

    def split(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] % n:
            raise ValueError(
                f"shard: batch entry {path!r} has {x.shape[0]} rows, not divisible by the "
                f"{axis!r} axis size {n}; use a global batch size that is a multiple of {n}"
            )
        # (split over several axes, the batch is cut into their product of pieces)
        return x.chunk(n, dim=0)[i]

    return tree.map_with_path(split, batch)


def reduce_leaves(
    xs: list[torch.Tensor], axis: str, mesh: Mesh, op: str = "sum"
) -> list[torch.Tensor]:
    """Gradients reduced over a non-data axis in packed buckets (a pipeline's parameters
    shared between stages are summed over its axis): local pieces in, local pieces out."""
    return all_reduce_buckets([local_piece(x) for x in xs], axis, mesh, op=op)


@dataclasses.dataclass(frozen=True)
class LeafReduction:
    """How one parameter's gradient is reduced: over which mesh axes (empty: not at all, a
    frozen leaf) and how (``mode`` of :class:`Reduction`)."""

    axes: tuple[str, ...]
    mode: Mode


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reduction:
    """A composition's data-parallel reduction (see the module): what ``shard``, ``zero`` and
    ``offload`` were given, decided once."""

    bound: Mesh | None  # the mesh shard bound (None: the current mesh, inside cf.launch)
    # the axis (or axes) the batch is split over (None: every rank the whole batch)
    split: str | tuple[str, ...] | None
    axis: str | tuple[str, ...]  # the axis (or axes) the gradients are averaged over
    # the expert axes among them: a leaf split over one is reduced over the others only
    experts: tuple[str, ...] = ()
    mode: Mode
    when: When
    stage: int | None  # the ZeRO stage that chose the mode (None: data-parallel shard alone)
    bucket_bytes: int = BUCKET_BYTES
    prefetch: int = 1  # ZeRO-3: layers whose gathers start ahead of their use
    host: bool = False  # offload keeps the gradients in host rows and reduces them there
    # the loss is averaged in the gradients' last bucket (split over the reduced axis)
    carry_loss: bool = False
    # the optimizer may start on buckets that have arrived while the last are in flight
    overlap_update: bool = False
    # the stacked weights kept in matmul order in the flat buffers (plain data parallelism)
    matmul_order: bool = False

    @classmethod
    def of(cls, comp: Composition) -> Reduction | None:
        """The reduction ``comp`` implies (None: no data-parallel axis)."""
        sh, z, off = comp.shard, comp.zero, comp.offload
        axes = sh.data_axes if sh is not None else ()
        split: str | tuple[str, ...] | None = (
            None if not axes else axes[0] if len(axes) == 1 else axes
        )
        if z is None and split is None:
            return None
        axis = z.axis if z is not None else split
        assert axis is not None
        experts = (sh.expert_ranks,) if sh is not None and sh.expert_ranks is not None else ()
        if z is not None and set(_names(z.axis)) & set(experts):
            raise ValueError(
                f"zero: axis {z.axis!r} is the expert axis; ZeRO cuts the data-parallel axis "
                "(the experts are split over theirs already): zero(..., axis='dp')"
            )
        stage = z.stage if z is not None else None
        mode: Mode = (
            "gather" if stage == 3 else "reduce_scatter" if stage in (1, 2) else "all_reduce"
        )
        overlap = sh.overlap if sh is not None else True
        when: When = "sync" if comp.pipeline is not None else "backward" if overlap else "after"
        host = off is not None and off.policy != "device"
        plain_shard = sh is None or (
            not sh.plan
            and not sh.sequence_parallel
            and sh.tensor_mode == "1d"
            and sh.expert_axis is None
        )
        buffered = mode == "all_reduce" and when != "sync" and not host
        return cls(
            bound=comp.mesh,
            split=split,
            axis=axis,
            experts=experts,
            mode=mode,
            when=when,
            stage=stage,
            bucket_bytes=comp.bucket_bytes,
            prefetch=z.prefetch if z is not None else 1,
            host=host,
            carry_loss=buffered and split == axis,
            overlap_update=(
                buffered and when == "backward" and plain_shard and comp.amp is None and off is None
            ),
            matmul_order=buffered and split == axis and plain_shard and off is None,
        )

    # --- what is reduced, and where ---------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        m = self.bound if self.bound is not None else current_mesh()
        missing = [a for a in _names(self.axis) if a not in m.axis_names]
        if missing:
            raise ValueError(
                f"zero: axis {self.axis!r} is not an axis of the mesh {m.shape}; pass axis= one "
                f"of {m.axis_names}"
            )
        return m

    @property
    def cuts_optimizer(self) -> bool:
        """ZeRO stages 1-2: whole parameters, gradients and optimizer states in chunks by rank."""
        return self.mode == "reduce_scatter"

    def leaf(self, path: str, trained: bool, param: Any = None) -> LeafReduction:
        """How the gradient of the parameter at ``path`` is reduced (``trained``: the step
        trains it; a frozen leaf is reduced over no axis; ``param``, the placed parameter: one
        split over an expert axis is not reduced over it)."""
        if not trained:
            return LeafReduction((), self.mode)
        over = (*_names(self.axis), *self.extras)
        return LeafReduction(tuple(a for a in over if a not in self._split_over(param)), self.mode)

    @property
    def extras(self) -> tuple[str, ...]:
        """The batch axes that ``mode``'s reduction (over ``axis``: ZeRO's) leaves out: the
        expert axis beside ZeRO's data-parallel one, averaged over apart
        (:meth:`over_extras`)."""
        split = () if self.split is None else _names(self.split)
        return tuple(a for a in split if a not in _names(self.axis))

    def leaves(self, step: Step, params: PyTree) -> dict[str, LeafReduction]:
        """Per parameter path, its :class:`LeafReduction` under ``step``'s trainable set."""
        trained = set(tree.paths(step.trainable_part(params)))
        return {p: self.leaf(p, p in trained, x) for p, x in tree.flatten_with_paths(params)[0]}

    def _split_over(self, param: Any) -> tuple[str, ...]:
        """The expert axes that split ``param`` (a ShardedTensor split on one of them)."""
        if not self.experts or not isinstance(param, ShardedTensor):
            return ()
        names = param._mesh.axis_names
        return tuple(
            a for a, p in zip(names, param.placements) if a in self.experts and isinstance(p, Shard)
        )

    def _apart(self, trained: PyTree) -> tuple[PyTree, PyTree]:
        """``trained`` cut in two: the leaves reduced over every axis, and the expert weights
        (reduced over the axes that do not split them, :meth:`reduce_apart`), where the
        buckets' axes include an expert axis."""
        if not set(self.experts) & set(_names(self.axis)):
            return trained, None
        apart = {p for p, x in tree.flatten_with_paths(trained)[0] if self._split_over(x)}
        if not apart:
            return trained, None
        return tree.subset(trained, lambda p: p not in apart), tree.subset(
            trained, apart.__contains__
        )

    def reduce_apart(self, grads: PyTree, params: PyTree) -> PyTree:
        """The expert weights' gradients (seeded with the whole average's ``1/n``, as the
        buckets' are) summed over the data-parallel axes that do not split them."""
        m = self.mesh
        flat, treedef = tree.flatten_with_paths(grads)
        placed = dict(tree.flatten_with_paths(params)[0])
        out = []
        by_axes: dict[tuple[str, ...], list[int]] = {}
        for k, (path, g) in enumerate(flat):
            g = in_placement(g, placed[path])
            out.append(g)
            axes = self.leaf(path, True, placed[path]).axes
            if axes and m.axis_size(axes) > 1:
                by_axes.setdefault(axes, []).append(k)
        for axes, ks in by_axes.items():
            summed = all_reduce_buckets([local_piece(out[k]) for k in ks], axes, m, op="sum")
            for k, r in zip(ks, summed):
                out[k] = rewrap(out[k], r)
        return tree.unflatten(treedef, out)

    @staticmethod
    def reduced(step: Step, params: PyTree) -> PyTree:
        """The leaves of ``params`` whose gradients are reduced: the trained ones."""
        return step.trainable_part(params)

    def split_batch(self, batch: PyTree) -> PyTree:
        return batch if self.split is None else split_batch(batch, self.split, self.mesh)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global loss: the mean of the ranks' local means over the split axis."""
        loss = as_full(loss)
        if self.split is not None:
            loss = comm.all_reduce(loss.detach(), self.split, op="avg", mesh=self.mesh)
        return loss

    def start_mean_loss(self, loss: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`mean_loss` started at once, so that it runs while the last gradient buckets
        are waited for; calling the result waits for it (the same value)."""
        loss = as_full(loss).detach()
        if self.split is None:
            return lambda: loss
        return comm.all_reduce_async(loss.clone(), self.split, op="avg", mesh=self.mesh).wait

    # --- the data-parallel layer of the step -------------------------------------------------
    def wrap(self, step: Step) -> Step:
        """``step`` (built by ``shard`` and ``zero``) with its data-parallel reduction."""
        inner_fb, inner_fwd, inner_sync = step.forward_backward, step.forward, step.sync
        pool = BufferPool()  # the gradient buffers, kept from step to step
        mode, when = self.mode, self.when

        def forward_backward(
            params: PyTree, batch: PyTree, extra: dict[str, Any]
        ) -> tuple[torch.Tensor, PyTree]:
            loss, grads = reduced_fb(params, batch, extra)
            out = loss, self.over_extras(grads, params, extra)
            sown = core.innermost(core.Sown)
            if sown is not None and self.split is not None:  # the model's reports (sums)
                split, m = self.split, self.mesh
                sown.map(lambda t: comm.all_reduce(t, split, "sum", m), stacked=True)
            return out

        def reduced_fb(
            params: PyTree, batch: PyTree, extra: dict[str, Any]
        ) -> tuple[torch.Tensor, PyTree]:
            m = self.mesh
            local = self.split_batch(batch)
            trained = self.reduced(step, params)
            n = m.axis_size(self.axis)
            if mode == "gather":  # the stacked layers gathered one at a time, as they are used
                z: ZeroLayout = extra["zero"]
                whole = self._whole_rest(params, z)
                with core.context(LayerGather(z, self.prefetch)):
                    loss, grads = inner_fb(whole, local, extra)
                grads = tree.map(in_placement, grads, self.reduced(step, whole))
                return self.mean_loss(loss), self._scatter_rest(grads, m)
            buckets: GradBuckets | ScatterBuckets | None = None
            own, apart = self._apart(trained) if self._bucketed(n) else (trained, None)
            if self._bucketed(n):
                early = when == "backward"
                buckets = GradBuckets(
                    m,
                    self.axis,
                    self.bucket_bytes,
                    own,
                    carry_loss=self.carry_loss,
                    pool=pool,
                    early=early,
                    only_own=apart is not None,
                )
            elif mode == "reduce_scatter" and when == "backward":
                buckets = ScatterBuckets(m, self.axis, self.bucket_bytes, trained)
            if buckets is None:  # reduced in sync (or a single rank: nothing to reduce)
                loss, grads = inner_fb(params, local, extra)
                return self.mean_loss(loss), tree.map(in_placement, grads, trained)
            with core.context(buckets.frame):
                loss, grads = inner_fb(params, local, extra)
            if isinstance(buckets, ScatterBuckets):
                mean = self.start_mean_loss(loss)  # in flight while the buckets are awaited
                grads = buckets.finish(grads, params)
                return mean(), grads
            if apart is not None:  # the experts' gradients: summed over the other axes
                assert isinstance(buckets, GradBuckets)
                expert = set(tree.paths(apart)).__contains__
                done = self.reduce_apart(tree.subset(grads, expert), apart)
                mine = tree.subset(grads, lambda p: not expert(p))
                mine = finish_buckets(buckets, mine, own, loss=as_full(loss))
                grads = tree.merge(tree.merge(grads, mine), done)
            else:
                grads = finish_buckets(buckets, grads, trained, loss=as_full(loss))
            if buckets.loss is not None:
                return buckets.loss, grads
            return self.mean_loss(loss), grads

        def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
            local = self.split_batch(batch)
            if mode != "gather":
                return self.mean_loss(inner_fwd(params, local, extra))
            z: ZeroLayout = extra["zero"]
            with core.context(LayerGather(z, self.prefetch)):
                return self.mean_loss(inner_fwd(self._whole_rest(params, z), local, extra))

        def sync(grads: PyTree) -> PyTree:
            grads = inner_sync(grads)
            m = self.mesh
            n = m.axis_size(self.axis)
            if mode == "gather":  # chunks arrive summed over the ranks: averaged here
                return tree.map(lambda g: g / n, grads)
            if self._bucketed(n) or (mode == "reduce_scatter" and when == "backward"):
                return grads  # reduced in forward_backward
            if mode == "all_reduce":
                return self._all_reduce_after(grads, m)
            flat, treedef = tree.flatten_with_paths(grads)
            stacked = [is_stacked(p) for p, _ in flat]
            pieces = reduce_scatter_flat(
                [by_rank(g, st, n) for (_, g), st in zip(flat, stacked)], self.axis, m, "avg"
            )
            chunks = [as_chunk(p, g, st) for p, (_, g), st in zip(pieces, flat, stacked)]
            return tree.unflatten(treedef, chunks)

        return step.replace(forward=forward, forward_backward=forward_backward, sync=sync)

    def _bucketed(self, n: int) -> bool:
        """Whether the all-reduce runs in flat buffers in the forward-backward pass (else in
        sync): not under a pipeline, and not for a single rank of zero's own axis."""
        return self.mode == "all_reduce" and self.when != "sync" and (n > 1 or self.carry_loss)

    @staticmethod
    def _whole_rest(params: PyTree, z: ZeroLayout) -> PyTree:
        """ZeRO-3: the parameters outside the stacked layers gathered whole (their gradients
        are reduce-scattered after the backward pass), the stacked layers left as chunks for
        the per-layer gathers (zero's layout has refused parameters without ``blocks``)."""
        rest = {k: v for k, v in params.items() if k != "blocks"}
        rest_metas = {k: z.metas[k] for k in rest}
        with torch.no_grad():
            return {**z.gather_chunks(rest, rest_metas), "blocks": params["blocks"]}

    def _scatter_rest(self, grads: PyTree, m: Mesh) -> PyTree:
        """ZeRO-3: the stacked layers' gradients are chunks already (their gathers' backward
        scattered them); the others are reduce-scattered here, summed (averaged in sync)."""
        n = m.axis_size(self.axis)
        rest = {k: v for k, v in grads.items() if k != "blocks"}
        flat, treedef = tree.flatten_with_paths(rest)
        chunks = reduce_scatter_flat([padded(g, n) for _, g in flat], self.axis, m, "sum")
        blocks = {"blocks": grads["blocks"]} if "blocks" in grads else {}  # (all frozen: none)
        return {**tree.unflatten(treedef, chunks), **blocks}

    def _all_reduce_after(self, grads: PyTree, m: Mesh) -> PyTree:
        """Every gradient averaged over ``axis`` after the backward pass (a pipeline's sums);
        an expert weight's, where ``axis`` holds its expert axis, summed over the axes that do
        not split it and divided by all of ``axis``'s ranks (it holds the expert ranks' tokens
        already; an expert axis beside ``axis`` is :meth:`over_extras`'s)."""
        own, apart = self._apart(grads)
        if apart is None:
            return all_reduce_tree(grads, self.axis, m)
        n = m.axis_size(self.axis)
        experts = tree.map(lambda g: g / n, self.reduce_apart(apart, apart))
        return tree.merge(tree.merge(grads, all_reduce_tree(own, self.axis, m)), experts)

    def over_extras(self, grads: PyTree, params: PyTree, extra: dict[str, Any]) -> PyTree:
        """``grads`` (reduced over ``axis`` by the mode, or still to be in ``sync``: this is
        linear and commutes with it) averaged over :attr:`extras` too: an expert weight's
        gradient, which holds every expert-axis rank's tokens already, divided by their number,
        every other one all-reduced."""
        if not self.extras or self.mesh.axis_size(self.extras) == 1:
            return grads
        z = extra.get("zero")  # ZeRO-3 keeps its parameters as chunks: the templates say
        placed = dict(tree.flatten_with_paths(z.metas if z is not None else params)[0])
        flat, treedef = tree.flatten_with_paths(grads)
        expert = [
            bool(self._split_over(getattr(placed[p], "template", placed[p]))) for p, _ in flat
        ]
        return tree.unflatten(treedef, self._averaged_over_extras([g for _, g in flat], expert))

    def _averaged_over_extras(self, xs: list[torch.Tensor], experts: list[bool]) -> list[Any]:
        """``xs`` averaged over :attr:`extras` (more than one rank): those ``experts`` flags
        divided by its size (they hold its ranks' tokens already), the others all-reduced."""
        m, extras = self.mesh, self.extras
        n = m.axis_size(extras)
        rest = [local_piece(x) for x, e in zip(xs, experts) if not e]
        averaged = iter(all_reduce_buckets(rest, extras, m, op="avg"))
        return [x / n if e else rewrap(x, next(averaged)) for x, e in zip(xs, experts)]

    # --- the same reduction on host rows (offload) -------------------------------------------
    def reduce_rows(self, xs: list[torch.Tensor], experts: list[bool] | None = None) -> None:
        """Average the gradients ``xs`` (host rows, device-homed mirrors' pieces) over the
        axis, in place. ZeRO-3's arrive summed over the ranks by the gathers' backward; ZeRO 1-2
        reduce-scatter theirs in :meth:`scatter_rows`. ``experts`` flags the pieces of expert
        weights split over an expert axis: not reduced over it, but divided by its size (they
        hold its ranks' tokens already); the others are averaged over :attr:`extras` too."""
        m = self.mesh
        n = m.axis_size(self.axis)
        flags = experts if experts is not None else [False] * len(xs)
        if self.mode == "reduce_scatter" or (n == 1 and not any(flags) and not self.extras):
            return
        with torch.no_grad():
            if self.mode == "gather":
                for x in xs:
                    x.div_(n)
            else:
                groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
                for x, e in zip(xs, flags):
                    axes = tuple(a for a in _names(self.axis) if not (e and a in self.experts))
                    groups.setdefault(axes, []).append(x)
                for axes, group in groups.items():
                    if axes and m.axis_size(axes) > 1:
                        for x, r in zip(group, all_reduce_buckets(group, axes, m), strict=True):
                            x.copy_(r)
            if any(flags):
                k = m.axis_size(self.experts)
                for x, e in zip(xs, flags):
                    if e:
                        x.div_(k)
            rest = [x for x, e in zip(xs, flags) if not e]
            if self.extras and m.axis_size(self.extras) > 1 and rest:
                averaged = all_reduce_buckets(rest, self.extras, m, op="avg")
                for x, r in zip(rest, averaged, strict=True):
                    x.copy_(r)

    def expert_flags(self, templates: list[Any]) -> list[bool]:
        """Per placed parameter (its ShardedTensor template, or None), whether an expert axis
        splits it."""
        return [bool(self._split_over(t)) for t in templates]

    def scatter_rows(
        self, xs: list[torch.Tensor], stacked: list[bool], experts: list[bool] | None = None
    ) -> list[torch.Tensor]:
        """This rank's averaged chunks of whole gradients ``xs`` (ZeRO 1-2 on host rows).
        ``experts`` flags the expert weights split over an expert axis beside ``axis``: their
        chunks divided by its size (they hold its ranks' tokens already), every other chunk
        averaged over :attr:`extras` too (the same chunk on each of their ranks: ZeRO cuts by
        the rank on ``axis`` only)."""
        m = self.mesh
        n = m.axis_size(self.axis)
        with torch.no_grad():
            pieces = reduce_scatter_flat(
                [by_rank(g, st, n) for g, st in zip(xs, stacked)], self.axis, m, "avg"
            )
            chunks = [as_chunk(p, g, st) for p, g, st in zip(pieces, xs, stacked)]
            if not self.extras or m.axis_size(self.extras) == 1:
                return chunks
            return self._averaged_over_extras(chunks, experts or [False] * len(chunks))
