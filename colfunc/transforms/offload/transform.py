"""``offload``'s config and the step it builds (see :mod:`colfunc.transforms.offload`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.memory.chunks import chunk_layout
from colfunc.memory.placement import device_budget
from colfunc.memory.pool import DevicePool
from colfunc.random import Abstract
from colfunc.sharding import Mesh, ShardedTensor
from colfunc.step import Step, TrainState, check_loss
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.local import (
    as_full,
    local_piece,
    to_local,
)
from colfunc.transforms.offload.experts import routed_leaves
from colfunc.transforms.offload.state import (
    OffloadState,
    host_device,
    offload_state,
    pool_device,
)
from colfunc.transforms.offload.streaming import Streaming
from colfunc.transforms.offload.update import (
    adamw_update,
    as_meta_tree,
    local_state,
    norm_axes,
    zero_update,
)

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition
    from colfunc.transforms.data_parallel import Reduction

PyTree = Any


POLICIES = ("device", "host", "static", "auto")
EXPERTS = ("routed", "layer")


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload: {name} must be a fraction in [0, 1], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """The arguments of :func:`offload`, checked."""

    policy: str = "auto"
    device_budget: int | float | str | None = None
    margin: float = 0.0
    prefetch: int = 1
    chunk_mb: float | None = None
    offload_params: float | None = None
    offload_optim: float | None = None
    experts: str = "routed"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"offload: unknown policy {self.policy!r}; use one of {POLICIES}")
        if self.experts not in EXPERTS:
            raise ValueError(
                f"offload: experts must be one of {EXPERTS} (each layer's experts fetched when "
                f"routed to, or with the layer), got {self.experts!r}"
            )
        _fraction("margin", self.margin)
        if self.margin and self.policy != "auto":
            raise ValueError(f"offload: margin is for policy='auto', not {self.policy!r}")
        if (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or self.prefetch < 0
        ):
            raise ValueError(f"offload: prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.chunk_mb is not None and (
            isinstance(self.chunk_mb, bool)
            or not isinstance(self.chunk_mb, int | float)
            or not self.chunk_mb > 0
        ):
            raise ValueError(
                f"offload: chunk_mb must be a number > 0 or None, got {self.chunk_mb!r}"
            )
        given = {
            n: v for n in ("offload_params", "offload_optim") if (v := getattr(self, n)) is not None
        }
        if given and self.policy != "static":
            raise ValueError(
                f"offload: {', '.join(given)} are for policy='static', not {self.policy!r}"
            )
        for name, value in given.items():
            _fraction(name, value)
        if self.params_fraction > self.optim_fraction:
            raise ValueError(
                f"offload: offload_params={self.params_fraction} exceeds offload_optim="
                f"{self.optim_fraction}: a chunk whose optimizer runs on the device keeps its "
                f"master weights there, so at most offload_optim of the parameters can be offloaded"
            )
        # refuse a bad budget when built (a dry run names the budget it plans for)
        device_budget(
            self.device_budget,
            torch.device("cuda" if torch.cuda.is_available() else "cpu"),
            whole=self.policy == "device",  # everything stays on the device: no budget needed
        )

    @property
    def fetches(self) -> bool:
        """Whether the parameters are fetched chunk by chunk (every policy but ``"device"``):
        ``amp`` then leaves the casts to compute dtype to those fetches."""
        return self.policy != "device"

    @property
    def params_fraction(self) -> float:
        return 0.0 if self.offload_params is None else float(self.offload_params)

    @property
    def optim_fraction(self) -> float:
        return 0.0 if self.offload_optim is None else float(self.offload_optim)

    def build(self, step: Step, comp: Composition) -> Step:
        # amp, built around offload, computes in its dtype: the fetches cast each chunk to it
        compute = comp.amp.dtype if comp.amp is not None and self.fetches else None
        compute = compute if isinstance(compute, torch.dtype) else None
        # data parallel beneath: the composition's reduction splits the batch, averages the
        # loss and reduces the host rows; zero's stage says what each rank keeps
        dp = comp.reduction
        # tensor parallel beneath: each rank offloads its local pieces, which the fetches wrap
        # back as the tensor-parallel parameters they are
        tp = comp.mesh if comp.shard is not None and comp.shard.plan else None
        return _build(step, self, compute, dp, tp)


def _build(
    step: Step,
    cfg: OffloadConfig,
    compute: torch.dtype | None = None,
    dp: Reduction | None = None,
    tp: Mesh | None = None,
) -> Step:
    if cfg.policy == "device":
        return _build_device(step, cfg)
    loss_fn, optimizer = step.loss_fn, step.optimizer
    hyper = optimizer.adamw
    homes_device = cfg.margin > 0 or (cfg.policy == "static" and cfg.optim_fraction < 1.0)
    if homes_device and hyper is None:
        raise ValueError(
            "offload: chunks homed on the device (margin > 0, or static offload_optim < 1) are "
            "updated by the fused AdamW kernels, which need optim.adamw (plain, no amsgrad) as "
            f"the optimizer; got {optimizer!r:.80}; use margin=0 / offload_optim=1 otherwise"
        )
    if homes_device and step.trainable is not None:
        raise ValueError(
            "offload: chunks homed on the device (margin > 0, or static offload_optim < 1) are "
            "updated whole by the fused AdamW, and frozen parameters (train_step(trainable=...)) "
            "may share a chunk with trained ones; use margin=0 / offload_optim=1 with frozen "
            "parameters"
        )
    if homes_device and dp is not None and dp.cuts_optimizer:
        raise ValueError(
            f"offload: chunks homed on the device (margin > 0, or static offload_optim < 1) keep "
            f"their whole optimizer state there, which zero stage {dp.stage} cuts by rank; use "
            f"margin=0 and offload_optim=1 with stages 1-2, or zero stage 3 (each rank homes its "
            f"own chunks)"
        )
    gathers = dp is not None and dp.stage == 3  # each rank's host holds its ZeRO-3 chunks
    inner_init_extra, inner_update, inner_layout = step.init_extra, step.update, step.layout
    chunk_size_of = None if cfg.chunk_mb is None else cfg.chunk_mb

    def init_extra(params: PyTree) -> dict[str, Any]:
        extra = dict(inner_init_extra(params))
        # what each rank keeps of each parameter (its tensor-parallel piece, or its ZeRO-3
        # chunk of that), from the layout beneath, on the meta device
        placed = inner_layout(as_meta_tree(params))
        templates = [x if isinstance(x, ShardedTensor) else None for x in tree.leaves(placed)]
        params = to_local(placed)
        size = None
        if chunk_size_of is not None:
            itemsize = max(x.element_size() for x in tree.tensors(params))
            size = int(chunk_size_of * 2**20) // itemsize
        routed = routed_leaves(loss_fn, params, templates, gathers, cfg.experts)
        layout = chunk_layout(params, size, routed)
        state = OffloadState(cfg, params, layout, compute, step.trainable)
        state.templates = templates
        state.states_like_params = dp is None or not dp.cuts_optimizer
        _check_floor(state, extra["zero"].mesh.axis_size(extra["zero"].axis) if gathers else 1)
        extra["offload"] = state
        return extra

    def layout(params: PyTree) -> PyTree:
        where = host_device()

        def home(x: Any) -> Any:  # an abstract parameter is made here, straight into host memory
            if isinstance(x, Abstract):
                meta = where.type == "meta"
                x = torch.empty(x.shape, dtype=x.dtype, device="meta") if meta else x.materialize()
            # a tensor-parallel parameter's local piece (the fetches wrap it back)
            # (row-major there: the host update's kernels take contiguous rows)
            if not isinstance(x, torch.Tensor):
                return x
            return local_piece(x).detach().to(where).contiguous()

        # the layout beneath (zero-3 keeps this rank's chunks; an abstract parameter is made
        # there, one at a time, and only its chunk kept) and each piece moved home
        host = tree.map(home, inner_layout(params))
        if pool_device().type == "cuda":  # pinned, so that copies to the GPU can be asynchronous
            host = tree.map(lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x, host)
        return host

    def run(
        params: PyTree, batch: PyTree, extra: dict[str, Any], grad: bool
    ) -> tuple[torch.Tensor, PyTree]:
        state: OffloadState = offload_state(extra)
        leaves = tree.leaves(params)
        if grad:
            state.pool.begin_step()
            state.make_mirrors(leaves)
        if dp is not None:
            batch = dp.split_batch(batch)
        token = torch.zeros((), requires_grad=True) if grad else None
        frame = Streaming(state, leaves, token, extra["zero"] if gathers else None)
        state.pool.select(tuple((tuple(x.shape), x.dtype) for x in tree.tensors(batch)))
        record = grad and state.pool.trace is None
        with state.pool.window(leaves, state.tensors(), record=record), core.context(frame):
            outer = frame.outer()
            given = [outer[k] if k in outer else x.detach() for k, x in enumerate(leaves)]
            with torch.enable_grad() if grad else torch.no_grad():
                loss = loss_fn(tree.unflatten(state.treedef, given), batch)
                check_loss(loss)
                if grad:
                    scale = core.loss_scale()
                    target = loss if scale == 1.0 else loss * scale
                    assert token is not None
                    torch.autograd.grad(target, [token], allow_unused=True)
            state.pool.release(0)
            if grad:
                state.zero_unwritten()
                if scale != 1.0:  # amp's loss scale, undone where the gradients live
                    state.unscale(scale)
                if dp is not None and dp.experts:  # expert weights reduced apart
                    rows, of_leaf = state.grad_pieces()
                    z = extra["zero"] if gathers else None
                    tmpl = [mt.template for mt in tree.leaves(z.metas)] if z else state.templates
                    flags = dp.expert_flags(tmpl)  # (per leaf, once)
                    with DevicePool.host():
                        dp.reduce_rows(rows, [flags[k] for k in of_leaf])
                elif dp is not None:  # the same reduction, on the host rows
                    with DevicePool.host():
                        dp.reduce_rows(state.grad_rows())
        if record:
            _check_warmup(state)
        loss = loss.detach()
        loss = dp.mean_loss(loss) if dp is not None else as_full(loss)
        return loss, (state.trained_grads() if grad else None)

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        return run(params, batch, extra, grad=True)

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        return run(params, batch, extra, grad=False)[0]

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        off = offload_state(state.extra)
        off.pool.wait_copies()  # no copy in flight reads a master the update writes
        host = off.tensors() + tree.tensors(state.opt_state)
        with off.pool.window(tree.leaves(state.params), host, record=False, update=True):
            if core.innermost(core.DryRun) is not None:
                new_state, info = _dry_update(state)
            elif dp is not None and dp.cuts_optimizer:  # ZeRO 1-2: this rank's chunks
                new_state, info = zero_update(state, dp, hyper, inner_update)
            elif hyper is not None:
                z = state.extra["zero"] if gathers else None
                new_state, info = adamw_update(off, hyper, state, norm_axes(off, z, tp))
            else:  # any other optimizer: the update on the host (no chunk is device-homed),
                # on tensor-parallel gradients, so that a clip sees their global norm
                with DevicePool.host():
                    new_state, info = inner_update(off.wrap(grads), state)
                new_state = local_state(new_state)
        off.pool.invalidate()
        return new_state, {**info, **off.pool.metrics()}

    def sync(grads: PyTree) -> PyTree:
        return grads  # averaged over the data-parallel axis in the forward-backward pass

    return step.replace(
        layout=layout,
        init_extra=init_extra,
        forward=forward,
        forward_backward=forward_backward,
        sync=sync,
        update=update,
        donate=True,
    )


def _dry_update(state: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """A dry run's update (cf.memory.predict): no values, so nothing to update."""
    return state, {"grad_norm": torch.zeros((), device="meta"), "lr": 0.0}


