"""``shard``: data parallel over a batch axis and tensor parallel by a plan of path patterns.

Parameters are placed by ``plan``, a mapping of glob path patterns to partition specs (e.g. a
model's ``tp_plan``: Megatron's column-parallel q/k/v and MLP-in, row-parallel out-projections,
vocabulary-parallel embedding). A parameter that no pattern names is replicated. The sharded
parameters are :class:`~colfunc.sharding.ShardedTensor`\\ s, so the unchanged single-device model
runs on them and the propagation rules insert the collectives.

Every rank is handed the same global batch and keeps its slice along dim 0 over ``batch_axis``,
and the gradients are averaged over that axis in a few large buckets (one ``all_reduce`` per
bucket rather than one per parameter), as DDP does: each scanned layer's gradients are packed
into the open bucket as soon as the backward pass has computed them, and a full bucket's
``all_reduce`` starts at once, running while the backward pass goes on to the earlier layers. The
parameters outside the stacked layers (embeddings, final norm) follow in the last buckets. The
loss is the mean of the ranks' local means, which is the global mean when every rank holds the
same number of counted labels (always so without ``-100`` labels).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from colfunc import core, tree
from colfunc.core import P
from colfunc.sharding import Mesh, ShardedTensor, comm, distribute, placements_from_spec
from colfunc.sharding.placement import Shard
from colfunc.step import Step, TrainState, Update
from colfunc.transforms.buckets import (
    _GradBuckets,
    _in_placement,
    _local,
    _rewrap,
    all_reduce_tree,
)

__all__ = ["shard"]

PyTree = Any


class _ReducedAbove:
    """Frame: a transform applied over ``shard`` (``zero``) reduces the data-parallel gradients
    itself, so ``shard``'s forward-backward must leave them unreduced."""


def _to_local(t: PyTree) -> PyTree:
    return tree.map(lambda x: _local(x) if isinstance(x, torch.Tensor) else x, t)


def _like(template: PyTree, local: PyTree) -> PyTree:
    """``local``'s leaves wrapped back with the metadata of ``template``'s sharded leaves."""
    return tree.map(
        lambda t, x: _rewrap(t, x) if isinstance(t, ShardedTensor) else x, template, local
    )


def _sharded_axes(x: Any) -> tuple[str, ...]:
    if not isinstance(x, ShardedTensor):
        return ()
    return tuple(a for a, pl in zip(x.mesh.axis_names, x.placements) if isinstance(pl, Shard))


def axes_reduction(axes: list[tuple[str, ...]], mesh: Mesh) -> core.NormReduction:
    """Squared norms of local pieces, each summed over the axes that partition its tensor.

    ``axes[i]`` names the mesh axes over which leaf ``i`` is split (empty: replicated, counted
    once). Leaves split the same way are added up first, so there is one all_reduce per kind.
    """

    def reduce(squares: list[torch.Tensor]) -> torch.Tensor:
        groups: dict[tuple[str, ...], torch.Tensor] = {}
        for ax, sq in zip(axes, squares):
            groups[ax] = groups[ax] + sq if ax in groups else sq
        total = torch.zeros((), dtype=squares[0].dtype)
        for ax in sorted(groups):  # the same order on every rank
            part = groups[ax]
            total = total + (comm.all_reduce(part, ax, mesh=mesh) if ax else part)
        return total

    return core.NormReduction(reduce)


def norm_reduction(grads: PyTree, mesh: Mesh) -> core.NormReduction:
    """How the local squared norms of ``grads``' leaves add up to the global squared norm."""
    return axes_reduction([_sharded_axes(g) for g in tree.tensors(grads)], mesh)


