"""Matrix products: mm, addmm, bmm, baddbmm (``matmul`` and ``linear`` decompose into these).

For ``a[m, k] @ b[k, n]`` on one mesh axis: split ``m`` (rows of a), split ``n`` (columns of b),
or split ``k`` in both and leave a Partial sum (Megatron's row-parallel layer); a Partial factor
times a replicated one stays Partial.
"""

from __future__ import annotations

import torch

from colfunc.sharding.placement import Partial, Placement, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten
S = Shard


def _product_options(batch: int) -> list[Option]:
    """Options for ``a[*batch, m, k] @ b[*batch, k, n]`` (``batch`` leading dims, 0 or 1)."""
    m, k, n = batch, batch + 1, batch + 1
    opts: list[Option] = [
        (R, (R, R)),
        (S(m), (S(m), R)),
        (S(n), (R, S(n))),
        (Partial(), (S(k), S(batch))),
    ]
    if batch:
        opts.append((S(0), (S(0), S(0))))
    for op in ("sum", "avg"):
        opts += [(Partial(op), (Partial(op), R)), (Partial(op), (R, Partial(op)))]
    return opts


def _bias_options(bias: Spec, opts: list[Option], out_ndim: int) -> list[Option]:
    """Extend product options with the added ``bias`` (broadcast to the output)."""
    out: list[Option] = []
    for o, ins in opts:
        b: Placement = o if isinstance(o, Partial) else R
        if isinstance(o, Shard):
            d = o.dim - (out_ndim - bias.ndim)
            b = S(d) if d >= 0 and bias.shape[d] > 1 else R
        out.append((o, (b, *ins)))
    return out


@rule(aten.mm)
def mm(a: Spec, b: Spec) -> OpSharding:
    return pick([a, b], _product_options(0), out_numel=a.shape[0] * b.shape[1])


@rule(aten.bmm)
def bmm(a: Spec, b: Spec) -> OpSharding:
    return pick([a, b], _product_options(1), out_numel=a.shape[0] * a.shape[1] * b.shape[2])


@rule(aten.addmm)
def addmm(bias: Spec, a: Spec, b: Spec, *, beta: float = 1, alpha: float = 1) -> OpSharding:
    return pick(
        [bias, a, b], _bias_options(bias, _product_options(0), 2), out_numel=a.shape[0] * b.shape[1]
    )


@rule(aten.baddbmm)
def baddbmm(bias: Spec, a: Spec, b: Spec, *, beta: float = 1, alpha: float = 1) -> OpSharding:
    return pick(
        [bias, a, b],
        _bias_options(bias, _product_options(1), 3),
        out_numel=a.shape[0] * a.shape[1] * b.shape[2],
    )
