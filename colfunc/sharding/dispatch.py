"""Running one ATen op on ShardedTensors: rule, redistribution, local op, wrapping.

For each op :func:`dispatch` looks up the op's rule (:mod:`colfunc.sharding.rules`), which sees
the arguments with tensors replaced by :class:`Spec` values and returns a :class:`Plan`. The
inputs are redistributed as the plan asks, the op (or the plan's ``compute``) runs on the local
shards, and each output is wrapped with its placements and its global shape and strides, found by
running the op on meta tensors. Plain tensors among the arguments count as replicated.

An op without a rule falls back to gather, compute, replicate: correct, but counted per op name
in :func:`fallback_counts`, so that tests and benchmarks can demand none; under :func:`strict`
(or with ``COLFUNC_SHARDING_STRICT=1`` in the environment) it raises instead.

An in-place op runs as its out-of-place form, and the result is redistributed to the placements
of the tensor it writes to and copied into its shard.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from colfunc.sharding.mesh import Mesh, current_mesh
from colfunc.sharding.placement import Partial, Placements, Replicate, grad_placements
from colfunc.sharding.redistribute import redistribute_local
from colfunc.sharding.rules import Plan, Spec, lookup
from colfunc.sharding.tensor import ShardedTensor

__all__ = ["dispatch", "fallback_counts", "reset_fallback_counts", "strict"]

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


# Meta outputs by (op, argument shapes and values); read only for shapes and strides, so sharing
# them between calls and threads is safe.
_META_CACHE: dict[Any, Any] = {}
_META_CACHE_SIZE = 4096


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


def _spec(x: torch.Tensor, mesh: Mesh) -> Spec:
    if isinstance(x, ShardedTensor):
        return Spec(tuple(x.shape), x._placements, x.dtype, mesh, _is_param(x))
    return Spec(tuple(x.shape), (Replicate(),) * len(mesh.axis_names), x.dtype, mesh)


def _is_param(x: ShardedTensor) -> bool:
    """A leaf that requires grad, or a view or cast of one (marked by :func:`_wrap`)."""
    return x._param or (x.requires_grad and x.is_leaf)


def _keeps_param(func: Any) -> bool:
    """Whether ``func``'s output is its first input seen differently (a view or a copy), so that
    an output of it applied to a parameter is the parameter still: ``w.t()``, ``w[i]``, the cast
    of ``w`` under mixed precision, in the forward and as the backward saved them."""
    return func in _COPIES or any(r.alias_info is not None for r in func._schema.returns)


_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):  # e.g. _to_copy(device=...): stay on meta
        return torch.device("meta")
    return x


def _global_meta(func: Any, args: Any, kwargs: Any, flat: list[Any], tree: Any) -> Any:
    """The op's outputs as meta tensors of the global shapes, memoised: running meta kernels
    (often Python decompositions) costs more than the rest of a dispatch."""
    key: Any = (
        func,
        tree,
        *(
            (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x
            for x in flat
        ),
    )
    try:
        return _META_CACHE[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable argument: no memo
        key = None
    out = func(*pytree.tree_map(_meta, args), **pytree.tree_map(_meta, kwargs))
    if key is not None:
        if len(_META_CACHE) >= _META_CACHE_SIZE:
            _META_CACHE.clear()
        _META_CACHE[key] = out
    return out


def _is_inplace(func: Any) -> bool:
    name = func.overloadpacket.__name__
    args = func._schema.arguments
    return (
        name.endswith("_")
        and bool(args)
        and args[0].alias_info is not None
        and args[0].alias_info.is_write
    )


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ATen ``func`` on arguments that include ShardedTensors; see the module docstring."""
    if _is_inplace(func):
        return _inplace(func, args, kwargs)
    flat, tree = pytree.tree_flatten((args, kwargs))
    mesh = _mesh_of(flat)
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    specs = {i: _spec(flat[i], mesh) for i in tensors}

    rule = lookup(func)
    if rule is None:
        plan = _fallback(func, [specs[i] for i in tensors])
    else:
        spec_args, spec_kwargs = pytree.tree_unflatten(
            [specs.get(i, x) for i, x in enumerate(flat)], tree
        )
        got = rule(*spec_args, **spec_kwargs)
        plan = got if isinstance(got, Plan) else Plan(outputs=got)

    local_of: dict[int, Any] = {}
    wants = plan.inputs if plan.inputs is not None else [None] * len(tensors)
    for i, want in zip(tensors, wants):
        x, s = flat[i], specs[i]
        if not isinstance(x, ShardedTensor):
            local = x if want is None else redistribute_local(x, s.shape, mesh, s.placements, want)
            local_of[id(s)] = local
            continue
        if x.requires_grad and not x.is_leaf and torch.is_grad_enabled():
            _reduce_partial_grad(x)
        if want is None or want == s.placements:
            local = x._local
        else:
            local = _redistributed(x, tuple(want))
        local_of[id(s)] = local

    if plan.args is not None or plan.kwargs is not None:
        call_args = plan.args if plan.args is not None else args
        call_kwargs = plan.kwargs if plan.kwargs is not None else kwargs
        lflat, ltree = pytree.tree_flatten((call_args, call_kwargs))
        lflat = [local_of.get(id(x), x) if isinstance(x, Spec) else x for x in lflat]
    else:
        lflat, ltree = (
            [local_of[id(specs[i])] if i in specs else x for i, x in enumerate(flat)],
            tree,
        )
    largs, lkwargs = pytree.tree_unflatten(lflat, ltree)
    out = (plan.compute or _empty_safe(func))(*largs, **lkwargs)

    param = bool(tensors) and specs[tensors[0]].param and _keeps_param(func)
    return _wrap(out, _global_meta(func, args, kwargs, flat, tree), plan.outputs, mesh, param)


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
    if x._is_view() or "_grad_hooked" in x.__dict__:
        return
    x._grad_hooked = True
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


