"""The anatomy of a training step, as pure functions over a ``TrainState`` pytree.

A :class:`Step` is five pieces plus the loss and optimizer they close over:

``layout(params) -> params``
    how parameters are placed (identity on one device; ``shard`` and ``zero`` replace it).
``init_opt(placed_params) -> opt_state``
    the optimizer state for the placed parameters (``zero`` replaces it to keep only a shard).
``init_extra(params) -> dict``
    the transform-owned entries of a fresh state, from the parameters as given (before
    ``layout``), e.g. ``amp``'s loss scale (empty by default).
``forward(params, batch, extra) -> loss``
    the loss alone, without gradients (:meth:`Step.evaluate`); every transform that changes how
    the forward pass runs (placement, gathers, microbatches, casts) replaces it as it replaces
    ``forward_backward``.
``forward_backward(params, batch, extra) -> (loss, grads)``
    the loss and its gradients (``amp``, ``remat`` and ``pipeline`` replace it). The loss is
    multiplied by :func:`colfunc.core.loss_scale` before differentiation, so a transform can scale
    the backward pass of whatever computes it.
``sync(grads) -> grads``
    gradient reductions across ranks (identity on one device; data parallel replaces it).
``update(grads, state) -> (state, info)``
    the optimizer: new params, optimizer state and extra entries (``zero`` replaces it to update
    only its shard, ``amp`` to skip steps with overflowed gradients).
``finish(state) -> state``
    work after the update: re-gather, casts (identity by default).

A transform is a ``Step -> Step`` that swaps only the pieces it owns, so transforms compose; the
step records the plain step it was built from (``base``) and what was applied (``composition``,
see :mod:`colfunc.transforms.composition`).
A step never mutates the state or the batch passed in, unless built to donate the state (see
:func:`train_step`).

A call runs the pieces one after another inside a :class:`colfunc.core.StepRun` frame. Where the
composition reads no gradient between the backward pass and the optimizer (``overlap_update``:
plain data parallelism, ``shard`` or ZeRO stage 0, without ``amp`` or ``offload``), the
forward-backward may return while its last gradient buckets are still being reduced, and an
optimizer that updates in parts (``optim.adamw``) updates the layers whose gradients have
arrived meanwhile; the call returns only once everything has arrived. The numbers are the
same either way: the update is elementwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from colfunc import core, random, tree
from colfunc.optim.base import GradientTransformation, apply_updates
from colfunc.optim.clip import global_norm, known_norm
from colfunc.sharding import host_malloc

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = [
    "StateLayout",
    "Step",
    "TrainState",
    "Trainable",
    "check_loss",
    "full_state",
    "train_step",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], torch.Tensor]
ForwardBackward = Callable[[PyTree, PyTree, dict[str, Any]], tuple[torch.Tensor, PyTree]]
Forward = Callable[[PyTree, PyTree, dict[str, Any]], torch.Tensor]


class TrainState(NamedTuple):
    """Everything a training run carries from one step to the next.

    ``extra`` holds transform-owned entries (e.g. ``"loss_scale"`` for ``amp``), keyed by name.
    """

    params: PyTree
    opt_state: PyTree
    step: int
    extra: dict[str, Any]


Update = Callable[[PyTree, TrainState], tuple[TrainState, dict[str, Any]]]


@runtime_checkable
class StateLayout(Protocol):
    """An entry of ``TrainState.extra`` kept by a transform that stores the state in pieces of
    its own (ZeRO's chunks, a pipeline's stages): it puts them back together and cuts them again.

    ``gather_params(params)`` gives the parameters as the step beneath this transform lays them
    out, ``gather_opt(states)`` the same for a tree of optimizer states shaped like the
    parameters (both collectives), and ``place_opt(states)`` is the inverse of ``gather_opt``
    on this rank. :func:`full_state` and :meth:`Step.place_state` go through these.
    """

    def gather_params(self, params: PyTree) -> PyTree: ...

    def gather_opt(self, states: PyTree) -> PyTree: ...

    def place_opt(self, states: PyTree) -> PyTree: ...


def check_loss(loss: Any) -> None:
    """Refuse a loss that is not a scalar tensor (a ValueError naming what it was)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss function must return a scalar tensor, got {shape}")