def _check_floor(state: OffloadState, gathered: int = 1) -> None:
    """Refuse, before running, a budget that cannot hold group 0 and the largest layer with
    their gradients (the least any step needs, activations aside). Under ZeRO-3 over
    ``gathered`` ranks the chunks are this rank's pieces, and the layer's backward pass also
    holds group 0's and the layer's gathered weights and the layer's whole gradients. Frozen
    leaves (``train_step(trainable=...)``, ``cf.lora``'s base) have no gradients to hold."""
    layout, pool = state.layout, state.pool

    def copies(g: int) -> int:  # a group's copy on the device (in the compute dtype under amp)
        return sum(pool.copy_bytes(c) for c in layout.groups[g])

    def grads(g: int) -> int:  # the gradients of its trainable pieces, in the same dtype
        return sum(
            sum(p.numel for p in layout.chunks[c].pieces if state.trains[p.leaf])
            * pool.copy_dtype(c).itemsize
            for c in layout.groups[g]
        )

    layers = range(1, len(layout.groups))
    if gathered > 1:
        largest = max(((1 + gathered) * copies(g) + gathered * grads(g) for g in layers), default=0)
        floor = (1 + gathered) * copies(0) + largest
        what = "this rank's pieces and the gathered weights of the leaves outside the layers"
        what += " and of the largest layer, with that layer's gradients"
    else:
        largest = max((copies(g) + grads(g) for g in layers), default=0)
        floor = copies(0) + grads(0) + largest
        what = "the parameters and gradients of the leaves outside the layers and of the largest"
        what += " layer"
    if state.budget < floor:
        raise ValueError(
            f"offload: device_budget {state.budget} B is below the smallest feasible budget: "
            f"at least {floor} B ({what}) plus the activations; raise it to >= {floor} B"
        )


