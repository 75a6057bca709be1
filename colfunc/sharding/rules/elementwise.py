"""Elementwise ops, with broadcasting.

On each mesh axis the output is replicated, or split on one of its dims (every input that has
that dim at full size split the same way, inputs broadcast along it replicated), or Partial
where the op is linear in the Partial inputs: ``add(Partial, Partial)``, ``mul(Partial, R)``,
``gelu_backward(Partial grad, R input)``. ``partial`` lists the groups of tensor arguments (by
position among the tensor arguments) that may be Partial together, the others replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placement, Shard
from colfunc.sharding.rules.registry import (
    OpSharding,
    Option,
    R,
    Spec,
    gradient_arithmetic,
    pick,
    rule,
)
from colfunc.torch_private import pytree_module as pytree

__all__ = ["options", "pointwise"]

aten = torch.ops.aten
LINEAR = ("sum", "avg")  # a linear map commutes with sums and averages of pieces
IDENTITY = ("sum", "avg", "max")  # a copy (or a cast) commutes with max too


def options(
    specs: Sequence[Spec], partial: Sequence[tuple[int, ...]] = (), ops: Sequence[str] = LINEAR
) -> list[Option]:
    """The per-axis options of an elementwise op over ``specs`` (see the module docstring)."""
    out_shape = torch.broadcast_shapes(*(s.shape for s in specs))
    n = len(out_shape)
    opts: list[Option] = [(R, [R] * len(specs))]
    for d in range(n):
        ins: list[Placement | None] = []
        for s in specs:
            di = d - (n - s.ndim)
            ins.append(Shard(di) if di >= 0 and s.shape[di] == out_shape[d] else R)
        opts.append((Shard(d), ins))
    for group in partial:
        for op in ops:
            opts.append(
                (Partial(op), [Partial(op) if i in group else R for i in range(len(specs))])
            )
    return opts


def pointwise(
    *funcs: Any, partial: Sequence[tuple[int, ...]] = (), ops: Sequence[str] = LINEAR
) -> None:
    """Register the elementwise rule for ``funcs``."""
    # a copy passes a Partial on at no cost: the reduction it owes is the same before and after
    partial_cost = 0.0 if ops is IDENTITY else 2.0

    def elementwise(*args: Any, **kwargs: Any) -> OpSharding:
        specs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Spec)]
        numel = math.prod(torch.broadcast_shapes(*(s.shape for s in specs)))
        return pick(
            specs,
            options(specs, partial, ops),
            out_numel=numel,
            partial_cost=partial_cost,
            defer=partial_cost > 0 and gradient_arithmetic(),
        )

    rule(*funcs)(elementwise)


# copies and casts: any placement passes through
pointwise(
    aten.alias,
    aten.detach,
    aten.clone,
    aten._to_copy,
    aten.lift_fresh,
    partial=[(0,)],
    ops=IDENTITY,
)
pointwise(aten.zero, partial=[(0,)], ops=IDENTITY)  # zeros are the sum, mean and max of zeros
# linear in every argument together
pointwise(aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor, partial=[(0, 1)])
pointwise(aten.where.self, partial=[(1, 2)])
# linear in one argument at a time
pointwise(aten.mul.Tensor, partial=[(0,), (1,)])
pointwise(aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg, partial=[(0,)])
# backward ops: linear in the incoming gradient (the first argument)
pointwise(
    aten.threshold_backward,
    aten.gelu_backward,
    aten.silu_backward,
    aten.tanh_backward,
    aten.sigmoid_backward,
    partial=[(0,)],
)
# nonlinear: replicated or split only
pointwise(
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.rsub.Scalar,
    aten.pow,
    aten.exp,
    aten.log,
    aten.log1p,
    aten.expm1,
    aten.sqrt,
    aten.rsqrt,
    aten.reciprocal,
    aten.tanh,
    aten.sigmoid,
    aten.sin,
    aten.cos,
    aten.abs,
    aten.sign,
    aten.sgn,
    aten.erf,
    aten.relu,
    aten.gelu,
    aten.silu,
    aten.clamp,
    aten.clamp_min,
    aten.clamp_max,
    aten.maximum,
    aten.minimum,
    aten.eq,
    aten.ne,
    aten.gt,
    aten.ge,
    aten.lt,
    aten.le,
    aten.isnan,
    aten.isinf,
    aten.logical_and,
    aten.logical_or,
    aten.logical_not,
    aten.masked_fill,
    aten.addcmul,
    aten.addcdiv,
    aten.lerp,
    aten.fill,
)
