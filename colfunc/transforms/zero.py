"""``zero``: ZeRO (Rajbhandari et al. 2020) over the data-parallel axis.

Stage 0 is plain data parallel: gradients are all-reduced in buckets started during the backward
pass and every rank runs the whole update (over ``shard``'s own data-parallel axis, ``shard``'s
buckets do it, the loss in the last of them, exactly as without ``zero``).
Stage 1 shards the optimizer states: each parameter (each layer of the stacked ones) is flattened,
padded to a multiple of ``N`` (the axis size) and cut in ``N`` chunks; gradients are
reduce-scattered so that each rank receives the averaged chunk it owns, updates that chunk of the
parameter with its chunk of the optimizer state, and the new parameters are all-gathered. The
reduce-scatters run in buckets started during the backward pass, as each layer's gradients are
computed. Stage 2 also keeps only the owned gradient chunk; a functional step never holds more,
so stages 1 and 2 run the same code (and each sends ``2 * Psi * (N - 1) / N`` elements per step).
Stage 3 stores the parameters themselves as chunks: the stacked layers are gathered one layer at a
time inside :func:`colfunc.scan_layers`, each gather started ``prefetch`` layers ahead of its use
so that it runs while the layers before it compute. Saved-tensor hooks keep the backward pass
from holding on to the gathered weights: they are freed after the layer's forward pass and
gathered again (prefetched the same way, in reverse order) when its backward pass first needs
them, without recomputing the layer (tensor-parallel weights are known by their local pieces).
Under ``remat`` the checkpoint already drops them. The gradient of a gather
is a reduce-scatter, so each rank receives its gradient chunks directly (``3 * Psi * (N - 1) / N``
for the layers). The parameters outside the stacked layers (embeddings, final norm) are gathered
once per step and kept until its backward pass (``2 * Psi * (N - 1) / N`` for those).

``zero`` works with or without ``shard`` underneath or on top: tensor-parallel shards are chunked
over ``axis`` like whole tensors, and ``shard`` leaves the data-parallel reduction to ``zero``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.random import Abstract
from colfunc.sharding import Mesh, comm, current_mesh
from colfunc.step import Step, TrainState
from colfunc.transforms.buckets import (
    GradBuckets,
    PackedBuckets,
    all_reduce_tree,
    finish_buckets,
)
from colfunc.transforms.chunks import (
    Chunked,
    as_chunk,
    by_rank,
    cut_chunk,
    gather_flat,
    is_stacked,
    mesh_axes,
    padded,
    reduce_scatter_flat,
    whole,
)
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.grad_layout import BufferPool
from colfunc.transforms.layer_gather import LayerGather
from colfunc.transforms.local import axes_reduction, in_placement, local_piece, sharded_axes

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["ZeroConfig", "ZeroLayout", "zero"]

PyTree = Any


class ZeroLayout:
    """The cut of every parameter (``state.extra["zero"]``); gathers stage-3 parameters whole."""

    def __init__(self, metas: PyTree, axis: str, mesh: Mesh, stage: int) -> None:
        self.metas, self.axis, self.mesh, self.stage = metas, axis, mesh, stage

    def gather(self, chunk: torch.Tensor, meta: Chunked) -> torch.Tensor:
        return whole(comm.all_gather(chunk, self.axis, chunk.dim() - 1, self.mesh), meta)

    def metas_of(self, part: PyTree) -> PyTree:
        """The cuts of the leaves ``part`` holds: all of them, or a subset of the parameters'
        (an optimizer over part of them)."""
        if tree.structure(part) == tree.structure(self.metas):
            return self.metas
        return tree.subset(self.metas, set(tree.paths(part)).__contains__)

    def gather_params(self, params: PyTree) -> PyTree:
        """Whole parameters from stage-3 chunks (a collective; identity for stages 0-2)."""
        if self.stage < 3:
            return params
        with torch.no_grad():
            return tree.map(self.gather, params, self.metas_of(params))

    def gather_chunks(self, chunks: PyTree, metas: PyTree = None) -> PyTree:
        """Whole tensors from a tree of this rank's chunks (``[L, c]`` for stacked ones, ``[c]``
        for the others), in one all_gather per dtype. ``metas`` is the part of the layout that
        ``chunks`` holds, when it is not the whole parameter tree."""
        n = self.mesh.axis_size(self.axis)
        flat, treedef = tree.flatten_with_paths(chunks)
        metas = treedef.flatten_up_to(self.metas if metas is None else metas)
        cs = [c for _, c in flat]
        gathered = gather_flat([c.reshape(-1) for c in cs], self.axis, self.mesh)  # [n * numel]
        out = []
        for f, c, m in zip(gathered, cs, metas):
            if m.stacked:  # rank-major [n, L, c] to layer-major [L, n * c]
                f = f.view(n, *c.shape).transpose(0, 1).reshape(c.shape[0], -1)
            out.append(whole(f, m))
        return tree.unflatten(treedef, out)

    def gather_opt(self, states: PyTree) -> PyTree:
        """Whole tensors from a tree of this rank's chunks shaped like the parameters, as the
        optimizer states of stages 1-3 are kept (a collective; identity for stage 0)."""
        if self.stage == 0:
            return states
        if self.stage == 3:
            return self.gather_params(states)
        with torch.no_grad():
            return self.gather_chunks(states, self.metas_of(states))

    def place_opt(self, states: PyTree) -> PyTree:
        """This rank's chunks of whole (placed) tensors shaped like the parameters: the layout of
        the optimizer states in stages 1 and 2 (stage 3's parameters are chunks already)."""
        if self.stage not in (1, 2):
            return states
        n, i = self.mesh.axis_size(self.axis), self.mesh.axis_index(self.axis)
        metas = self.metas_of(states)
        return tree.map(lambda x, m: cut_chunk(x, n, i, m.stacked)[0], states, metas)

    def __repr__(self) -> str:
        return f"ZeroLayout(stage={self.stage}, axis={self.axis!r})"


class ScatterBuckets(PackedBuckets):
    """ZeRO 1-2's gradient reduce-scatter, started during the backward pass.

    Packed buckets (:class:`~colfunc.transforms.buckets.PackedBuckets`) in which each gradient
    is laid out by rank (:func:`by_rank`; a scanned layer's row is cut as that layer's
    chunk is) and a bucket is reduce-scattered, so each rank receives only its averaged chunks.
    """

    def __init__(self, mesh: Mesh, axis: str, bucket_bytes: int) -> None:
        super().__init__(mesh, axis, bucket_bytes)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The arguments of :func:`zero`, checked."""

    stage: int = 1
    axis: str = "dp"
    prefetch: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero: stage must be 0, 1, 2 or 3, got {self.stage!r}")
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(
                f"zero: prefetch must be an int >= 0 (layers gathered ahead of use), got {p!r}"
            )
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"zero: axis must be a mesh axis name, got {self.axis!r}")

    def build(self, step: Step, comp: Composition) -> Step:
        return _build(step, self, comp)


def zero(step: Step, stage: int = 1, axis: str = "dp", prefetch: int = 1) -> Step:
    """Shard optimizer states (1), gradients (2) and parameters (3) over ``axis``; see the module.

    Call it on every rank. The mesh is the one ``shard`` bound, else the current mesh (inside
    ``cf.launch``). Without a data-parallel ``shard`` the batch is not split: every rank computes
    on the whole batch, and the gradients are still averaged over ``axis``. ``prefetch`` (stage
    3) is how many layers ahead each layer's gather starts; each costs one layer's gathered
    weights of memory (0: gather each layer when it is used).

    Example:
        >>> s = cf.zero(cf.shard(cf.train_step(loss_fn, optim.adamw(3e-4)), mesh, plan), stage=2)
    """
    return apply_transform(step, "zero", ZeroConfig(stage=stage, axis=axis, prefetch=prefetch))


def _check_blocks(params: PyTree) -> None:
    if not isinstance(params, dict) or "blocks" not in params:
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"zero: stage 3 gathers the stacked layers one at a time from params['blocks'], but "
            f"the parameters have no 'blocks' entry (their keys are {keys}); put the stacked "
            "layers under 'blocks' (as cf.layered and the models do), or use stage 1 or 2"
        )


def _build(step: Step, cfg: ZeroConfig, comp: Composition) -> Step:
    stage, axis, prefetch = cfg.stage, cfg.axis, cfg.prefetch
    bound = comp.mesh
    # shard beneath (if any) leaves the data-parallel reduction to this transform, and leaves its
    # update unwrapped for stages 1-3, whose chunks are local tensors already
    inner_sync, inner_update = step.sync, step.update
    inner_layout, inner_fb, inner_fwd = step.layout, step.forward_backward, step.forward
    # stages 0-2 reduce each layer's gradients as they come, as shard does (stage 0 all-reduces,
    # stages 1-2 reduce-scatter), unless a pipeline beneath differentiates microbatch by
    # microbatch; stage 3's gathers reduce-scatter by themselves
    in_backward = stage < 3 and comp.reduce_in_backward
    # stage 0's gradients land in flat buffers, reduced in the backward pass or after it (as
    # shard's), unless a pipeline beneath hands its microbatches' sums to ``sync``
    buffered = stage == 0 and comp.pipeline is None
    # stage 0 over shard's data-parallel axis: shard reduces, as it does alone
    delegated = not comp.zero_reduces
    bucket_bytes = comp.bucket_bytes
    inner_init_extra, inner_init_opt = step.init_extra, step.init_opt

    def mesh_() -> Mesh:
        m = bound if bound is not None else current_mesh()
        if axis not in m.axis_names:
            raise ValueError(
                f"zero: axis {axis!r} is not an axis of the mesh {m.shape}; pass axis= one of "
                f"{m.axis_names}"
            )
        return m

    def cut(params: PyTree) -> tuple[PyTree, ZeroLayout]:
        m = mesh_()
        n, i = m.axis_size(axis), m.axis_index(axis)
        flat, treedef = tree.flatten_with_paths(params)
        # stacked layers are cut layer by layer, so that each layer's gradients can be
        # reduce-scattered (stages 1-2) or its parameters gathered (stage 3) on their own
        # an abstract parameter is made here, one at a time, and only its chunk is kept
        pairs = [
            cut_chunk(
                x.materialize() if isinstance(x, Abstract) else x,
                n,
                i,
                stage >= 1 and is_stacked(p),
            )
            for p, x in flat
        ]
        chunks = tree.unflatten(treedef, [c for c, _ in pairs])
        metas = tree.unflatten(treedef, [mt for _, mt in pairs])
        return chunks, ZeroLayout(metas, axis, m, stage)

    def layout(params: PyTree) -> PyTree:
        params = inner_layout(params)
        if stage < 3:
            return params
        _check_blocks(params)
        return cut(params)[0]

    def init_extra(params: PyTree) -> dict[str, Any]:
        return {**inner_init_extra(params), "zero": cut(inner_layout(params))[1]}

    def init_opt(placed: PyTree) -> PyTree:
        # stage 0 keeps whole states; the others mirror this rank's chunks (stage 3's parameters
        # are chunks already)
        return inner_init_opt(placed if stage in (0, 3) else cut(placed)[0])

    def whole_rest(params: PyTree, z: ZeroLayout) -> PyTree:
        """The non-stacked parameters gathered whole (their grads are scattered below), the
        stacked layers left as chunks for the per-layer gathers."""
        rest = {k: v for k, v in params.items() if k != "blocks"}
        rest_metas = {k: z.metas[k] for k in rest}
        with torch.no_grad():
            return {**z.gather_chunks(rest, rest_metas), "blocks": params["blocks"]}

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        if stage < 3:
            return inner_fwd(params, batch, extra)
        z: ZeroLayout = extra["zero"]
        with core.context(LayerGather(z, prefetch)):
            return inner_fwd(whole_rest(params, z), batch, extra)

    pool = BufferPool()  # stage 0's gradient buffers, kept from step to step

    def forward_backward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> Any:
        if stage < 3:
            m = mesh_()
            # (one rank's all_reduce is the identity; its reduce-scatter still cuts the chunks)
            one = stage == 0 and m.axis_size(axis) == 1
            if delegated or one or not (in_backward or buffered):
                return inner_fb(params, batch, extra)
            trained = step.trainable_part(params)  # the leaves that get gradients
            buckets: GradBuckets | ScatterBuckets = (
                GradBuckets(m, axis, bucket_bytes, trained, pool=pool, early=in_backward)
                if stage == 0
                else ScatterBuckets(m, axis, bucket_bytes)
            )
            with core.context(buckets.frame):
                loss, grads = inner_fb(params, batch, extra)
            if isinstance(buckets, GradBuckets):
                return loss, finish_buckets(buckets, grads, trained)
            return loss, buckets.finish(grads, params)
        z: ZeroLayout = extra["zero"]
        with core.context(LayerGather(z, prefetch)):
            loss, grads = inner_fb(whole_rest(params, z), batch, extra)
        n = z.mesh.axis_size(axis)
        # the stacked layers' gradients are chunks already (the gathers' backward scattered them)
        rest_grads = {k: v for k, v in grads.items() if k != "blocks"}
        flat, treedef = tree.flatten_with_paths(rest_grads)
        chunks = reduce_scatter_flat([padded(g, n) for _, g in flat], axis, z.mesh, "sum")
        blocks = {"blocks": grads["blocks"]} if "blocks" in grads else {}  # (all frozen: none)
        return loss, {**tree.unflatten(treedef, chunks), **blocks}

    def sync(grads: PyTree) -> PyTree:
        grads = inner_sync(grads)
        if delegated:
            return grads
        m = mesh_()
        n = m.axis_size(axis)
        if in_backward or (buffered and n > 1):
            return grads  # reduced in forward_backward
        if stage == 0:
            return all_reduce_tree(grads, axis, m)
        if stage == 3:  # chunks arrive summed over the ranks: average, like the other stages
            return tree.map(lambda g: g / n, grads)
        flat, treedef = tree.flatten_with_paths(grads)
        stacked = [is_stacked(p) for p, _ in flat]
        pieces = reduce_scatter_flat(
            [by_rank(g, st, n) for (_, g), st in zip(flat, stacked)], axis, m, "avg"
        )
        chunks = [as_chunk(p, g, st) for p, (_, g), st in zip(pieces, flat, stacked)]
        return tree.unflatten(treedef, chunks)

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        if stage == 0:
            return inner_update(grads, state)
        z: ZeroLayout = state.extra["zero"]
        m = z.mesh
        chunks = state.params if stage == 3 else cut(state.params)[0]
        # each chunk partitions its local parameter over `axis`, and tensor-parallel shards
        # partition it further over their own axes
        frozen = step.trainable is not None  # some leaves are not trained: grads has the others
        metas = z.metas_of(grads) if frozen else z.metas
        axes = [mesh_axes(m, {axis, *sharded_axes(mt.template)}) for mt in tree.leaves(metas)]
        with core.context(axes_reduction(axes, m)):
            new, info = inner_update(grads, state._replace(params=chunks))
        if stage == 3:
            return new, info
        with torch.no_grad():
            if not frozen:
                return new._replace(params=z.gather_chunks(new.params)), info
            # the updated leaves gathered back; the frozen ones never moved
            trained = tree.subset(new.params, set(tree.paths(grads)).__contains__)
            params = tree.merge(state.params, z.gather_chunks(trained, metas))
        return new._replace(params=params), info

    return step.replace(
        layout=layout,
        init_opt=init_opt,
        init_extra=init_extra,
        forward=forward,
        forward_backward=forward_backward,
        sync=sync,
        update=update,
    )
