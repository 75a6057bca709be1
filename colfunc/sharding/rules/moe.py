"""The experts' feed-forward (``torch.ops.colfunc.moe_ffn`` and its backward) as one op each.

Per mesh axis, one of three layouts:

- replicated: everything whole;
- tokens split (data parallelism): the tokens ``x[N, D]`` and their choices ``topi``/``topw``
  ``[N, K]`` split on N alike, the expert weights whole: each rank runs its own tokens; in the
  backward pass the weights' gradients are then partial sums over the ranks' tokens;
- expert widths split (tensor parallelism, Megatron's MLP per expert): ``w_gate``/``w_up``
  ``[E, D, F]`` on F, ``w_down`` ``[E, F, D]`` on F, the tokens whole: each rank's part of every
  expert, the output a partial sum (and in the backward pass the input and routing-weight
  gradients).
"""

from __future__ import annotations

import torch

import colfunc.ops.moe  # noqa: F401  (registers torch.ops.colfunc.moe_ffn)
from colfunc.sharding.placement import Partial, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

P = Partial()


@rule(torch.ops.colfunc.moe_ffn.default)
def moe_ffn(
    x: Spec, topi: Spec, topw: Spec, wg: Spec, wu: Spec, wd: Spec, capacity: float = 0.0
) -> OpSharding:
    # outputs: y [N, D]; kept for the backward pass the gate and up products [M, F] and the
    # experts' outputs [M, D] (M = N * K rows, sorted by expert); each expert's count of rows
    # (a rank's own tokens' counts: summed over the ranks of a data-parallel split)
    S0, S1 = Shard(0), Shard(1)
    options: list[Option] = [
        ((R, R, R, R, R), (R, R, R, R, R, R)),
        ((S0, S0, S0, S0, P), (S0, S0, S0, R, R, R)),
        ((P, S1, S1, P, R), (R, R, R, Shard(2), Shard(2), Shard(1))),
    ]
    M, F = topi.numel, wg.shape[2]
    sizes = (x.numel, M * F, M * F, M * x.shape[1], wg.shape[0])
    return pick([x, topi, topw, wg, wu, wd], options, out_numel=sizes)


@rule(torch.ops.colfunc.moe_ffn_backward.default)
def moe_ffn_backward(
    dy: Spec, x: Spec, topi: Spec, topw: Spec, wg: Spec, wu: Spec, wd: Spec,
    a: Spec, b: Spec, o: Spec, capacity: float = 0.0,
) -> OpSharding:  # fmt: skip
    S0, S1 = Shard(0), Shard(1)
    options: list[Option] = [
        ((R, R, R, R, R), (R, R, R, R, R, R, R, R, R, R)),
        ((S0, S0, P, P, P), (S0, S0, S0, S0, R, R, R, S0, S0, S0)),
        (
            (P, P, Shard(2), Shard(2), Shard(1)),
            (R, R, R, R, Shard(2), Shard(2), Shard(1), S1, S1, P),
        ),
    ]
    sizes = (x.numel, topw.numel, wg.numel, wu.numel, wd.numel)
    return pick([dy, x, topi, topw, wg, wu, wd, a, b, o], options, out_numel=sizes)