def _check_warmup(state: OffloadState) -> None:
    """After the warm-up step: refuse a budget its streaming peak exceeded; home chunks on the
    device in ``margin`` of the room left."""
    pool = state.pool
    peak = pool.window_peak
    pool.end_warmup()
    if peak > state.budget:
        pool.forget()  # measure again next time
        raise ValueError(
            f"offload: device_budget {state.budget} B is below the smallest feasible budget "
            f"{peak} B for this step (measured: the largest layer's working set with its "
            f"activations, streamed one layer at a time); raise it to >= {peak} B, or add "
            f"cf.remat to shrink the activations"
        )
    if state.cfg.margin <= 0:
        return
    spare = state.cfg.margin * (state.budget - peak)
    used = 0
    # device-home layers from the first (the ones a cache cannot keep from the forward pass
    # to the backward pass), then group 0
    order = [c for g in [*range(1, len(state.layout.groups)), 0] for c in state.layout.groups[g]]
    for c in order:
        chunk = state.layout.chunks[c]
        master = 8 if chunk.dtype == torch.float64 else 4
        cost = chunk.capacity * (2 * chunk.dtype.itemsize + 2 * master)
        cost += pool.copy_bytes(c) if pool.copy_dtype(c) != chunk.dtype else 0  # amp's cast
        if used + cost > spare:
            break
        used += cost
        state.to_home.add(c)


