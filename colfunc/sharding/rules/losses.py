"""The negative log-likelihood loss (``cross_entropy`` is log_softmax then this), and its backward.

``nll_loss_forward(logp[N, C], target[N], weight, reduction, ignore_index)`` returns the loss and
the total weight (the count of targets not ignored). Splits:

- classes (the vocabulary, after a vocab-parallel head): each rank picks the log-probabilities
  of the targets in its class range (targets elsewhere are treated as ignored locally), giving a
  Partial sum; the mean divides by the global count, known from the replicated targets.
- rows, with the targets split alike: per-row losses stay split; a sum or mean is a Partial sum,
  the mean divided by the global count (one all_reduce of the local counts).
- a Partial ``logp`` passes through (the loss is linear in it).

Only unweighted losses split; a class ``weight`` makes everything replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding import comm
from colfunc.sharding.placement import Partial, Placement, Placements, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2


def _masked_target(t: torch.Tensor, offset: int, size: int, ignore_index: int) -> torch.Tensor:
    outside = (t < offset) | (t >= offset + size) | (t == ignore_index)
    return torch.where(outside, torch.full_like(t, ignore_index), t - offset)


@rule(aten.nll_loss_forward)
def nll_loss_forward(
    x: Spec, target: Spec, weight: Any, reduction: int, ignore_index: int
) -> OpSharding:
    C = x.ndim - 1
    reduced = Partial("sum") if reduction != NONE else Shard(0)
    opts: list[Option] = [((R, R), [R, R])]
    if weight is None:
        opts.append(((Partial("sum"), R), [Shard(C), R]))
        if x.ndim == 2:
            opts.append(((reduced, R), [Shard(0), Shard(0)]))
        opts += [((Partial(op), R), [Partial(op), R]) for op in ("sum", "avg")]
    specs = [x, target] + ([weight] if isinstance(weight, Spec) else [])
    n = target.numel if reduction == NONE else 1
    choice = pick(specs, [(o, [*i, R][: len(specs)]) for o, i in opts], out_numel=(n, 1))
    assert choice.inputs is not None
    xp, tp = choice.inputs[0], choice.inputs[1]
    assert xp is not None and tp is not None
    class_axes, row_axes = x.axes_on(C, xp), target.axes_on(0, tp) if target.ndim else ()
    if not class_axes and not (row_axes and reduction != NONE):
        return choice
    offset, size = x.shard_range(C, xp)
    mesh = x.mesh

    def compute(
        logp: torch.Tensor, t: torch.Tensor, w: Any, red: int, ignore: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local_t = _masked_target(t, offset, size, ignore) if class_axes else t
        out, total = aten.nll_loss_forward(logp, local_t, None, SUM if red == MEAN else red, ignore)
        if red == NONE:
            return out, total
        total = (t != ignore).sum().to(logp.dtype)  # the global count, not the local one
        if row_axes:
            total = comm.all_reduce(total, row_axes, "sum", mesh)
        return (out / total if red == MEAN else out), total

    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)


@rule(aten.nll_loss_backward)
def nll_loss_backward(
    grad: Spec,
    x: Spec,
    target: Spec,
    weight: Any,
    reduction: int,
    ignore_index: int,
    total_weight: Spec,
) -> OpSharding:
    C = x.ndim - 1
    g_rows: Placement = Shard(0) if reduction == NONE else R
    opts: list[Option] = [(R, [R, R, R, R])]
    if weight is None:
        opts.append((Shard(C), [R, Shard(C), R, R]))
        if x.ndim == 2:
            opts.append((Shard(0), [g_rows, Shard(0), Shard(0), R]))
        opts += [(Partial(op), [Partial(op), R, R, R]) for op in ("sum", "avg")]
    specs = [grad, x, target] + ([weight] if isinstance(weight, Spec) else []) + [total_weight]
    choice = pick(
        specs,
        [(o, [*i[:3], R, i[3]] if len(specs) == 5 else i) for o, i in opts],
        out_numel=x.numel,
    )
    assert choice.inputs is not None and choice.inputs[1] is not None
    xp: Placements = choice.inputs[1]
    if not x.axes_on(C, xp):
        return choice
    offset, size = x.shard_range(C, xp)

    def compute(
        g: torch.Tensor,
        logp: torch.Tensor,
        t: torch.Tensor,
        w: Any,
        red: int,
        ignore: int,
        tw: torch.Tensor,
    ) -> torch.Tensor:
        local_t = _masked_target(t, offset, size, ignore)
        return aten.nll_loss_backward(g, logp, local_t, w, red, ignore, tw)

    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)