def _forward(loss_fn: LossFn) -> Forward:
    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            loss = loss_fn(params, batch)
        check_loss(loss)
        return loss

    return forward


def _forward_backward(loss_fn: LossFn, trainable: Trainable | None = None) -> ForwardBackward:
    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        flat, treedef = tree.flatten_with_paths(params)
        # Fresh leaves that share storage with the caller's tensors: the caller's are untouched.
        leaves = [
            x.detach().requires_grad_(
                x.is_floating_point() and (trainable is None or trainable(path))
            )
            for path, x in flat
        ]
        taps = core.innermost(core.LayerGrads)
        if taps is not None:  # a frame that takes each scanned layer's gradients as they come
            taps.track({path: x for (path, _), x in zip(flat, leaves)})
        with torch.enable_grad():
            loss = loss_fn(tree.unflatten(treedef, leaves), batch)
            check_loss(loss)
            diff = [x for x in leaves if x.requires_grad]
            scale = core.loss_scale()
            target = loss if scale == 1.0 else loss * scale
            grads_diff = torch.autograd.grad(target, diff, allow_unused=True) if diff else ()
        it = iter(grads_diff)
        if trainable is not None:  # the trainable leaves' gradients only (frozen: none at all)
            by_path: dict[str, torch.Tensor] = {}
            for (path, _), x in zip(flat, leaves):
                if x.requires_grad:
                    got = next(it)
                    by_path[path] = torch.zeros_like(x) if got is None else got
            part = tree.subset(params, by_path.__contains__)
            return loss.detach(), tree.map_with_path(lambda path, _: by_path[path], part)
        grads = []
        for x in leaves:
            g = next(it) if x.requires_grad else None
            grads.append(torch.zeros_like(x) if g is None else g)
        return loss.detach(), tree.unflatten(treedef, grads)

    return forward_backward


def _update(optimizer: GradientTransformation, donate: bool) -> Update:
    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        run = core.innermost(core.StepRun)
        arrival = run.arrival_for(grads) if run is not None else None
        if arrival is not None and run is not None:
            # gradients in flight (data parallelism's last buckets): an optimizer that updates
            # in parts updates what has arrived while the rest is reduced; the norm reads the
            # whole, after (the optimizer does not need it: no clipping updates in parts)
            fast = (
                optimizer.apply(
                    grads, state.opt_state, state.params, donate=donate, arrival=arrival
                )
                if optimizer.apply is not None and optimizer.in_parts
                else None
            )
            run.complete()
            if fast is not None:
                info = {"grad_norm": global_norm(grads), "lr": optimizer.lr(state.opt_state)}
                return state._replace(params=fast[0], opt_state=fast[1]), info
        norm = global_norm(grads)
        info = {"grad_norm": norm, "lr": optimizer.lr(state.opt_state)}
        with known_norm(grads, norm):  # clipping reuses it
            fast = (
                optimizer.apply(grads, state.opt_state, state.params, donate=donate)
                if optimizer.apply
                else None
            )
            if fast is not None:
                params, opt_state = fast
            else:
                updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
                params = apply_updates(state.params, updates)
        return state._replace(params=params, opt_state=opt_state), info

    return update


def _update_part(inner: Update) -> Update:
    """``inner`` on the parameters that have gradients (the trainable ones): the frozen ones are
    handed back as they are, never seen by the optimizer."""

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        part = tree.subset(state.params, set(tree.paths(grads)).__contains__)
        new, info = inner(grads, state._replace(params=part))
        return new._replace(params=tree.merge(state.params, new.params)), info

    return update