def _cast_bytes(state: OffloadState, leaves: list[torch.Tensor]) -> int:
    """Bytes of the parameters handed to the "device" policy's pass that are not the masters
    but copies in another dtype (``amp``'s casts, made before the pass): resident through it."""
    return sum(
        local_piece(x).numel() * x.element_size()
        for x, d in zip(leaves, state.dtypes, strict=True)
        if isinstance(x, torch.Tensor) and x.dtype != d
    )


def _build_device(step: Step, cfg: OffloadConfig) -> Step:
    """The "device" policy: the in-memory step, its device bytes accounted."""
    inner_init_extra, inner_layout = step.init_extra, step.layout
    inner_fb, inner_fwd, inner_update = step.forward_backward, step.forward, step.update

    def layout(params: PyTree) -> PyTree:
        device = pool_device()
        placed = inner_layout(params)

        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

        return tree.map(move, placed)

    def init_extra(params: PyTree) -> dict[str, Any]:
        extra = dict(inner_init_extra(params))
        state = OffloadState(cfg, params, chunk_layout(params))
        # the model states resident for the whole run: the parameters as placed (a ZeRO-3
        # rank's chunks) and the optimizer's state (sized on the meta device, without making it)
        meta = to_local(inner_layout(as_meta_tree(params)))  # as placed on this rank
        state.pool.extra_baseline = tree.size_bytes(meta) + tree.size_bytes(step.init_opt(meta))
        extra["offload"] = state
        return extra

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        state = offload_state(extra)
        state.pool.begin_step()
        leaves = tree.leaves(params)
        with state.pool.window(leaves, [], record=False, carried=_cast_bytes(state, leaves)):
            return inner_fb(params, batch, extra)

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        state = offload_state(extra)
        leaves = tree.leaves(params)
        with state.pool.window(leaves, [], record=False, carried=_cast_bytes(state, leaves)):
            return inner_fwd(params, batch, extra)

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        pool = offload_state(state.extra).pool
        # the gradients (made in the step, perhaps widened since by amp) are held through the
        # update: counted once, whole storages, as carried, and not again when it reads them
        pieces = (local_piece(g).untyped_storage() for g in tree.tensors(grads))
        storages = {id(s): s.nbytes() for s in pieces}
        carried = sum(storages.values())
        held = tree.tensors(state.opt_state) + tree.tensors(grads)
        with pool.window(tree.leaves(state.params), held, record=False, carried=carried):
            if core.innermost(core.DryRun) is not None:
                new_state, info = _dry_update(state)
            else:
                new_state, info = inner_update(grads, state)
        return new_state, {**info, **pool.metrics()}

    return step.replace(
        layout=layout,
        init_extra=init_extra,
        forward_backward=forward_backward,
        forward=forward,
        update=update,
    )


