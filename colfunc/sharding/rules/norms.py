"""Layer norm and its backward. (RMS norm, as ``colfunc.ops.rms_norm`` writes it, decomposes into
pow, mean, rsqrt and mul, which their own rules cover.)

The normalised (trailing) dims must be whole on every rank; the leading (batch) dims pass their
splits through, to the output and to the saved mean and rstd. A Partial input is reduced first.
In the backward the weight and bias gradients sum over the batch dims, so split batch dims leave
them Partial; a Partial incoming gradient is all-reduced here, as Megatron's tensor-parallel
layers do before a norm, which keeps the norm parameters' gradients replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.placement import Partial, Placement, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten


def _spec_list(*xs: Any) -> list[Spec]:
    return [x for x in xs if isinstance(x, Spec)]


@rule(aten.native_layer_norm)
def native_layer_norm(
    x: Spec, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float
) -> OpSharding:
    batch = x.ndim - len(normalized_shape)
    params = _spec_list(weight, bias)
    opts: list[Option] = [((R, R, R), [R] * (1 + len(params)))]
    opts += [((Shard(d),) * 3, [Shard(d)] + [R] * len(params)) for d in range(batch)]
    return pick([x, *params], opts)


@rule(aten.native_layer_norm_backward)
def native_layer_norm_backward(
    grad: Spec,
    x: Spec,
    normalized_shape: Sequence[int],
    mean: Spec,
    rstd: Spec,
    weight: Any,
    bias: Any,
    output_mask: Sequence[bool],
) -> OpSharding:
    batch = x.ndim - len(normalized_shape)
    params = _spec_list(weight, bias)
    opts: list[Option] = [((R, R, R), [R] * (4 + len(params)))]
    summed: Placement = Partial("sum")
    opts += [((Shard(d), summed, summed), [Shard(d)] * 4 + [R] * len(params)) for d in range(batch)]
    n = math.prod(normalized_shape)
    return pick([grad, x, mean, rstd, *params], opts, out_numel=(x.numel, n, n))
