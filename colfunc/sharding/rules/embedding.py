"""Embedding lookups and their backward, and the masked lookup behind vocabulary parallelism.

A table split on its rows (the vocabulary, Megatron's vocab-parallel embedding) answers only the
ids in its range: each rank looks up its rows, writes zeros for the ids it does not hold, and the
output is the Partial sum of those pieces. A table split on its columns gives an output split on
its last dim; split ids give split outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placements, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

__all__ = ["masked_lookup"]

aten = torch.ops.aten


def masked_lookup(
    table: torch.Tensor, ids: torch.Tensor, dim: int, offset: int, lookup: Any
) -> torch.Tensor:
    """``lookup(table, local_ids)`` for the rows ``[offset, offset + len)`` of ``dim`` that this
    rank holds, zeros at ids outside them (``lookup`` takes dim ``dim`` of the table by id)."""
    size = table.shape[dim]
    outside = (ids < offset) | (ids >= offset + size)
    local_ids = torch.where(outside, torch.zeros_like(ids), ids - offset)
    if size == 0:  # an empty chunk holds no row: look up in a one-row stand-in table
        table = table.new_zeros([1 if d == dim else n for d, n in enumerate(table.shape)])
    out = lookup(table, local_ids)
    keep = (~outside).to(out.dtype)
    return out * keep.view(*ids.shape, *([1] * (out.dim() - ids.dim())))


def _vocab_axes(table: Placements) -> bool:
    return any(p == Shard(0) for p in table)


@rule(aten.embedding)
def embedding(
    weight: Spec,
    indices: Spec,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> OpSharding:
    opts: list[Option] = [
        (R, (R, R)),
        (Shard(indices.ndim), (Shard(1), R)),
        *[(Shard(d), (R, Shard(d))) for d in range(indices.ndim)],
        (Partial("sum"), (Shard(0), R)),
        *[(Partial(op), (Partial(op), R)) for op in ("sum", "avg")],
    ]
    choice = pick([weight, indices], opts, out_numel=indices.numel * weight.shape[1])
    assert choice.inputs is not None
    table = choice.inputs[0]
    assert table is not None
    if not _vocab_axes(table):
        return choice
    offset = weight.shard_range(0, table)[0]

    def compute(w: torch.Tensor, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        return masked_lookup(w, ids, 0, offset, lambda t, i: torch.embedding(t, i))

    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)


@rule(aten.embedding_dense_backward)
def embedding_dense_backward(
    grad: Spec, indices: Spec, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> OpSharding:
    # the gradient of the table: summed over ids, so split ids leave a Partial sum (unless each
    # row's gradient is scaled by its frequency, which a chunk of ids cannot know)
    opts: list[Option] = [(R, (R, R)), (Shard(1), (Shard(grad.ndim - 1), R))]
    if not scale_grad_by_freq:
        opts += [(Partial("sum"), (Shard(d), Shard(d))) for d in range(indices.ndim)]
    opts += [(Partial(op), (Partial(op), R)) for op in ("sum", "avg")]
    return pick([grad, indices], opts, out_numel=num_weights * grad.shape[-1])
