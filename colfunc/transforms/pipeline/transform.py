"""``pipeline``: the stacked layers cut into stages over a mesh axis, run by a schedule.

The loss must be a ``cf.layered(pre, block, post)``: ``pre`` runs on the first stage, each stage
runs its run of layers, ``post`` (and the loss) runs on the last. With ``stages=p`` and
``virtual_stages=v`` the ``L`` stacked layers of ``params["blocks"]`` make ``p * v`` stages of
consecutive layers, as even as possible (the first ``L % (p * v)`` stages one layer longer; the
layout object in ``state.extra["pipeline"]`` says so), and rank ``r`` of the ``axis`` keeps
stages ``r, r + p, ...`` (round robin). The parameters outside ``blocks`` stay on every rank of
the axis; their gradients are summed over it, which adds up a tied embedding's two uses (input
embedding on the first stage, output head on the last) and leaves the others as computed.

The batch is cut into ``microbatches`` along dim 0 and run by the schedule (see
:mod:`.schedules`); the loss is the mean over microbatches, on every rank; the gradients are those
of the mean loss, as on one device. Gradient clipping sees the norm of every stage's gradients.

It composes with the other transforms in any order (it always runs innermost), e.g.
``cf.zero(cf.shard(cf.pipeline(step, 2, 4), mesh, plan=tp_plan), stage=1)``; the mesh is the
current one (inside ``cf.launch``) and must have ``axis`` of size ``stages``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, ShardedTensor, comm, current_mesh, from_local
from colfunc.sharding.placement import Shard
from colfunc.step import Step, TrainState
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.data_parallel import reduce_leaves
from colfunc.transforms.local import local_piece, rewrap
from colfunc.transforms.pipeline import schedules
from colfunc.transforms.pipeline.link import DTYPES
from colfunc.transforms.pipeline.runtime import Runner

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["PipelineConfig", "PipelineLayout", "pipeline", "pipeline_from_config"]

PyTree = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The arguments of :func:`pipeline`, checked; also the ``parallel = dict(pipeline=...)``
    entry of a config file."""

    stages: int
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str = "pp"

    def __post_init__(self) -> None:
        schedules.check(self.schedule, self.stages, self.microbatches, self.virtual_stages)
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"pipeline: axis must be a mesh axis name, got {self.axis!r}")

    def build(self, step: Step, comp: Composition) -> Step:
        return _build(step, self)


