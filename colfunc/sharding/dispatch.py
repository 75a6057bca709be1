"""Running one ATen op on ShardedTensors: rule, redistribution, local op, wrapping.

For each op :func:`dispatch` looks up the op's rule (:mod:`colfunc.sharding.rules`), which sees
the arguments with tensors replaced by :class:`Spec` values and returns an :class:`OpSharding`. The
inputs are redistributed as the rule asks, the op (or the rule's ``compute``) runs on the local
shards, and each output is wrapped with its placements and its global shape and strides, found by
running the op on meta tensors. Plain tensors among the arguments count as replicated.

An op without a rule falls back to gather, compute, replicate: correct, but counted per op name
in :func:`fallback_counts`, so that tests and benchmarks can demand none; under :func:`strict`
(or with ``COLFUNC_SHARDING_STRICT=1`` in the environment) it raises instead.

An in-place op runs as its out-of-place form, and the result is redistributed to the placements
of the tensor it writes to and copied into its shard.

Three things make a model run the way Megatron-LM's tensor parallelism does (the rules choose
placements op by op; these let the choices add up):

- A Spec says whether its tensor is a parameter (a leaf that requires grad, or a view or cast of
  one), and :func:`~colfunc.sharding.rules.pick` keeps parameters where the tensor-parallel plan put them.
- A redistribution that communicates is remembered on the tensor, so the ops that read one
  tensor alike share one collective, and a Partial reduced once is read replicated from then on
  (see "reading a tensor in another layout" below).
- A Partial gradient is reduced where autograd has summed all of it, onto the placements of the
  tensor it is the gradient of (:func:`_reduce_partial_grad`).

Rules are pure functions of their arguments' metadata, so their Plans, with the outputs' global
shapes, are memoised by it (:class:`_Memo`): after the first step, a dispatch is the
redistributions and the local op.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from colfunc.sharding.mesh import Mesh, current_mesh
from colfunc.sharding.placement import Partial, Placements, Replicate, grad_placements
from colfunc.sharding.redistribute import redistribute_local
from colfunc.sharding.rules import OpSharding, Spec, lookup
from colfunc.sharding.rules.registry import gradient_arithmetic
from colfunc.sharding.tensor import ShardedTensor
from colfunc.torch_private import pytree_module as pytree

__all__ = ["dispatch", "fallback_counts", "is_param", "reset_fallback_counts", "strict"]

STRICT_ENV = "COLFUNC_SHARDING_STRICT"


class _Diagnostics:
    """Process-wide, like a profiler's counters: fallbacks per (rank, op), and the strict flag.

    They are not on the thread-local context stack because the threads backend runs ranks on
    threads that the caller's ``with strict():`` must reach too.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[tuple[int, str]] = collections.Counter()
        self.strict = 0


_DIAG = _Diagnostics()


_MEMO_SIZE = 4096  # entries of the dispatch memo (see _Memo), cleared when full


@contextmanager
def strict() -> Iterator[None]:
    """Inside the block, an op without a propagation rule raises instead of falling back."""
    with _DIAG.lock:
        _DIAG.strict += 1
    try:
        yield
    finally:
        with _DIAG.lock:
            _DIAG.strict -= 1


def fallback_counts(mesh: Mesh | None = None) -> dict[str, int]:
    """How many times each op fell back to gather-compute-replicate, ``{op name: count}``.

    For one rank: that of ``mesh``, else the current mesh's; outside any mesh, summed over ranks.
    """
    if mesh is None:
        try:
            mesh = current_mesh()
        except RuntimeError:
            mesh = None
    out: collections.Counter[str] = collections.Counter()
    with _DIAG.lock:
        for (rank, op), n in _DIAG.counts.items():
            if mesh is None or rank == mesh.rank:
                out[op] += n
    return dict(out)


def reset_fallback_counts() -> None:
    """Forget every fallback count (of all ranks)."""
    with _DIAG.lock:
        _DIAG.counts.clear()


def _is_strict() -> bool:
    return _DIAG.strict > 0 or os.environ.get(STRICT_ENV, "") not in ("", "0")


# --- dispatch -------------------------------------------------------------------------------


def _mesh_of(flat: list[Any]) -> Mesh:
    mesh = None
    for x in flat:
        if isinstance(x, ShardedTensor):
            if mesh is None:
                mesh = x._mesh
            elif x._mesh != mesh:
                raise ValueError(
                    f"an op mixes ShardedTensors on different meshes: {mesh} and {x._mesh}"
                )
    assert mesh is not None
    return mesh


def _spec(x: torch.Tensor, mesh: Mesh, placements: Placements | None) -> Spec:
    if isinstance(x, ShardedTensor):
        assert placements is not None
        return Spec(tuple(x.shape), placements, x.dtype, mesh, is_param(x))
    return Spec(tuple(x.shape), (Replicate(),) * len(mesh.axis_names), x.dtype, mesh)


