"""``shard``: data parallel over a batch axis and tensor parallel by a plan of path patterns.

Parameters are placed by ``plan``, a mapping of glob path patterns to partition specs (e.g. a
model's ``tp_plan``: Megatron's column-parallel q/k/v and MLP-in, row-parallel out-projections,
vocabulary-parallel embedding). A parameter that no pattern names is replicated. The sharded
parameters are :class:`~colfunc.sharding.ShardedTensor`\\ s, so the unchanged single-device model
runs on them and the propagation rules insert the collectives.

Every rank is handed the same global batch and keeps its slice along dim 0 over ``batch_axis``,
and the gradients are averaged over that axis in a few large buckets (one ``all_reduce`` per
bucket rather than one per parameter), as DDP does: each scanned layer's gradients are written
into the flat buffers as soon as the backward pass has computed them, and a full bucket's
``all_reduce`` starts at once, running while the backward pass goes on to the earlier layers. The
parameters outside the stacked layers (embeddings, final norm) follow in the last buckets. The
loss is the mean of the ranks' local means, which is the global mean when every rank holds the
same number of counted labels (always so without ``-100`` labels). The batch split, the loss mean
and the buckets are the one data-parallel layer's (:mod:`colfunc.transforms.data_parallel`),
shared with ``zero`` and ``offload``: this transform places the parameters and pushes its tensor
and sequence frames.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.core import P, Plan
from colfunc.nn.plans import fitting_sizes
from colfunc.random import Abstract
from colfunc.sharding import Mesh, ShardedTensor, distribute, placements_from_spec
from colfunc.sharding.placement import Shard
from colfunc.step import Step
from colfunc.transforms import grid
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.local import as_full, in_placement, local_update
from colfunc.transforms.sequence import (
    LONG_MODES,
    MODES,
    CarrySplitter,
    LongSequence,
    SequenceLayout,
    split_sequence,
)

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["ShardConfig", "matmul_order", "place", "shard"]

PyTree = Any


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
    return Plan(dict(plan), getattr(plan, "optional", frozenset()))


def place(
    params: PyTree,
    plan: dict[str, P],
    mesh: Mesh,
    *,
    sharded: bool = False,
    layout: grid.GridLayout | None = None,
) -> PyTree:
    """``params`` as ShardedTensors laid out by ``plan`` (path patterns to specs; replicated
    where no pattern matches), each rank keeping its shards; no communication. A pattern that
    matches no parameter is an error, unless ``plan`` is a :class:`~colfunc.core.Plan` naming it
    optional (an untied head, which a tied config lacks). Without a plan
    they stay plain tensors (data parallel only) unless ``sharded`` (sequence parallelism, whose
    activations are ShardedTensors: the parameters' gradients are then Partial sums over the
    sequence axis, which their placements reduce)."""
    if not plan and not sharded:
        return params  # data parallel only: plain tensors, replicated
    flat = tree.flatten_with_paths(params)[0]
    optional: frozenset[str] = getattr(
        plan, "optional", frozenset()
    )  # (a Plan's: parameters some configs lack)
    unused = [
        pat for pat in plan if pat not in optional and not any(tree.match(pat, p) for p, _ in flat)
    ]
    if unused:
        raise ValueError(
            f"shard: plan pattern {unused[0]!r} matches no parameter; parameter paths look like "
            f"{[p for p, _ in flat[:4]]}"
        )

    def one(path: str, x: Any) -> Any:
        if isinstance(x, Abstract):  # placed once made: the layouts after this one make it
            return x.then(lambda made: one(path, made))
        if not isinstance(x, torch.Tensor):
            return x
        # every parameter becomes a ShardedTensor (replicated unless named), so parameters,
        # gradients and optimizer states have one type and the rules see every operand's placement
        spec = next((s for pat, s in plan.items() if tree.match(pat, path)), P())
        placements = placements_from_spec(mesh, spec, x.dim())
        for d in range(x.dim()):
            axes = tuple(a for a, pl in zip(mesh.axis_names, placements) if pl == Shard(d))
            n = mesh.axis_size(axes) if axes else 1
            if layout is not None and x.shape[d] % n:
                per_q = round(math.log(n, layout.q)) if layout.q > 1 else 1
                sizes = fitting_sizes(
                    layout.mode,
                    layout.size,
                    layout.depth,
                    lambda q, n=x.shape[d], k=per_q: n % q**k == 0,
                )
                raise ValueError(
                    f"shard: {path} has size {x.shape[d]} on dim {d}, not divisible by the {n} "
                    f"ranks of {axes} that split it in tensor mode {layout.mode!r}; the nearest "
                    f"sizes that divide it: {sizes}"
                )
        # over one axis a dim need not divide: it splits in torch.chunk pieces, which the rules
        # follow (a vocabulary of 50257 over tp=2 is 25129 + 25128 rows: no padding row to keep
        # out of the loss, the samples or an export); what must divide (heads) the model says
        # in its loss's ``divisors``
        return distribute(x, mesh, placements)

    return tree.map_with_path(one, params)


def matmul_order(params: PyTree) -> PyTree:
    """``params`` with every stacked weight matrix that narrows (a floating leaf ``[L, in, out]``
    under ``"blocks"`` with ``in > out``: an MLP's down projection) kept column-major per layer:
    the same values, each layer's ``[in, out]`` stored as ``nn.Linear`` stores its ``[out, in]``.

    Why: PyTorch differentiates ``x @ w`` for a column-major ``w`` as ``(g^T x)^T`` and hands
    the gradient back column-major, where a row-major ``w`` takes ``x^T g``, whose ``[in, out]``
    output is written across the grain. On this kind of CPU (one thread, 1024 rows) a linear's
    forward and backward take 0.975x the time column-major for ``512 -> 128``, but 1.03x for
    ``128 -> 512`` and 1.0x for ``128 -> 128``: so only the narrowing weights are reordered. The
    gradient buckets lay each row out as its parameter's
    (:func:`colfunc.transforms.data_parallel.grad_layout.row_strides`), and the fused AdamW takes parameter,
    gradient and moments row by row in that order, so no pass transposes anything.
    """
    if not isinstance(params, dict) or not isinstance(params.get("blocks"), dict | list | tuple):
        return params

    def one(x: Any) -> Any:
        if isinstance(x, Abstract):
            return x.then(one)
        if type(x) is not torch.Tensor or x.dim() != 3 or not x.is_floating_point():
            return x
        if x.shape[1] <= x.shape[2] or x.device.type != "cpu":  # measured on CPUs only
            return x
        return x.transpose(1, 2).contiguous().transpose(1, 2)  # strides (in * out, 1, in)

    return {**params, "blocks": tree.map(one, params["blocks"])}


class _SequenceParallel(CarrySplitter):
    """Frame: the carry leaves with a sequence dim are split on it over ``axis`` between layers.

    Megatron-LM's sequence parallelism (Korthikanti et al. 2022): outside the tensor-parallel
    matmuls, each rank keeps only its part of the sequence, so norms and residual adds are not
    repeated and their activations are not stored whole on every rank. The propagation rules then
    all-gather the sequence before the column-parallel matmuls and reduce-scatter the row-parallel
    outputs back onto it, in place of Megatron's all-reduce. The model names which carry leaves
    have a sequence dim (``cf.layered(..., sequence_dims=...)``); the others stay whole.
    """

    def __init__(self, mesh: Mesh, axis: str, dims: dict[str, int]) -> None:
        self.mesh, self.axis, self.dims = mesh, axis, dims

    def _split_leaf(self, path: str, h: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.mesh.axis_size(self.axis)
        if not isinstance(h, torch.Tensor) or h.dim() <= dim or h.shape[dim] % n:
            shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(
                f"shard: sequence parallelism splits dim {dim} of the carry leaf {path!r} over "
                f"{self.axis!r} (size {n}); it has shape {shape}: use a sequence length "
                f"divisible by {n}"
            )
        if not isinstance(h, ShardedTensor):
            h = distribute(h, self.mesh)
        placements = [
            Shard(dim) if a == self.axis else pl
            for a, pl in zip(self.mesh.axis_names, h.placements)
        ]
        return h.redistribute(placements)


def _sequence_frame(
    plan: dict[str, P], mesh: Mesh, dp: str | None, loss_fn: Any
) -> _SequenceParallel:
    axes = sorted(_plan_axes(plan) - {dp})
    if len(axes) != 1:
        raise ValueError(
            "shard: sequence_parallel=True needs a plan that splits parameters over exactly one "
            f"tensor-parallel axis; the plan uses {axes}"
        )
    dims = getattr(loss_fn, "sequence_dims", {"": 1})
    return _SequenceParallel(mesh, axes[0], dict(dims))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """The arguments of :func:`shard`, checked against the mesh when made."""

    mesh: Mesh
    plan: dict[str, P] = dataclasses.field(default_factory=dict)
    batch_axis: str | None = "dp"
    sequence_parallel: bool | str = False
    sequence_axis: str | tuple[str, ...] | None = None
    bucket_mb: float = 25.0
    overlap: bool = True
    tensor_mode: str = "1d"
    expert_axis: str | None = None

    def __post_init__(self) -> None:
        mesh = self.mesh
        given: Any = self.sequence_parallel
        mode: str | None = None
        if given is True:
            mode = "megatron"
        elif given is False or given is None:
            mode = None
        elif isinstance(given, str) and given in MODES:
            mode = given
        else:
            raise ValueError(
                f"shard: sequence_parallel must be False, True ('megatron') or one of {MODES}, "
                f"got {given!r}"
            )
        object.__setattr__(self, "sequence_parallel", mode or False)
        if not isinstance(mesh, Mesh):
            raise TypeError(f"shard: mesh must be a cf.Mesh (the one launch passes), got {mesh!r}")
        if self.batch_axis is not None and self.batch_axis not in mesh.axis_names:
            if self.batch_axis != "dp":
                raise ValueError(
                    f"shard: batch_axis {self.batch_axis!r} is not a mesh axis; mesh axes are "
                    f"{mesh.axis_names}"
                )
            object.__setattr__(self, "batch_axis", None)
        b = self.bucket_mb
        if isinstance(b, bool) or not isinstance(b, int | float) or not b > 0:
            raise ValueError(f"shard: bucket_mb must be a number > 0 (megabytes), got {b!r}")
        self._check_tensor_mode(mode)
        object.__setattr__(self, "plan", _check_plan(self.plan, mesh))
        self._check_expert_axis(mode)
        if mode in LONG_MODES:
            layout = SequenceLayout.make(mode, mesh, self.sequence_axis)
            clash = sorted(set(layout.axes) & ({self.batch_axis} | _plan_axes(self.plan)))
            if clash:
                raise ValueError(
                    f"shard: the sequence axis {clash[0]!r} also splits the batch or the "
                    "parameters; give sequence parallelism an axis of its own"
                )
        elif self.sequence_axis is not None:
            raise ValueError(
                f"shard: sequence_axis={self.sequence_axis!r} is for the long-context modes "
                f"{LONG_MODES}; sequence_parallel={self.sequence_parallel!r} uses the "
                "tensor-parallel axis"
            )

    def _check_expert_axis(self, sequence_mode: str | None) -> None:
        ep = self.expert_axis
        if ep is None:
            return
        mesh = self.mesh
        if not isinstance(ep, str) or ep not in mesh.axis_names:
            raise ValueError(
                f"shard: expert_axis {ep!r} is not a mesh axis; mesh axes are {mesh.axis_names} "
                "(add one, e.g. mesh={'dp': 2, 'ep': 2})"
            )
        if ep == self.batch_axis or ep in _plan_axes(self.plan):
            what = "the batch axis" if ep == self.batch_axis else "an axis of the plan"
            raise ValueError(
                f"shard: expert_axis {ep!r} is also {what}; give expert parallelism an axis of "
                "its own (it splits the batch too, beside the data-parallel axis)"
            )
        if self.tensor_mode != "1d" or sequence_mode is not None:
            raise ValueError(
                f"shard: expert_axis composes with data and 1D tensor parallelism; not with "
                f"tensor_mode={self.tensor_mode!r} or sequence_parallel={self.sequence_parallel!r}"
            )

    def _check_tensor_mode(self, sequence_mode: str | None) -> None:
        tm = self.tensor_mode
        if tm not in grid.MODES:
            raise ValueError(f"shard: tensor_mode must be one of {grid.MODES}, got {tm!r}")
        if tm == "1d":
            return
        grid.GridLayout.make(tm, self.mesh)  # the mesh has the mode's axes
        others = {name for axes in grid.AXES.values() for name in axes} - set(grid.AXES[tm])
        plan = self.plan if isinstance(self.plan, dict) else {}
        wrong = sorted(
            {a for spec in plan.values() if isinstance(spec, P) for a in spec.axes()} & others
        )
        if wrong:
            raise ValueError(
                f"shard: tensor_mode={tm!r} lays weights out over {grid.AXES[tm]}, but the plan "
                f"uses axis {wrong[0]!r}; pass the model's plan for the mode, e.g. "
                f"gpt.tp_plans[{tm!r}]"
            )
        if sequence_mode is not None:
            raise ValueError(
                f"shard: tensor_mode={tm!r} splits activations itself; it does not combine with "
                f"sequence_parallel={sequence_mode!r}"
            )
        if self.batch_axis is not None and self.batch_axis in grid.AXES[tm]:
            raise ValueError(
                f"shard: batch_axis {self.batch_axis!r} is one of tensor mode {tm!r}'s axes; "
                "give data parallelism an axis of its own"
            )

    @property
    def grid_layout(self) -> grid.GridLayout | None:
        """The 2D, 2.5D or 3D mode's layout (None for 1D)."""
        if self.tensor_mode == "1d":
            return None
        return grid.GridLayout.make(self.tensor_mode, self.mesh)

    @property
    def sequence_layout(self) -> SequenceLayout | None:
        """The long-context mode's layout (None for none or Megatron's)."""
        mode = self.sequence_parallel
        if mode not in LONG_MODES:
            return None
        return SequenceLayout.make(str(mode), self.mesh, self.sequence_axis)

    @property
    def data_axis(self) -> str | None:
        """The batch axis when it has more than one rank (None: no data parallelism)."""
        a = self.batch_axis
        return a if a is not None and self.mesh.axis_size(a) > 1 else None

    @property
    def expert_ranks(self) -> str | None:
        """The expert axis when it has more than one rank (None: every rank all experts)."""
        a = self.expert_axis
        return a if a is not None and self.mesh.axis_size(a) > 1 else None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: the data-parallel axis and the expert axis (each
        rank of which routes tokens of its own), those with more than one rank."""
        return tuple(a for a in (self.data_axis, self.expert_ranks) if a is not None)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    def build(self, step: Step, comp: Composition) -> Step:
        return _build(step, self, comp)


def shard(
    step: Step,
    mesh: Mesh,
    plan: dict[str, P] | None = None,
    batch_axis: str | None = "dp",
    sequence_parallel: bool | str = False,
    *,
    sequence_axis: str | tuple[str, ...] | None = None,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    tensor_mode: str = "1d",
    expert_axis: str | None = None,
) -> Step:
    """Data parallel over ``batch_axis`` and tensor parallel by ``plan``; see the module docs.

    ``batch_axis=None`` (or an axis the mesh does not have, for the default ``"dp"``) turns data
    parallelism off. Call it on every rank with that rank's mesh. ``bucket_mb`` is the size of the
    gradient buckets (DDP's ``bucket_cap_mb``); ``overlap=False`` reduces them only after the
    backward pass. Under a pipeline the reduction always follows the backward pass, since the
    microbatches' gradients are complete only then.

    ``sequence_parallel``: ``True`` or ``"megatron"`` splits the sequence over the
    tensor-parallel axis between the matmuls (Megatron-LM); ``"ulysses"``, ``"ring"``,
    ``"zigzag"`` and ``"usp"`` split it over an axis of its own (``sequence_axis``, default
    ``"sp"``; for ``"usp"`` ``("sp_ring", "sp_ulysses")``): see :mod:`colfunc.transforms.sequence`.

    ``tensor_mode``: ``"1d"`` (Megatron-LM), or ``"2d"``, ``"2.5d"``, ``"3d"``, which split the
    activations as well as the weights over the mode's mesh axes and run each of ``plan``'s
    weights through the mode's matmul; ``plan`` is then the model's plan for the mode
    (``gpt.tp_plans["2d"]``). See :mod:`colfunc.transforms.grid`.

    ``expert_axis``: expert parallelism for a mixture of experts (a model whose loss names its
    ``expert_dims``): each expert weight is split over this axis on its expert dim, and the axis
    splits the batch too (beside ``batch_axis``): each rank routes its own tokens, sends them to
    their experts' ranks and receives the outputs (see :mod:`colfunc.sharding.rules.moe`). The
    experts' gradients are then complete over the axis and are averaged over ``batch_axis``
    only; every other gradient over both.

    Example:
        >>> def main(mesh):
        ...     s = cf.shard(cf.train_step(gpt.loss(cfg), optim.adamw(3e-4)), mesh, gpt.tp_plan)
        >>> cf.launch(main, mesh={"dp": 2, "tp": 2})
    """
    if not isinstance(step, Step):
        raise TypeError(f"shard: expected a Step (from cf.train_step), got {type(step).__name__}")
    config = ShardConfig(
        mesh=mesh,
        plan=plan if plan is not None else {},
        batch_axis=batch_axis,
        sequence_parallel=sequence_parallel,
        sequence_axis=sequence_axis,
        bucket_mb=bucket_mb,
        overlap=overlap,
        tensor_mode=tensor_mode,
        expert_axis=expert_axis,
    )
    return apply_transform(step, "shard", config)


def _expert_dims(loss_fn: Any, axis: str | None) -> dict[str, int]:
    """The model's expert weights and their expert dims, when ``axis`` splits them."""
    if axis is None:
        return {}
    dims = dict(getattr(loss_fn, "expert_dims", None) or {})
    if not dims:
        raise ValueError(
            f"shard: expert_axis={axis!r}, but {getattr(loss_fn, 'name', 'the model')} has no "
            "experts (its loss names no expert_dims); drop expert_axis"
        )
    return dims


def _with_experts(
    plan: dict[str, P], experts: dict[str, int], axis: str | None, params: PyTree, mesh: Mesh
) -> Plan:
    """``plan`` with each expert weight also split over ``axis`` on its expert dim."""
    assert axis is not None
    n = mesh.axis_size(axis)
    shapes = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(params)[0]}
    entries: dict[str, P] = {}
    for path, dim in experts.items():
        if path not in shapes:
            continue  # (a frozen or absent leaf of another config)
        count = shapes[path][dim]
        if count % n:
            raise ValueError(
                f"shard: the {count} experts of {path} do not split evenly over expert_axis "
                f"{axis!r} of size {n}; use an expert axis size that divides {count}"
            )
        base = next((s for pat, s in plan.items() if tree.match(pat, path)), P())
        dims: list[Any] = list(base) + [None] * max(0, dim + 1 - len(base))
        have = dims[dim]
        dims[dim] = (
            axis if have is None else (axis, *(have if isinstance(have, tuple) else (have,)))
        )
        entries[path] = P(*dims)
    optional: frozenset[str] = getattr(plan, "optional", frozenset())
    return Plan({**entries, **plan}, optional)


def _plan_axes(plan: dict[str, P]) -> set[str]:
    return {a for spec in plan.values() for a in spec.axes()}


def _check_divisors(
    loss_fn: Any, plan: dict[str, P], mesh: Mesh, layout: grid.GridLayout | None = None
) -> None:
    divisors = getattr(loss_fn, "divisors", {})
    if layout is not None:  # heads split over one grid axis of q ranks
        q = layout.q
        for field, value in divisors.items():
            if value is not None and value % q:
                sizes = fitting_sizes(
                    layout.mode, layout.size, layout.depth, lambda n, v=value: v % n == 0
                )
                raise ValueError(
                    f"shard: {getattr(loss_fn, 'name', 'the model')} has {field}={value}, not "
                    f"divisible by q={q} of tensor mode {layout.mode!r} ({layout.size} ranks); "
                    f"the nearest sizes that divide it: {sizes}"
                )
        return
    for axis in sorted(_plan_axes(plan)):
        n = mesh.axis_size(axis)
        for field, value in divisors.items():
            if value is not None and value % n:
                raise ValueError(
                    f"shard: {getattr(loss_fn, 'name', 'the model')} has {field}={value}, "
                    f"not divisible by the {axis!r} axis size {n}; choose a {axis!r} size that "
                    f"divides it"
                )


def _build(step: Step, cfg: ShardConfig, comp: Composition) -> Step:
    """Places the parameters and pushes the tensor and sequence frames; the batch split over
    ``data_axis``, the loss mean and the gradient reduction are the data-parallel layer's
    (:mod:`colfunc.transforms.data_parallel`), applied above this one."""
    mesh, plan_ = cfg.mesh, cfg.plan
    grid_layout = cfg.grid_layout
    _check_divisors(step.loss_fn, plan_, mesh, grid_layout)
    reduction = comp.reduction
    inner_layout, inner_fb, inner_fwd = step.layout, step.forward_backward, step.forward
    # zero stages 1-3 hand the optimizer chunks (plain local tensors) and say themselves how
    # their norms add up; otherwise the update runs on the local pieces of sharded tensors
    chunked = comp.zero is not None and comp.zero.stage >= 1
    long_seq = cfg.sequence_layout
    experts = _expert_dims(step.loss_fn, cfg.expert_axis)
    sharded = bool(plan_) or long_seq is not None or bool(experts)
    update = local_update(step.update, mesh) if sharded and not chunked else step.update
    # plain data parallelism keeps its stacked weights in matmul order in its flat buffers (see
    # matmul_order); elsewhere (sharded, chunked, offloaded, pipelined) they stay row-major
    reorder = reduction is not None and reduction.matmul_order

    adapted = getattr(step.loss_fn, "lora", None)

    def layout(params: PyTree) -> PyTree:
        split_acts = long_seq is not None or grid_layout is not None
        inner = inner_layout(params)
        # adapters (cf.lora) placed to match their weights
        sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
        plan = plan_ if adapted is None else adapted.plan(plan_, inner, cfg.tensor_mode, sizes)
        if experts:
            plan = _with_experts(plan, experts, cfg.expert_axis, inner, mesh)
        placed = place(inner, plan, mesh, sharded=split_acts, layout=grid_layout)
        return matmul_order(placed) if reorder else placed

    megatron = cfg.sequence_parallel == "megatron"
    seq = _sequence_frame(plan_, mesh, cfg.data_axis, step.loss_fn) if megatron else None
    if long_seq is not None:
        divisors = getattr(step.loss_fn, "divisors", {})
        heads_axes = sorted(_plan_axes(plan_) - {cfg.data_axis})
        tp = math.prod(mesh.axis_size(a) for a in heads_axes)
        long_seq.check_heads(divisors.get("n_head"), divisors.get("n_kv_heads"), tp)
    batch_dims = getattr(step.loss_fn, "batch_sequence_dims", None)
    carry_dims = dict(getattr(step.loss_fn, "sequence_dims", {"": 1}))
    grid_frame = grid.GridLinear(grid_layout) if grid_layout is not None else None

    def prepare(local: PyTree) -> tuple[PyTree, LongSequence | None]:
        """This data-parallel rank's batch (split above) cut further by the tensor layout."""
        if grid_layout is not None:
            return grid.split_batch(local, grid_layout), None
        if long_seq is None:
            return local, None
        local, T = split_sequence(local, long_seq, batch_dims)
        return local, LongSequence(long_seq, T, carry_dims)

    def frames(stack: contextlib.ExitStack, long_frame: LongSequence | None) -> None:
        if grid_frame is not None:
            stack.enter_context(core.context(grid_frame))
        if seq is not None:
            stack.enter_context(core.context(seq))
        if long_frame is not None:
            stack.enter_context(core.context(long_frame))

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        local_batch, long_frame = prepare(batch)
        with contextlib.ExitStack() as stack:
            frames(stack, long_frame)
            loss, grads = inner_fb(params, local_batch, extra)
        sown = core.innermost(core.Sown)
        if sown is not None:  # the model's reports, whole on every rank
            sown.map(as_full)
        if reduction is None:  # gradients take their parameter's placements (a rule may leave
            # one Partial); the data-parallel layer does it where it reduces
            grads = tree.map(in_placement, grads, step.trainable_part(params))
        return as_full(loss), grads

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        local_batch, long_frame = prepare(batch)
        with contextlib.ExitStack() as stack:
            frames(stack, long_frame)
            return as_full(inner_fwd(params, local_batch, extra))

    return step.replace(
        layout=layout, forward=forward, forward_backward=forward_backward, update=update
    )
