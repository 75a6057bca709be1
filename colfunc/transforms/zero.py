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
over ``axis`` like whole tensors. ``zero`` chooses the reduction mode and keeps the state layout;
the reduction itself (the buckets, the reduce-scatters, the per-layer gathers) is done by the
one data-parallel layer of :mod:`colfunc.transforms.data_parallel`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.random import Abstract
from colfunc.step import Step, TrainState
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.data_parallel.chunks import cut_chunk, is_stacked, mesh_axes
from colfunc.transforms.data_parallel.layout import ZeroLayout
from colfunc.transforms.local import axes_reduction, sharded_axes

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["ZeroConfig", "ZeroLayout", "zero"]

PyTree = Any


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
    """ZeRO's state layout and update; the reduction it chose (``comp.reduction``: all-reduce
    at stage 0, reduce-scatter at 1-2, gather on use at 3) is applied by the data-parallel
    layer above it (:mod:`colfunc.transforms.data_parallel`)."""
    stage, axis = cfg.stage, cfg.axis
    reduction = comp.reduction
    assert reduction is not None  # (zero always implies one)
    # shard beneath (if any) leaves its update unwrapped for stages 1-3, whose chunks are
    # local tensors already
    inner_update, inner_layout = step.update, step.layout
    inner_init_extra, inner_init_opt = step.init_extra, step.init_opt

    def cut(params: PyTree) -> tuple[PyTree, ZeroLayout]:
        m = reduction.mesh  # the mesh shard bound, else the current one, checked for `axis`
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
        update=update,
    )