def _redistributed(x: ShardedTensor, want: Placements) -> torch.Tensor:
    """``x``'s local part under ``want``, sharing the communication with the other ops that read
    ``x``. Two cases, both Megatron-LM's:

    - A Partial that an op reduces (all_reduce) is reduced for good: ``x`` takes the replicated
      value and placements, the same global tensor in no more memory, so that the next op that
      reads it does not reduce it again (an embedding's or a row-parallel layer's output is
      reduced once, by its first reader, and is replicated from then on). Not for views, whose
      local part must stay a view of their base's.
    - Any other communicating redistribution is remembered on ``x`` until either tensor is
      written: q, k and v read the normalised activations, which sequence parallelism keeps split
      on the sequence, and gather them once, as Megatron's fused q/k/v projection does. The
      gathered tensor lives as long as ``x`` (an activation, whose lifetime autograd decides);
      a parameter's are not remembered, since a parameter lives all step.
    """
    R = Replicate()
    reduced = tuple(
        R if isinstance(p, Partial) and w == R else p for p, w in zip(x._placements, want)
    )
    if reduced != x._placements and not x._is_view():
        x._local = redistribute_local(x._local, tuple(x.shape), x._mesh, x._placements, reduced)
        x._placements = reduced
        x.__dict__.pop("_redistributions", None)
        if reduced == want:
            return x._local
    memo: dict[Placements, tuple[torch.Tensor, int, torch.Tensor, int]] | None = None
    if not _is_param(x):
        memo = x.__dict__.setdefault("_redistributions", {})
        hit = memo.get(want)
        if hit is not None:
            src, src_version, out, out_version = hit
            if src is x._local and src_version == src._version and out_version == out._version:
                return out
    out = redistribute_local(x._local, tuple(x.shape), x._mesh, x._placements, want)
    if memo is not None and out is not x._local:
        memo[want] = (x._local, x._local._version, out, out._version)
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


def _fallback(func: Any, specs: list[Spec]) -> Plan:
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
    return Plan(outputs=replicated, inputs=[replicated] * len(specs))


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
    # the destination keeps its layout, even where the op reads it reduced (see _redistributed)
    placements, own = self._placements, self._local
    out = dispatch(_functional(func), args, kwargs)
    self._placements, self._local = placements, own
    local = redistribute_local(out._local, tuple(out.shape), self._mesh, out._placements, placements)
    self._local.copy_(local)
    return self