def offload(
    step: Step,
    policy: str = "auto",
    device_budget: int | float | str | None = None,
    *,
    margin: float = 0.0,
    prefetch: int = 1,
    chunk_mb: float | None = None,
    offload_params: float | None = None,
    offload_optim: float | None = None,
    experts: str = "routed",
) -> Step:
    """Keep ``step``'s model states in chunks that move between device and host memory within
    ``device_budget``; see the module docs for the policies.

    ``device_budget``: bytes, a string such as ``"2GiB"``, or a fraction of the device's memory
    (required without a GPU, where the CPU stands for the device). ``margin`` (``"auto"``): the
    fraction of the memory the warm-up step leaves spare that holds device-homed chunks
    (ColossalAI's ``gpu_margin_mem_ratio``). ``prefetch``: groups fetched ahead of their use.
    ``chunk_mb``: the chunk size (None: searched for the least waste). ``offload_params`` and
    ``offload_optim`` (``"static"``): the fractions of parameters and optimizer states in host
    memory. ``experts`` (a mixture of experts): ``"routed"`` fetches each layer's experts when
    its tokens are routed to them, only those (:mod:`colfunc.transforms.offload.experts`);
    ``"layer"`` fetches them with the rest of the layer (and prefetches them with it: on a GPU
    that overlaps their copies with the layer before, which pays where every expert is routed
    to anyway, as in training on large batches).

    Example:
        >>> step = cf.offload(cf.train_step(loss, optim.adamw(3e-4)), "auto", "2GiB", margin=0.8)
    """
    if not isinstance(step, Step):
        raise TypeError(f"offload: expected a Step (from cf.train_step), got {type(step).__name__}")
    config = OffloadConfig(
        policy=policy,
        device_budget=device_budget,
        margin=margin,
        prefetch=prefetch,
        chunk_mb=chunk_mb,
        offload_params=offload_params,
        offload_optim=offload_optim,
        experts=experts,
    )
    return apply_transform(step, "offload", config)
