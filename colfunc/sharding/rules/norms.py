"""Layer norm and its backward. (RMS norm, as ``colfunc.ops.rms_norm`` writes it, decomposes into
pow, mean, rsqrt and mul, which their own rules cover.)

The leading (batch) dims pass their splits through, to the output and to the saved mean and
rstd. A Partial input is reduced first. A normalised dim (one, the last) may be split too, with
the weight and bias split alike, as 2D, 2.5D and 3D tensor parallelism leave the model's width
(Optimus's ``LayerNorm2D``): each rank then normalises its chunk with the global mean and
variance, two all_reduces of one value per row over the axes that split the width, and the
backward needs two more; the mean and rstd are whole on those axes.
In the backward the weight and bias gradients sum over the batch dims, so split batch dims leave
them Partial; a Partial incoming gradient is all-reduced here, as Megatron's tensor-parallel
layers do before a norm, which keeps the norm parameters' gradients replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding import comm
from colfunc.sharding.mesh import Mesh
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
    last = x.ndim - 1
    if len(normalized_shape) == 1:  # the width split, its parameters alike
        opts.append(((Shard(last), R, R), [Shard(last)] + [Shard(0)] * len(params)))
    choice = pick([x, *params], opts)
    assert choice.inputs is not None
    axes = x.axes_on(last, choice.inputs[0])
    if not axes:
        return choice
    width, mesh = x.shape[last], x.mesh

    def compute(t: torch.Tensor, shape: Any, w: Any, b: Any, eps_: float) -> Any:
        acc = torch.promote_types(t.dtype, torch.float32)
        wide = t.to(acc)
        mean = comm.all_reduce(wide.sum(-1, keepdim=True), axes, "sum", mesh) / width
        centred = wide - mean
        var = comm.all_reduce(centred.square().sum(-1, keepdim=True), axes, "sum", mesh) / width
        rstd = torch.rsqrt(var + eps_)
        y = centred * rstd
        y = y if w is None else y * w
        y = y if b is None else y + b
        stats = _stats_dtype(t)
        return y.to(t.dtype), mean.to(stats), rstd.to(stats)

    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)


def _stats_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``native_layer_norm`` gives its mean and rstd: the input's on the CPU, at least
    fp32 on accelerators."""
    return t.dtype if t.device.type == "cpu" else torch.promote_types(t.dtype, torch.float32)


def _split_backward(
    axes: tuple[str, ...], mesh: Mesh, width: int, batch: int, has_w: bool, has_b: bool
) -> Any:
    def compute(
        g: torch.Tensor,
        t: torch.Tensor,
        shape: Any,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        w: Any,
        b: Any,
        mask: Sequence[bool],
    ) -> tuple[Any, Any, Any]:
        acc = torch.promote_types(t.dtype, torch.float32)
        g_, xhat = g.to(acc), (t.to(acc) - mean.to(acc)) * rstd.to(acc)
        gw = g_ if w is None else g_ * w.to(acc)
        # d/dx of (x - mean) * rstd: rstd * (gw - mean(gw) - xhat * mean(gw * xhat))
        both = torch.cat([gw.sum(-1, keepdim=True), (gw * xhat).sum(-1, keepdim=True)], -1)
        both = comm.all_reduce(both, axes, "sum", mesh) / width
        dx = rstd.to(acc) * (gw - both[..., :1] - xhat * both[..., 1:])
        dims = tuple(range(batch))
        dw = (g_ * xhat).sum(dims).to(w.dtype) if has_w and mask[1] else None
        db = g_.sum(dims).to(b.dtype) if has_b and mask[2] else None
        return dx.to(t.dtype) if mask[0] else None, dw, db

    return compute


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
    last = x.ndim - 1
    if len(normalized_shape) == 1:
        whole: list[Placement] = [R, R]
        split: list[Placement] = [Shard(last), Shard(last), *whole, *[Shard(0)] * len(params)]
        opts.append(((Shard(last), Shard(0), Shard(0)), split))
    n = math.prod(normalized_shape)
    choice = pick([grad, x, mean, rstd, *params], opts, out_numel=(x.numel, n, n))
    assert choice.inputs is not None
    axes = x.axes_on(last, choice.inputs[1])
    if not axes:
        return choice
    compute = _split_backward(
        axes, x.mesh, x.shape[last], batch, isinstance(weight, Spec), isinstance(bias, Spec)
    )
    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)
