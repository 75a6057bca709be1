"""``shard_map``: the manual mode, where a function sees local shards and calls collectives itself.

``shard_map(fn, mesh, in_specs, out_specs)(*args)`` brings each argument to its in-spec, hands
``fn`` this rank's local shards (plain tensors), and wraps ``fn``'s local results as
ShardedTensors by the out-specs. Inside ``fn`` the program is per rank: it calls
:mod:`colfunc.sharding.comm` to talk to the others.

Gradients follow the same convention as ``comm``: the plain loop over ranks. The global result is
assembled from the ranks' local results (concatenated for a split output, rank 0's copy for a
replicated one, summed for a Partial one) and differentiated as such, so a replicated output's
gradient reaches the body on one rank only, and a replicated input's gradient is the sum of what
each rank's body sends back (Replicate and Partial("sum") are each other's transposes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from colfunc import tree
from colfunc.core import P
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import Partial, Placements, Replicate, Shard, normalize_placements
from colfunc.sharding.tensor import ShardedTensor, _FromLocal, _global_shape

__all__ = ["shard_map"]


def _transpose(placements: Placements) -> Placements:
    """The placements of a gradient in the plain loop over ranks: Replicate <-> Partial("sum")."""
    return tuple(
        Partial("sum") if isinstance(p, Replicate) else Replicate() if isinstance(p, Partial) else p
        for p in placements
    )


class _Enter(torch.autograd.Function):
    """A ShardedTensor (already in the in-spec) -> this rank's shard."""

    @staticmethod
    def forward(x: ShardedTensor) -> torch.Tensor:
        return x._local.view_as(x._local)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x = inputs[0]
        ctx.mesh, ctx.placements, ctx.shape = x._mesh, x._placements, tuple(x.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _FromLocal.apply(g.contiguous(), ctx.mesh, _transpose(ctx.placements), ctx.shape)


class _Leave(torch.autograd.Function):
    """This rank's result -> a ShardedTensor with the out-spec."""

    @staticmethod
    def forward(
        y: torch.Tensor, mesh: Mesh, placements: Placements, shape: tuple[int, ...]
    ) -> ShardedTensor:
        return ShardedTensor(y.detach(), mesh, placements, shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.placements = inputs[2]

    @staticmethod
    def backward(ctx: Any, g: ShardedTensor) -> tuple[Any, ...]:
        return g.redistribute(_transpose(ctx.placements)).to_local(), None, None, None


def _is_spec(s: Any) -> bool:
    return (
        s is None
        or isinstance(s, P)
        or (
            isinstance(s, tuple | list)
            and bool(s)
            and all(isinstance(p, Shard | Replicate | Partial) for p in s)
        )
    )


def _spec_tree(specs: Any, values: Any, what: str) -> list[tuple[Any, Any]]:
    """Pair each tensor leaf of ``values`` with its spec; ``specs`` is a tree prefix of ``values``
    whose leaves are P specs or placement sequences (None: replicated)."""
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True)
    try:
        subtrees = spec_def.flatten_up_to(values)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"shard_map: {what} {specs!r} do not match the structure of {values!r}: {e}"
        ) from None
    return [(s, x) for s, sub in zip(spec_leaves, subtrees) for x in tree.leaves(sub)]


def shard_map(
    fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """``fn`` run on local shards: inputs split by ``in_specs``, outputs wrapped by ``out_specs``.

    ``in_specs`` has one entry per positional argument (a P spec, a sequence of placements per
    mesh axis, or None for replicated; a nested structure applies leafwise); arguments may be
    ShardedTensors (redistributed to the spec) or plain tensors that every rank holds whole.
    ``out_specs`` likewise for ``fn``'s result. A split output's global shape is found with one
    small all_gather of the local shapes. Differentiable; see the module docstring.

    >>> def body(x_local, w_local):           # x: [B, D] replicated, w: [D, F] split on F
    ...     return x_local @ w_local            # this rank's [B, F / n]
    >>> y = shard_map(body, mesh, (P(), P(None, "tp")), P(None, "tp"))(x, w)
    """
    if not callable(fn):
        raise TypeError(f"shard_map: fn must be callable, got {fn!r}")

    def placements(spec: Any, ndim: int) -> Placements:
        if spec is None:
            return (Replicate(),) * len(mesh.axis_names)
        return normalize_placements(mesh, spec, ndim)

    def enter(spec: Any, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        pl = placements(spec, x.dim())
        if not isinstance(x, ShardedTensor):
            shape, full = tuple(x.shape), (Replicate(),) * len(mesh.axis_names)
            x = _FromLocal.apply(x, mesh, full, shape)
        return _Enter.apply(x.redistribute(pl))

    def leave(spec: Any, y: Any) -> Any:
        if not isinstance(y, torch.Tensor):
            return y
        pl = placements(spec, y.dim())
        shape = (
            _global_shape(y, mesh, pl) if any(isinstance(p, Shard) for p in pl) else tuple(y.shape)
        )
        return _Leave.apply(y, mesh, pl, shape)

    def mapped(*args: Any) -> Any:
        specs = (in_specs,) if _is_spec(in_specs) else tuple(in_specs)
        if not isinstance(specs, tuple) or len(specs) != len(args):
            raise ValueError(
                f"shard_map: in_specs needs one entry per argument; got {in_specs!r} for "
                f"{len(args)} arguments"
            )
        local_args = [
            tree.unflatten(
                tree.structure(a), [enter(s, x) for s, x in _spec_tree(spec, a, "in_specs")]
            )
            for spec, a in zip(specs, args)
        ]
        out = fn(*local_args)
        return tree.unflatten(
            tree.structure(out), [leave(s, y) for s, y in _spec_tree(out_specs, out, "out_specs")]
        )

    return mapped
