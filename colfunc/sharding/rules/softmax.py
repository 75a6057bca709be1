"""Softmax and log-softmax, and their backward, including over a split dim.

Dims other than the softmax dim pass their splits through. When the softmax dim itself is split
(logits split on the vocabulary, as Megatron's vocab-parallel head leaves them), each rank
normalises its chunk with the global maximum and the global sum of exponentials: two small
all_reduces over the axes that split the dim (counted in the ledger), instead of gathering the
logits. The backward needs one all_reduce of a row sum. Partial inputs are reduced first;
the backward is linear in the incoming gradient, so a Partial gradient passes through.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding import comm
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import Partial, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

aten = torch.ops.aten


def _options(n_inputs: int, ndim: int, linear_first: bool) -> list[Option]:
    opts: list[Option] = [(R, [R] * n_inputs)]
    opts += [(Shard(d), [Shard(d)] * n_inputs) for d in range(ndim)]
    if linear_first:
        opts += [(Partial(op), [Partial(op)] + [R] * (n_inputs - 1)) for op in ("sum", "avg")]
    return opts


def _row_max(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.shape[dim] == 0:  # an empty chunk: the identity of max
        shape = [1 if d == dim else n for d, n in enumerate(t.shape)]
        return t.new_full(shape, -torch.inf)
    return t.amax(dim, keepdim=True)


def _normalise(
    t: torch.Tensor, dim: int, axes: tuple[str, ...], mesh: Mesh, log: bool
) -> torch.Tensor:
    m = comm.all_reduce(_row_max(t, dim), axes, "max", mesh)
    z = t - m
    s = comm.all_reduce(z.exp().sum(dim, keepdim=True), axes, "sum", mesh)
    return z - s.log() if log else z.exp() / s


def _forward(log: bool) -> Any:
    def softmax(x: Spec, dim: int, half_to_float: bool) -> OpSharding:
        dim = dim % max(x.ndim, 1)
        choice = pick([x], _options(1, x.ndim, False))
        assert choice.inputs is not None and choice.inputs[0] is not None
        axes = x.axes_on(dim, choice.inputs[0])
        if not axes:
            return choice

        def compute(t: torch.Tensor, *args: Any) -> torch.Tensor:
            return _normalise(t.float() if half_to_float else t, dim, axes, x.mesh, log)

        return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)

    return softmax


rule(aten._softmax)(_forward(log=False))
rule(aten._log_softmax)(_forward(log=True))


def _backward(log: bool) -> Any:
    def softmax_backward(
        grad: Spec, output: Spec, dim: int, input_dtype: torch.dtype
    ) -> OpSharding:
        dim = dim % max(grad.ndim, 1)
        choice = pick([grad, output], _options(2, grad.ndim, True))
        assert choice.inputs is not None and choice.inputs[1] is not None
        axes = grad.axes_on(dim, choice.inputs[1])
        if not axes:
            return choice

        def compute(g: torch.Tensor, y: torch.Tensor, *args: Any) -> torch.Tensor:
            # softmax: y * (g - sum(g * y)); log-softmax: g - exp(y) * sum(g)
            gy = g if log else g * y
            s = comm.all_reduce(gy.sum(dim, keepdim=True), axes, "sum", grad.mesh)
            out = g - y.exp() * s if log else gy - y * s
            return out.to(input_dtype)

        return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)

    return softmax_backward


rule(aten._softmax_backward_data)(_backward(log=False))
rule(aten._log_softmax_backward_data)(_backward(log=True))