class Trainable:
    """Which parameters a step trains, by dotted path: a pattern, a list of patterns (any
    matching) or a predicate on paths (:func:`train_step`'s ``trainable``). Only floating
    leaves train; every other leaf is frozen: no gradient, no optimizer state, no update."""

    def __init__(self, spec: Any) -> None:
        from colfunc.optim.partition import path_predicate

        if isinstance(spec, (dict, tuple)) or (isinstance(spec, list) and not spec):
            raise TypeError(
                f"train_step: trainable must be a path pattern, a list of them or a predicate "
                f"on dotted paths, got {spec!r}"
            )
        keep = path_predicate("train_step: trainable", spec)
        assert keep is not None  # (a pytree of bools was refused above)
        self.spec, self.keep = spec, keep

    def __call__(self, path: str) -> bool:
        return self.keep(path)

    def part(self, params: PyTree) -> PyTree:
        """The trainable leaves of ``params`` (floating ones the spec selects)."""
        floats = {
            p
            for p, x in tree.flatten_with_paths(params)[0]
            if isinstance(x, torch.Tensor) and x.is_floating_point() and self.keep(p)
        }
        return tree.subset(params, floats.__contains__)

    def check(self, params: PyTree) -> None:
        """Refuse a spec that selects no floating parameter, naming it and the paths."""
        if not tree.paths(self.part(params)):
            raise ValueError(
                f"train_step: trainable={self.spec!r} selects none of the floating parameters; "
                f"their paths look like {tree.paths(params)[:4]}"
            )

    def __repr__(self) -> str:
        return f"Trainable({self.spec!r})"


def _storage(x: torch.Tensor) -> int:
    local = getattr(x, "_local", x)  # a ShardedTensor's own piece
    return int(local.untyped_storage().data_ptr())