def is_param(x: ShardedTensor) -> bool:
    """A leaf that requires grad, or a view or cast of one (marked by :func:`_wrap`). (A view
    made without grad, as the backward makes them, is a leaf too, of any tensor: not that.)"""
    return x._param or (x.requires_grad and x.is_leaf and not x._is_view())


def _keeps_param(func: Any) -> bool:
    """Whether ``func``'s output is its first input seen differently (a view or a copy), so that
    an output of it applied to a parameter is the parameter still: ``w.t()``, ``w[i]``, the cast
    of ``w`` under mixed precision, in the forward and as the backward saved them."""
    try:
        return _KEEPS_PARAM[func]
    except KeyError:
        pass
    _KEEPS_PARAM[func] = out = func in _COPIES or any(
        r.alias_info is not None for r in func._schema.returns
    )
    return out


_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
_KEEPS_PARAM: dict[Any, bool] = {}


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):  # e.g. _to_copy(device=...): stay on meta
        return torch.device("meta")
    return x


def _is_inplace(func: Any) -> bool:
    try:
        return _INPLACE[func]
    except KeyError:
        pass
    name = func.overloadpacket.__name__
    args = func._schema.arguments
    _INPLACE[func] = out = (
        name.endswith("_")
        and bool(args)
        and args[0].alias_info is not None
        and args[0].alias_info.is_write
    )
    return out


_INPLACE: dict[Any, bool] = {}


class _Memo:
    """What a dispatch works out from its arguments' metadata alone, kept for the next call with
    the same metadata (by op, argument structure, shapes, strides, dtypes, placements as read and
    the other arguments): the rule's OpSharding, the ids of the Specs it was made from (an OpSharding's
    ``args`` name tensors by their Specs), and the outputs as meta tensors of the global shapes.
    Picking among a rule's options and running meta kernels (often Python decompositions) cost
    more than the rest of a dispatch but the local op; a rule is a pure function of its Specs
    and the other arguments."""

    __slots__ = ("ids", "mesh", "meta", "sharding")

    def __init__(self, sharding: OpSharding, ids: list[int], mesh: Mesh) -> None:
        self.sharding, self.ids, self.mesh, self.meta = sharding, ids, mesh, None


_MEMO: dict[Any, _Memo] = {}
_CONTAINERS = (list, tuple, dict)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten((args, kwargs))``, without its cost for the common shapes of ATen
    calls: positional arguments that are leaves or plain lists/tuples of leaves. The spec is
    then a tuple (``None`` for a leaf, ``(type, length)`` for a list), else pytree's own."""
    if kwargs:
        return pytree.tree_flatten((args, kwargs))
    flat: list[Any] = []
    spec: list[Any] = []
    for a in args:
        kind = type(a)
        if kind is list or kind is tuple:
            for b in a:
                if isinstance(b, _CONTAINERS):
                    return pytree.tree_flatten((args, kwargs))
            flat.extend(a)
            spec.append((kind, len(a)))
        elif isinstance(a, _CONTAINERS):  # a subclass (torch.Size, a named tuple): pytree knows
            return pytree.tree_flatten((args, kwargs))
        else:
            flat.append(a)
            spec.append(None)
    return flat, tuple(spec)