class PipelineLayout:
    """Which layers each stage holds, and on which rank (``state.extra["pipeline"]``).

    ``stages[s]`` is the ``(start, stop)`` range of global layers of stage ``s``, which lives on
    rank ``s % ranks``. ``gather_params`` puts the stacked layers back together (a collective).
    """

    def __init__(
        self, layers: int, ranks: int, virtual_stages: int, axis: str, mesh: Mesh | None
    ) -> None:
        n = ranks * virtual_stages
        if layers < n:
            raise ValueError(
                f"pipeline: the model has {layers} layers, fewer than stages={ranks} x "
                f"virtual_stages={virtual_stages} = {n}; use at most {layers} stages in all"
            )
        sizes = [layers // n + (s < layers % n) for s in range(n)]
        starts = [sum(sizes[:s]) for s in range(n)]
        self.layers, self.ranks, self.virtual_stages = layers, ranks, virtual_stages
        self.axis, self.mesh = axis, mesh
        self.stages = tuple((a, a + k) for a, k in zip(starts, sizes))
        self.even = len(set(sizes)) == 1
        self.rank = mesh.axis_index(axis) if mesh is not None and ranks > 1 else 0

    def global_layers(self, rank: int) -> list[int]:
        """The global indices of the layers ``rank`` keeps, in its local order."""
        return [
            i for s in range(rank, len(self.stages), self.ranks) for i in range(*self.stages[s])
        ]

    def stage_layers(self, rank: int) -> dict[int, tuple[int, int]]:
        """``{stage: (start, stop)}`` in ``rank``'s local layers."""
        out, at = {}, 0
        for s in range(rank, len(self.stages), self.ranks):
            a, b = self.stages[s]
            out[s] = (at, at + b - a)
            at += b - a
        return out

    def place(self, params: PyTree) -> PyTree:
        """This rank's parameters: its layers of ``blocks``, everything else whole."""
        idx = torch.tensor(self.global_layers(self.rank))
        blocks = tree.map(lambda x: x.index_select(0, idx), params["blocks"])
        return {**params, "blocks": blocks}

    def gather_params(self, params: PyTree) -> PyTree:
        """The parameters with every stage's layers stacked in model order (a collective)."""
        if self.ranks == 1 or self.mesh is None:
            return params  # one rank keeps every stage, in order
        mesh, p = self.mesh, self.ranks
        most = max(len(self.global_layers(r)) for r in range(p))
        # where each global layer sits in the gathered [p * most, ...] tensor
        where = {g: r * most + i for r in range(p) for i, g in enumerate(self.global_layers(r))}
        rows = torch.tensor([where[g] for g in range(self.layers)])

        def gather(x: torch.Tensor) -> torch.Tensor:
            local = local_piece(x)
            pad = local.new_zeros((most - local.shape[0], *local.shape[1:]))
            full = comm.all_gather(torch.cat([local, pad]), self.axis, 0, mesh).index_select(
                0, rows
            )
            if isinstance(x, ShardedTensor):
                return ShardedTensor(full, x.mesh, x.placements, (self.layers, *x.shape[1:]))
            return full

        if "blocks" not in params:  # optimizer states of other parameters only
            return params
        with torch.no_grad():
            return {**params, "blocks": tree.map(gather, params["blocks"])}

    def gather_opt(self, states: PyTree) -> PyTree:
        """Optimizer states shaped like the parameters, gathered as they are (a collective)."""
        return self.gather_params(states)

    def place_opt(self, states: PyTree) -> PyTree:
        """The inverse of :meth:`gather_opt` is the step's own layout, which placed them."""
        return states

    def describe(self) -> str:
        """One line per stage: its layers and rank; says when the split is uneven."""
        lines = [
            f"stage {s}: layers {a}-{b - 1} on rank {s % self.ranks}"
            for s, (a, b) in enumerate(self.stages)
        ]
        if not self.even:
            n = len(self.stages)
            lines.append(
                f"uneven: {self.layers} layers do not divide into {n} stages; the first "
                f"{self.layers % n} stages hold one layer more"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        split = "even" if self.even else "uneven"
        return (
            f"PipelineLayout({self.layers} layers, {len(self.stages)} stages on "
            f"{self.ranks} ranks of {self.axis!r}, {split}: {[b - a for a, b in self.stages]})"
        )


def _is_block(path: str) -> bool:
    return path == "blocks" or path.startswith("blocks.")


def _microbatches(batch: PyTree, m: int) -> list[PyTree]:
    flat, treedef = tree.flatten_with_paths(batch)
    pieces = []
    for path, x in flat:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            pieces.append([x] * m)
            continue
        if x.shape[0] % m:
            raise ValueError(
                f"pipeline: batch entry {path!r} has {x.shape[0]} rows, not divisible by "
                f"microbatches={m}; use a batch size that is a multiple of {m}"
            )
        pieces.append(_chunk_rows(x, m))
    return [tree.unflatten(treedef, [pc[j] for pc in pieces]) for j in range(m)]


def _chunk_rows(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``x.chunk(m, 0)``; a ShardedTensor split on dim 0 (2D, 2.5D and 3D tensor parallelism
    split the batch) is chunked rank by rank, as data parallelism's ranks chunk their own rows:
    microbatch j holds every rank's j-th chunk, so the microbatches together hold the batch."""
    if not isinstance(x, ShardedTensor) or Shard(0) not in x.placements:
        return list(x.chunk(m, 0))
    local = x.to_local()
    if local.shape[0] % m:
        raise ValueError(
            f"pipeline: each rank holds {local.shape[0]} rows of the batch, not divisible by "
            f"microbatches={m}; use a batch size that is a multiple of {m} times the ranks that "
            "split it"
        )
    shape = (x.shape[0] // m, *x.shape[1:])
    return [from_local(c, x._mesh, x.placements, shape) for c in local.chunk(m, 0)]


def pipeline(
    step: Step,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    axis: str = "pp",
) -> Step:
    """Pipeline-parallel ``step`` over ``axis``; see the module docs.

    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (with ``virtual_stages >= 2``) or
    ``"zero_bubble"`` (ZB-H1). Call it on every rank.

    Example:
        >>> def main(mesh):
        ...     s = cf.shard(cf.pipeline(cf.train_step(loss_fn, opt), 2, 4), mesh, gpt.tp_plan)
        >>> cf.launch(main, mesh={"pp": 2, "tp": 2})
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"pipeline: expected a Step (from cf.train_step), got {type(step).__name__}"
        )
    cfg = PipelineConfig(
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        axis=axis,
    )
    if not isinstance(step.loss_fn, core.Layered):
        raise ValueError(
            f"pipeline: the loss must be a cf.layered(pre, block, post), which says where the "
            f"model may be cut into stages; got {step.loss_fn!r}. The models' loss(cfg) is one."
        )
    return apply_transform(step, "pipeline", cfg)


def _build(step: Step, cfg: PipelineConfig) -> Step:
    loss_fn = step.loss_fn
    assert isinstance(loss_fn, core.Layered)  # checked by pipeline()
    axis = cfg.axis
    p = cfg.stages
    actions = schedules.build(cfg.schedule, p, cfg.microbatches, cfg.virtual_stages)
    # the forward pass alone: the same schedule without its backward actions (dropping actions
    # that wait cannot make another rank wait forever, since sends never block)
    forward_only = actions.forward_only()
    inner_layout, inner_init_extra = step.layout, step.init_extra
    inner_sync, inner_update = step.sync, step.update

    def mesh_() -> Mesh | None:
        if p == 1 and core.innermost(Mesh) is None:
            return None  # one stage: microbatching only, no mesh needed
        m = current_mesh()
        if p == 1 and axis not in m.axis_names:
            return None
        if axis not in m.axis_names or m.axis_size(axis) != p:
            size = m.axis_size(axis) if axis in m.axis_names else None
            raise ValueError(
                f"pipeline: stages={p} needs a mesh axis {axis!r} of size {p}; the mesh is "
                f"{m.shape}" + ("" if size is None else f" ({axis!r} has size {size})")
            )
        return m

    def split(params: PyTree) -> PipelineLayout:
        if not isinstance(params, dict) or "blocks" not in params:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"pipeline: params must be a dict with the stacked layers under 'blocks'; got {keys}"
            )
        n = core.num_layers(params["blocks"])
        return PipelineLayout(n, p, cfg.virtual_stages, axis, mesh_())

    def layout(params: PyTree) -> PyTree:
        return inner_layout(split(params).place(params))

    def init_extra(params: PyTree) -> dict[str, Any]:
        return {**inner_init_extra(params), "pipeline": split(params)}

    def runner_for(
        acts: schedules.Schedule, params: PyTree, batch: PyTree, lay: PipelineLayout
    ) -> Runner:
        spans = {s: lay.stages[s] for s in lay.stage_layers(lay.rank)}
        mbs = _microbatches(batch, cfg.microbatches)
        return Runner(
            acts,
            lay.rank,
            loss_fn,
            params,
            lay.stage_layers(lay.rank),
            mbs,
            lay.mesh,
            axis,
            spans,
            trainable=step.trainable,
        )

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        lay: PipelineLayout = extra["pipeline"]
        runner = runner_for(actions, params, batch, lay)
        if cfg.schedule == "zero_bubble":  # input and weight gradients in separate passes
            with core.context(core.SplitBackward()):
                total, grads = runner.run()
        else:
            total, grads = runner.run()
        return _mean_loss(total, cfg.microbatches, lay), grads

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        lay: PipelineLayout = extra["pipeline"]
        runner = runner_for(forward_only, params, batch, lay)
        total, _ = runner.run()
        return _mean_loss(total, cfg.microbatches, lay)

    def sync(grads: PyTree) -> PyTree:
        grads = inner_sync(grads)
        mesh = mesh_()
        if mesh is None or p == 1:
            return grads
        flat, treedef = tree.flatten_with_paths(grads)
        shared = [i for i, (path, _) in enumerate(flat) if not _is_block(path)]
        summed = reduce_leaves([flat[i][1] for i in shared], axis, mesh, op="sum")
        leaves = [g for _, g in flat]
        for i, s in zip(shared, summed):
            leaves[i] = rewrap(leaves[i], s)
        return tree.unflatten(treedef, leaves)

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        mesh = mesh_()
        if mesh is None or p == 1:
            return inner_update(grads, state)
        outer = core.innermost(core.NormReduction)
        flat = tree.flatten_with_paths(grads)[0]
        blocks = [_is_block(path) for path, x in flat if isinstance(x, torch.Tensor)]

        def reduce(squares: list[torch.Tensor]) -> torch.Tensor:
            # each rank holds its stages' layers; the shared parameters' gradients are the same
            # on every rank of the axis (summed in sync), so each rank counts 1/p of them
            parts = [sq if blk else sq / p for sq, blk in zip(squares, blocks)]
            local = outer.reduce(parts) if outer is not None else torch.stack(parts).sum()
            return comm.all_reduce(local, axis, mesh=mesh)

        with core.context(core.NormReduction(reduce)):
            return inner_update(grads, state)

    return step.replace(
        layout=layout,
        init_extra=init_extra,
        forward=forward,
        forward_backward=forward_backward,
        sync=sync,
        update=update,
    )


def _mean_loss(total: torch.Tensor | None, m: int, lay: PipelineLayout) -> torch.Tensor:
    """The mean microbatch loss, computed on the last stage's rank, on every rank of the axis."""
    if total is not None:
        if isinstance(total, ShardedTensor):
            total = total.full_tensor()
        mean = total / m
        if lay.ranks == 1 or lay.mesh is None:
            return mean
        buf = torch.tensor([float(mean), DTYPES.index(mean.dtype)], dtype=torch.float64)
    else:
        buf = torch.zeros(2, dtype=torch.float64)
    assert lay.mesh is not None
    buf = comm.broadcast(buf, lay.axis, lay.ranks - 1, lay.mesh)
    # fp64 holds any fp32/bf16/fp16 value exactly, so every rank returns the same number
    return buf[0].to(DTYPES[int(buf[1])]) if total is None else mean


def pipeline_from_config(step: Step, cfg: dict[str, Any]) -> Step:
    """``pipeline(step, **cfg)`` for the ``pipeline`` entry of a config's ``parallel`` dict.

    Example: ``parallel = dict(pipeline=dict(stages=2, microbatches=8, schedule="1f1b"))``.
    """
    if not isinstance(cfg, dict):
        raise ValueError(
            f"parallel['pipeline'] must be a dict like dict(stages=2, microbatches=8), got {cfg!r}"
        )
    known = [f.name for f in dataclasses.fields(PipelineConfig)]
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(
            f"parallel['pipeline'] has unknown key {unknown[0]!r}; the keys are {known}"
        )
    missing = [k for k in ("stages", "microbatches") if k not in cfg]
    if missing:
        raise ValueError(
            f"parallel['pipeline'] needs {missing[0]!r}, e.g. dict(stages=2, microbatches=8)"
        )
    return pipeline(step, **cfg)