def local_update(update: Update, mesh: Mesh) -> Update:
    """Run an update piece on the local shards of sharded parameters, states and gradients.

    Optimizers are elementwise, so updating each shard is updating the whole; only the global
    gradient norm needs the other ranks, which :func:`norm_reduction` provides.
    """

    def run(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        local_state = state._replace(
            params=_to_local(state.params), opt_state=_to_local(state.opt_state)
        )
        with core.context(norm_reduction(grads, mesh)):
            new, info = update(_to_local(grads), local_state)
        new = new._replace(
            params=_like(state.params, new.params), opt_state=_like(state.opt_state, new.opt_state)
        )
        return new, info

    return run


def _check_plan(plan: dict[str, P] | None, mesh: Mesh) -> dict[str, P]:
    if plan is None:
        return {}
    if not isinstance(plan, dict):
        raise TypeError(
            f"shard: plan must be a dict of path pattern -> cf.P, got {type(plan).__name__}"
        )
    for pattern, spec in plan.items():
        if not isinstance(spec, P):
            raise TypeError(f"shard: plan[{pattern!r}] must be a cf.P, got {spec!r}")
        missing = [a for a in spec.axes() if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"shard: plan[{pattern!r}] = {spec!r} uses axis {missing[0]!r}, which the mesh "
                f"{mesh.shape} lacks; add the axis to the mesh or drop it from the plan"
            )
    return dict(plan)


def _place(params: PyTree, plan: dict[str, P], mesh: Mesh) -> PyTree:
    if not plan:
        return params  # data parallel only: plain tensors, replicated
    flat = tree.flatten_with_paths(params)[0]
    unused = [pat for pat in plan if not any(tree.match(pat, p) for p, _ in flat)]
    if unused:
        raise ValueError(
            f"shard: plan pattern {unused[0]!r} matches no parameter; parameter paths look like "
            f"{[p for p, _ in flat[:4]]}"
        )

    def place(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        # every parameter becomes a ShardedTensor (replicated unless named), so parameters,
        # gradients and optimizer states have one type and the rules see every operand's placement
        spec = next((s for pat, s in plan.items() if tree.match(pat, path)), P())
        placements = placements_from_spec(mesh, spec, x.dim())
        for axis, pl in zip(mesh.axis_names, placements):
            if isinstance(pl, Shard) and x.shape[pl.dim] % mesh.axis_size(axis):
                raise ValueError(
                    f"shard: {path} has size {x.shape[pl.dim]} on dim {pl.dim}, not divisible by "
                    f"the {axis!r} axis size {mesh.axis_size(axis)} (e.g. heads by tp); choose a "
                    "mesh that divides it"
                )
        return distribute(x, mesh, placements)

    return tree.map_with_path(place, params)


def _split_batch(batch: PyTree, axis: str, mesh: Mesh) -> PyTree:
    n, i = mesh.axis_size(axis), mesh.axis_index(axis)

    def split(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] % n:
            raise ValueError(
                f"shard: batch entry {path!r} has {x.shape[0]} rows, not divisible by the "
                f"{axis!r} axis size {n}; use a global batch size that is a multiple of {n}"
            )
        return x.chunk(n, dim=0)[i]

    return tree.map_with_path(split, batch)


class _SequenceParallel:
    """Frame: the residual stream between layers is split on the sequence dim over ``axis``.

    Megatron-LM's sequence parallelism (Korthikanti et al. 2022): outside the tensor-parallel
    matmuls, each rank keeps only its part of the sequence, so norms and residual adds are not
    repeated and their activations are not stored whole on every rank. The propagation rules then
    all-gather the sequence before the column-parallel matmuls and reduce-scatter the row-parallel
    outputs back onto it, in place of Megatron's all-reduce.
    """

    def __init__(self, mesh: Mesh, axis: str) -> None:
        self.mesh, self.axis = mesh, axis

    def split(self, h: torch.Tensor) -> torch.Tensor:
        n = self.mesh.axis_size(self.axis)
        if h.dim() < 2 or h.shape[1] % n:
            raise ValueError(
                f"shard: sequence parallelism splits the sequence dim over {self.axis!r} "
                f"(size {n}); the activations have shape {tuple(h.shape)}: use a sequence length "
                f"divisible by {n}"
            )
        if not isinstance(h, ShardedTensor):
            h = distribute(h, self.mesh)
        placements = [
            Shard(1) if a == self.axis else pl for a, pl in zip(self.mesh.axis_names, h.placements)
        ]
        return h.redistribute(placements)

    def scan_layers(self, block: Any, h: torch.Tensor, blocks: PyTree, inner: Any) -> torch.Tensor:
        return inner(lambda layer, x: self.split(block(layer, x)), self.split(h), blocks)


def _zero() -> Any:
    from colfunc.transforms.zero import zero  # zero imports this module

    return zero


def _sequence_frame(plan: dict[str, P], mesh: Mesh, dp: str | None) -> _SequenceParallel:
    axes = sorted({a for spec in plan.values() for a in spec.axes()} - {dp})
    if len(axes) != 1:
        raise ValueError(
            "shard: sequence_parallel=True needs a plan that splits parameters over exactly one "
            f"tensor-parallel axis; the plan uses {axes}"
        )
    return _SequenceParallel(mesh, axes[0])


def shard(
    step: Step,
    mesh: Mesh,
    plan: dict[str, P] | None = None,
    batch_axis: str | None = "dp",
    sequence_parallel: bool = False,
    *,
    bucket_mb: float = 25.0,
    overlap: bool = True,
) -> Step:
    """Data parallel over ``batch_axis`` and tensor parallel by ``plan``; see the module docs.

    ``batch_axis=None`` (or an axis the mesh does not have, for the default ``"dp"``) turns data
    parallelism off. Call it on every rank with that rank's mesh. ``bucket_mb`` is the size of the
    gradient buckets (DDP's ``bucket_cap_mb``); ``overlap=False`` reduces them only after the
    backward pass. Under a pipeline the reduction always follows the backward pass, since the
    microbatches' gradients are complete only then.

    Example:
        >>> def main(mesh):
        ...     s = cf.shard(cf.train_step(gpt.loss(cfg), optim.adamw(3e-4)), mesh, gpt.tp_plan)
        >>> cf.launch(main, mesh={"dp": 2, "tp": 2})
    """
    if not isinstance(step, Step):
        raise TypeError(f"shard: expected a Step (from cf.train_step), got {type(step).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard: mesh must be a cf.Mesh (the one launch passes), got {mesh!r}")
    if batch_axis is not None and batch_axis not in mesh.axis_names:
        if batch_axis != "dp":
            raise ValueError(
                f"shard: batch_axis {batch_axis!r} is not a mesh axis; mesh axes are "
                f"{mesh.axis_names}"
            )
        batch_axis = None
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not bucket_mb > 0:
        raise ValueError(f"shard: bucket_mb must be a number > 0 (megabytes), got {bucket_mb!r}")
    plan_ = _check_plan(plan, mesh)
    divisors = getattr(step.loss_fn, "divisors", {})
    for axis in sorted({a for spec in plan_.values() for a in spec.axes()}):
        n = mesh.axis_size(axis)
        for field, value in divisors.items():
            if value is not None and value % n:
                raise ValueError(
                    f"shard: {getattr(step.loss_fn, 'name', 'the model')} has {field}={value}, "
                    f"not divisible by the {axis!r} axis size {n}; choose a {axis!r} size that "
                    f"divides it"
                )
    if plan_ and "zero" in step.options:
        # zero cuts what shard places, so under a tensor-parallel plan shard must come first:
        # rebuild the composition with shard moved in just before zero (the two commute in
        # meaning; only this order can be carried out)
        rebuilt = step.options["base"]
        for transform, kwargs in step.options["applied"]:
            if transform is _zero():
                rebuilt = shard(
                    rebuilt,
                    mesh,
                    plan,
                    batch_axis,
                    sequence_parallel,
                    bucket_mb=bucket_mb,
                    overlap=overlap,
                )
            rebuilt = transform(rebuilt, **kwargs)
        return rebuilt
    dp = batch_axis if batch_axis is not None and mesh.axis_size(batch_axis) > 1 else None
    bucket_bytes = max(1, int(bucket_mb * 2**20))
    # the reduction starts inside the backward pass unless zero beneath owns it or a pipeline
    # beneath differentiates microbatch by microbatch; else it is the sync piece, after it
    in_backward = (
        dp is not None and overlap and "zero" not in step.options and "pipeline" not in step.options
    )
    inner_layout, inner_fb, inner_sync = step.layout, step.forward_backward, step.sync
    update = local_update(step.update, mesh) if plan_ else step.update

    def layout(params: PyTree) -> PyTree:
        return _place(inner_layout(params), plan_, mesh)

    seq = _sequence_frame(plan_, mesh, dp) if sequence_parallel else None

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        local_batch = _split_batch(batch, dp, mesh) if dp else batch
        reduce_here = in_backward and core.innermost(_ReducedAbove) is None
        buckets = _GradBuckets(mesh, dp, bucket_bytes) if reduce_here and dp else None
        with contextlib.ExitStack() as stack:
            if seq is not None:
                stack.enter_context(core.context(seq))
            if buckets is not None:
                stack.enter_context(core.context(buckets.frame))
            loss, grads = inner_fb(params, local_batch, extra)
        if isinstance(loss, ShardedTensor):
            loss = loss.full_tensor()
        if buckets is not None:
            return loss, buckets.finish(grads, params)
        # gradients take their parameter's placements (a rule may leave one Partial)
        return loss, tree.map(_in_placement, grads, params)

    def sync(grads: PyTree) -> PyTree:
        grads = inner_sync(grads)
        # zero beneath owns the data-parallel reduction; else it ran inside the backward pass
        if dp is None or "zero" in step.options or in_backward:
            return grads
        return all_reduce_tree(grads, dp, mesh)

    def loss_over_dp(fb: Any) -> Any:
        def wrapped(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> Any:
            loss, grads = fb(params, batch, extra)
            if dp is not None:
                loss = comm.all_reduce(loss.detach(), dp, op="avg", mesh=mesh)
            return loss, grads

        return wrapped

    return step.replace(
        layout=layout,
        forward_backward=loss_over_dp(forward_backward),
        sync=sync,
        update=update,
        options={
            **step.options,
            **step.recorded(
                shard,
                mesh=mesh,
                plan=plan,
                batch_axis=batch_axis,
                sequence_parallel=sequence_parallel,
                bucket_mb=bucket_mb,
                overlap=overlap,
            ),
            "mesh": mesh,
            "batch_axis": dp,
            "bucket_bytes": bucket_bytes,
            "overlap": overlap,
            "plan": plan_,
            "sync_before_dp": inner_sync,
            "update_before_local": step.update,
        },
    )