def _unflatten(flat: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inverse of :func:`_flatten`: ``(args, kwargs)``."""
    if not isinstance(spec, tuple):
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return args, kwargs
    out: list[Any] = []
    i = 0
    for s in spec:
        if s is None:
            out.append(flat[i])
            i += 1
        else:
            kind, n = s
            out.append(kind(flat[i : i + n]))
            i += n
    return tuple(out), {}


def _memo(func: Any, flat: list[Any], tree: Any, specs: dict[int, Spec], mesh: Mesh) -> _Memo:
    key: Any = (
        func,
        tree,
        mesh,
        gradient_arithmetic(),
        *(
            (s.shape, flat[i].stride(), s.dtype, s.placements, s.param)
            if (s := specs.get(i)) is not None
            else x
            for i, x in enumerate(flat)
        ),
    )
    try:
        hit = _MEMO[key]
        if hit.mesh is mesh:  # an equal mesh may keep another ledger
            return hit
    except KeyError:
        pass
    except TypeError:  # an unhashable argument: no memo
        key = None
    ids = [id(s) for s in specs.values()]
    rule = lookup(func)
    if rule is None:  # not remembered: every fallback is counted
        return _Memo(_fallback(func, list(specs.values())), ids, mesh)
    spec_args, spec_kwargs = _unflatten([specs.get(i, x) for i, x in enumerate(flat)], tree)
    got = rule(*spec_args, **spec_kwargs)
    memo = _Memo(got if isinstance(got, OpSharding) else OpSharding(outputs=got), ids, mesh)
    if key is not None:
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.clear()
        _MEMO[key] = memo
    return memo


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ATen ``func`` on arguments that include ShardedTensors; see the module docstring."""
    if _is_inplace(func):
        return _inplace(func, args, kwargs)
    flat, tree = _flatten(args, kwargs)
    mesh = _mesh_of(flat)
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    # each ShardedTensor is read in the layout at hand: its own, or one an earlier op reduced it to
    hand = {i: _at_hand(flat[i]) for i in tensors if isinstance(flat[i], ShardedTensor)}
    specs = {i: _spec(flat[i], mesh, hand[i][0] if i in hand else None) for i in tensors}
    memo = _memo(func, flat, tree, specs, mesh)
    how, ids = memo.sharding, memo.ids

    local_at: dict[int, Any] = {}  # by argument position
    wants = how.inputs if how.inputs is not None else [None] * len(tensors)
    for i, want in zip(tensors, wants):
        x, s = flat[i], specs[i]
        if not isinstance(x, ShardedTensor):
            local = x if want is None else redistribute_local(x, s.shape, mesh, s.placements, want)
        else:
            if x.requires_grad and not x.is_leaf and torch.is_grad_enabled():
                _reduce_partial_grad(x)
            local = hand[i][1]
            if want is not None and want != s.placements:
                local = _redistributed(x, s.placements, local, tuple(want))
        local_at[i] = local

    if how.args is not None or how.kwargs is not None:
        call_args = how.args if how.args is not None else args
        call_kwargs = how.kwargs if how.kwargs is not None else kwargs
        lflat, ltree = _flatten(call_args, call_kwargs)
        local_of = {sid: local_at[i] for sid, i in zip(ids, tensors)}  # the rule names Specs
        lflat = [local_of.get(id(x), x) if isinstance(x, Spec) else x for x in lflat]
    else:
        lflat, ltree = [local_at.get(i, x) for i, x in enumerate(flat)], tree
    largs, lkwargs = _unflatten(lflat, ltree)
    if how.compute is not None:
        out = how.compute(*largs, **lkwargs)
    elif any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in lflat):
        out = _empty_safe(func)(*largs, **lkwargs)
    else:
        out = func(*largs, **lkwargs)

    if memo.meta is None:  # the global shapes and strides of the outputs
        memo.meta = func(*pytree.tree_map(_meta, args), **pytree.tree_map(_meta, kwargs))
    param = bool(tensors) and specs[tensors[0]].param and _keeps_param(func)
    return _wrap(out, memo.meta, how.outputs, mesh, param)