def _owned(placed: PyTree, given: PyTree) -> PyTree:
    """``placed`` with every tensor that shares memory with one of ``given`` copied."""
    shared = {_storage(x) for x in tree.tensors(given)}

    def own(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or _storage(x) not in shared:
            return x
        if hasattr(x, "_local"):  # a ShardedTensor: its piece, copied, in the same placements
            sharded: Any = x
            return type(x)(sharded._local.clone(), sharded.mesh, sharded.placements, tuple(x.shape))
        return x.clone()

    return tree.map(own, placed)


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _identity(x: Any) -> Any:
    return x


def _no_extra(params: PyTree) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Step:
    """A training step built from replaceable pieces; see the module docstring.

    ``step.init(params) -> TrainState``; ``step(state, batch) -> (state, metrics)`` with
    ``metrics["loss"]``, ``metrics["grad_norm"]`` (0-d tensors) and ``metrics["lr"]`` (float).
    """

    loss_fn: LossFn
    optimizer: GradientTransformation
    layout: Callable[[PyTree], PyTree]
    init_opt: Callable[[PyTree], PyTree]
    init_extra: Callable[[PyTree], dict[str, Any]]
    forward: Forward
    forward_backward: ForwardBackward
    sync: Callable[[PyTree], PyTree]
    update: Update
    finish: Callable[[TrainState], TrainState]
    donate: bool = False  # whether the update writes into the buffers of the state passed in
    # whether the update may start on gradients still being reduced (core.StepRun): set by the
    # composition where nothing between the backward pass and the optimizer reads them, and
    # cleared by ``replace``, since a piece swapped in may read them
    overlap_update: bool = False
    base: Step | None = None  # the plain step the transforms were applied to (None: this one)
    composition: Composition | None = None  # the transforms applied to ``base``
    # the parameters it trains (None: every floating leaf); see :func:`train_step`
    trainable: Trainable | None = None
    # what the parameters given to ``init`` become before any layout sees them (``cf.lora``
    # adds its adapters here, so that no transform's cut changes how they are made)
    prepare: Callable[[PyTree], PyTree] = _identity

    def trainable_part(self, t: PyTree) -> PyTree:
        """The leaves of ``t`` (shaped like the parameters, or like their pieces) that this
        step trains: ``t`` itself when it trains every leaf."""
        return t if self.trainable is None else self.trainable.part(t)

    def replace(self, **pieces: Any) -> Step:
        """A new step with some pieces swapped (the way transforms are written). It runs its
        pieces one after another (``overlap_update`` off, unless given)."""
        return dataclasses.replace(self, **{"overlap_update": False, **pieces})

    def init(self, params: PyTree) -> TrainState:
        """The initial state: parameters placed by ``layout`` and a fresh optimizer state.

        ``params`` may hold :class:`colfunc.random.Abstract` leaves (``models.gpt.init(cfg,
        abstract=True)``): each is made once, where the layout places it, never all at once
        where a transform keeps pieces (ZeRO-3 shards, offload's host chunks).

        A donating step's state owns its buffers: placed parameters that share memory with
        ``params`` (on one device they are ``params`` themselves) are copied.
        """
        params = self.prepare(params)
        abstract = random.is_abstract(params)
        if not tree.tensors(params) and not abstract:
            raise ValueError("Step.init: params has no tensor leaves")
        # abstract parameters (described, not made): the layout makes each where it belongs,
        # one at a time (ZeRO-3 keeps its chunk, offload its host copy); what it leaves
        # abstract is made here. The transforms' own entries need only shapes.
        placed = self.layout(params)
        if abstract:
            placed = random.materialize(placed)
        if host_malloc.wanted() and any(x.device.type == "cpu" for x in tree.tensors(placed)):
            # a step on host memory frees and allocates its activations and gradients anew
            # each time: keep the freed memory for the next step (COLFUNC_MALLOC=system: not)
            host_malloc.keep_freed_memory()
        if self.donate and not abstract:
            placed = _owned(placed, params)
        described = random.as_meta(params) if abstract else params
        return TrainState(placed, self.init_opt(placed), 0, dict(self.init_extra(described)))

    def place_state(self, full: TrainState) -> TrainState:
        """The inverse of :func:`full_state`: a state in the single-device layout (say, from a
        checkpoint) laid out as this step lays out its own, on this rank.

        The parameters are placed by ``layout``; every part of the optimizer state that mirrors
        the parameters (Adam's moments, momentum) is placed the same way, and cut like the
        optimizer's own where a transform keeps it in pieces (ZeRO); the rest is kept. The
        transforms' own entries of ``extra`` are made afresh; plain values (amp's loss scale)
        are kept. So a run saved under one mesh continues under another. Call it on every rank.
        """
        if not isinstance(full, TrainState):
            raise TypeError(f"place_state takes a TrainState, got {type(full).__name__}")
        fresh = self.init(full.params)
        entries = [e for e in fresh.extra.values() if isinstance(e, StateLayout)]  # innermost first

        def place(states: PyTree) -> PyTree:
            # states of part of the parameters (an optimizer over a subset of them) are laid
            # out as the whole tree would be, then taken back out of it
            whole = tree.structure(states) == tree.structure(full.params)
            placed = self.layout(states if whole else tree.merge(full.params, states))
            for entry in entries:
                placed = entry.place_opt(placed)
            return placed if whole else tree.subset(placed, set(tree.paths(states)).__contains__)

        opt_state = tree.map_subtrees(place, full.opt_state, full.params)
        want = [(p, _shape(x)) for p, x in tree.flatten_with_paths(fresh.opt_state)[0]]
        got = [(p, _shape(x)) for p, x in tree.flatten_with_paths(opt_state)[0]]
        if want != got:
            diff = sorted(set(want) ^ set(got))[:3]
            raise ValueError(
                f"place_state: the optimizer state does not match this step's optimizer ({diff}); "
                "give the state of a step with the same loss and optimizer"
            )
        if self.donate:  # the new state must own what it will write into
            opt_state = _owned(opt_state, full)
        kept = {k: v for k, v in full.extra.items() if not isinstance(v, StateLayout)}
        return TrainState(fresh.params, opt_state, full.step, {**fresh.extra, **kept})

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"a Step takes the TrainState from step.init(params), got {type(state).__name__}"
            )
        sown = core.Sown()  # what the model reports (sow): expert counts
        with core.context(core.StepRun(self.overlap_update)) as run, core.context(sown):
            try:
                loss, grads = self.forward_backward(state.params, batch, state.extra)
                grads = self.sync(grads)
                new_state, info = self.update(grads, state)
            finally:
                run.complete()
        new_state = new_state._replace(step=state.step + 1, extra=dict(new_state.extra))
        return self.finish(new_state), {"loss": loss, **info, **sown.stacked()}

    def evaluate(self, state: TrainState, batch: PyTree) -> dict[str, Any]:
        """The forward-only step: ``{"loss": loss}`` on ``batch``, no gradient, no update.

        Under any composition it runs the forward pass as the training step does (the batch
        split over the data-parallel axis, stage-3 layers gathered one at a time, microbatches
        through the pipeline), gathering nothing that forward pass does not gather. Call it on
        every rank; the loss is the same on all of them.
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"Step.evaluate takes the TrainState from step.init(params), got "
                f"{type(state).__name__}"
            )
        with torch.no_grad():
            return {"loss": self.forward(state.params, batch, state.extra)}


def train_step(
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    *,
    donate: bool = False,
    trainable: Any = None,
) -> Step:
    """The single-device training step for ``loss_fn(params, batch) -> scalar``.

    ``donate=True`` lets the step reuse the buffers of the state passed in for the new state
    (as JAX's ``donate_argnums``): the optimizer updates parameters and moments in place instead
    of on copies, which saves three passes over the model per step. The state passed in must
    then not be used again; ``state, metrics = step(state, batch)`` is the intended use.

    ``trainable`` (a path pattern, a list of them, or a predicate on dotted paths; None: every
    floating leaf) names the parameters to train. The others are frozen: they are placed,
    sharded and gathered like any parameter, but get no gradient (``requires_grad`` off, so
    no gradient buffer and no data-parallel reduction), no optimizer state and no update; they
    come out of every step bit-identical. The gradients the step's pieces pass on hold the
    trainable leaves only.

    Example:
        >>> step = cf.train_step(models.gpt.loss(cfg), optim.adamw(3e-4))
        >>> state = step.init(params)
        >>> state, metrics = step(state, batch)
        >>> head_only = cf.train_step(loss_fn, optim.adamw(1e-3), trainable="head.*")
    """
    if not callable(loss_fn):
        raise TypeError(f"train_step: loss_fn must be callable, got {loss_fn!r}")
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"train_step: optimizer must be a colfunc.optim GradientTransformation (e.g. "
            f"optim.adamw(3e-4)), got {optimizer!r}"
        )
    keep = Trainable(trainable) if trainable is not None else None
    update = _update(optimizer, donate)
    init_opt = optimizer.init
    if keep is not None:
        update = _update_part(update)

        def init_opt(placed: PyTree) -> PyTree:
            keep.check(placed)
            return optimizer.init(keep.part(placed))

    return Step(
        loss_fn=loss_fn,
        optimizer=optimizer,
        layout=_identity,
        init_opt=init_opt,
        init_extra=_no_extra,
        forward=_forward(loss_fn),
        forward_backward=_forward_backward(loss_fn, keep),
        sync=_identity,
        update=update,
        finish=_identity,
        donate=donate,
        trainable=keep,
    )


def full_state(state: PyTree) -> PyTree:
    """The state with every distributed tensor gathered to a full tensor on every rank.

    On one device this is the state itself. Distributed tensors (anything with ``full_tensor()``)
    are gathered, and so are parameters and optimizer states that a transform keeps in pieces
    (ZeRO's chunks, a pipeline stage's layers): the result is laid out as the single-device
    step's state (:meth:`Step.place_state` is the inverse). A collective: call it on every rank.
    """

    def full(x: Any) -> Any:
        return x.full_tensor() if hasattr(x, "full_tensor") else x

    if isinstance(state, TrainState):
        # a transform that stores parameters in pieces of its own keeps, in ``extra``, a
        # StateLayout that can put them back together, outermost transform first: its entry
        # comes last, since each adds to its inner's
        like, params, opt_state = state.params, state.params, state.opt_state
        for entry in reversed(list(state.extra.values())):
            if isinstance(entry, StateLayout):
                opt_state = tree.map_subtrees(entry.gather_opt, opt_state, like)
                params = entry.gather_params(params)
        state = state._replace(params=params, opt_state=opt_state)
    return tree.map(full, state)