def _reduce_partial_grad(x: ShardedTensor) -> None:
    """Reduce a Partial gradient of ``x``, once autograd has summed every part of it, onto
    ``x``'s own placements: an all_reduce for a replicated ``x``, a reduce_scatter for one split
    on the sequence.

    This is where Megatron-LM reduces: the input gradients of q, k and v (each a Partial sum over
    the heads) add up at the normalised activations they share and are reduced there once, not
    once per projection; the norm's backward then runs on the placements of its forward. Only
    tensors that ops produce (not leaves, whose gradients the caller places) and not views (the
    gradient reaches their base, which is reduced instead) are hooked, once each.
    """
    if "_grad_hooked" in x.__dict__:
        return
    x.__dict__["_grad_hooked"] = True
    if x._is_view():
        return
    target = grad_placements(x._placements)

    def hook(g: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(g, ShardedTensor) or not any(
            isinstance(p, Partial) for p in g._placements
        ):
            return None
        return g.redistribute(
            [t if isinstance(p, Partial) else p for p, t in zip(g._placements, target)]
        )

    x.register_hook(hook)


# --- reading a tensor in another layout, once --------------------------------------------------
#
# A redistribution that communicates is remembered on the tensor (``_redistributions``: target
# placements -> (source local, its version, result, its version)) until either is written, so
# that the ops that read one tensor alike share one collective. Two cases are Megatron-LM's:
#
# - A Partial that one op reduces is read replicated by every later op (an embedding's or a
#   row-parallel layer's output is reduced once, by its first reader, as Megatron reduces right
#   after the layer): the rules see the reduced placements, so the residual stream that adds to
#   it is replicated too rather than a Partial that every norm reduces anew.
# - q, k and v read the normalised activations, which sequence parallelism keeps split on the
#   sequence, and gather them once, as Megatron's fused q/k/v projection does.
#
# A result lives as long as its tensor: for an activation, about as long as the ops that read it
# keep it anyway (autograd decides); a parameter lives all step and is not remembered.

_Moved = dict[Placements, tuple[torch.Tensor, int, torch.Tensor, int]]


def _reduced(placements: Placements) -> Placements | None:
    """``placements`` with every Partial replaced by Replicate, or None if there is none."""
    if not any(isinstance(p, Partial) for p in placements):
        return None
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _recall(x: ShardedTensor, want: Placements) -> torch.Tensor | None:
    moved: _Moved | None = x.__dict__.get("_redistributions")
    hit = moved.get(want) if moved else None
    if hit is None:
        return None
    src, src_version, out, out_version = hit
    valid = src is x._local and src_version == src._version and out_version == out._version
    return out if valid else None


def _at_hand(x: ShardedTensor) -> tuple[Placements, torch.Tensor]:
    """The placements and local part to read ``x`` in: reduced if an op has reduced it."""
    reduced = _reduced(x._placements)
    out = _recall(x, reduced) if reduced is not None else None
    if reduced is None or out is None:
        return x._placements, x._local
    return reduced, out


def _redistributed(
    x: ShardedTensor, src: Placements, local: torch.Tensor, want: Placements
) -> torch.Tensor:
    """The local part of ``x`` under ``want``, from ``local`` under ``src`` (see above)."""
    if is_param(x):
        return redistribute_local(local, tuple(x.shape), x._mesh, src, want)
    reduced = _reduced(src)
    if (
        reduced is not None
        and reduced != want
        and all(w == Replicate() for p, w in zip(src, want) if isinstance(p, Partial))
    ):  # reduce first and remember it, then move on from the replicated value
        local, src = _redistributed(x, src, local, reduced), reduced
    out = _recall(x, want)
    if out is None:
        out = redistribute_local(local, tuple(x.shape), x._mesh, src, want)
        if out is not local:
            moved: _Moved = x.__dict__.setdefault("_redistributions", {})
            moved[want] = (x._local, x._local._version, out, out._version)
    return out


def _empty_safe(func: Any) -> Any:
    """``func``, but on an empty shard whose outputs are all empty, the empty outputs without
    running the kernel (some kernels, e.g. CPU flash attention, fault on empty inputs)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in leaves):
            return func(*args, **kwargs)
        device = next(x.device for x in leaves if isinstance(x, torch.Tensor))
        meta = func(*pytree.tree_map(_meta, args), **pytree.tree_map(_meta, kwargs))
        outs = pytree.tree_leaves(meta)
        if any(isinstance(m, torch.Tensor) and m.numel() > 0 for m in outs):
            return func(*args, **kwargs)
        return pytree.tree_map(
            lambda m: (
                torch.empty(m.shape, dtype=m.dtype, device=device)
                if isinstance(m, torch.Tensor)
                else m
            ),
            meta,
        )

    return run


def _wrap(out: Any, meta: Any, outputs: Any, mesh: Mesh, param: bool = False) -> Any:
    single = not outputs or not isinstance(outputs[0], tuple)

    def one(x: Any, m: Any, pl: Placements) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        r = ShardedTensor(x, mesh, tuple(pl), tuple(m.shape), tuple(m.stride()))
        if param:
            r._param = True
        return r

    if isinstance(out, tuple | list):
        wrapped = [
            one(x, m, outputs if single else outputs[i]) for i, (x, m) in enumerate(zip(out, meta))
        ]
        return type(out)(wrapped)
    return one(out, meta, outputs if single else outputs[0])


def _fallback(func: Any, specs: list[Spec]) -> OpSharding:
    placed = ", ".join(f"{tuple(s.shape)} {s.placements}" for s in specs)
    if _is_strict():
        raise RuntimeError(
            f"no sharding rule for {func} (inputs: {placed}); add one in colfunc/sharding/rules/ "
            f"with @rule({func.overloadpacket}), or leave strict mode to gather, compute and "
            "replicate"
        )
    with _DIAG.lock:
        _DIAG.counts[(specs[0].mesh.rank, str(func))] += 1
    replicated = (Replicate(),) * len(specs[0].mesh.axis_names)
    return OpSharding(outputs=replicated, inputs=[replicated] * len(specs))


def _functional(func: Any) -> Any:
    name = func.overloadpacket.__name__[:-1]
    packet = getattr(torch.ops.aten, name, None)
    overload = getattr(packet, func._overloadname, None) if packet is not None else None
    if overload is None:
        raise NotImplementedError(
            f"in-place {func} on a ShardedTensor: no out-of-place aten.{name}"
        )
    return overload


def _inplace(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if not isinstance(self, ShardedTensor):
        raise TypeError(
            f"{func}: cannot write a sharded result into a plain tensor; make the destination a "
            "ShardedTensor (distribute it) first"
        )
    out = dispatch(_functional(func), args, kwargs)
    local = redistribute_local(
        out._local, tuple(out.shape), self._mesh, out._placements, self._placements
    )
    self._local.copy_(local)
    return self
