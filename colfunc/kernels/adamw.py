"""Fused multi-tensor AdamW: one launch updates every parameter of a dtype group, in place.

A model has hundreds of parameter tensors; a launch per tensor (per elementwise op, even) costs
more than the arithmetic. As in apex's ``multi_tensor_apply``, the host writes a table of the
tensors' addresses and a list of fixed-size chunks (tensor, offset); each program loads its chunk's
addresses and updates it, reading each of param, grad and the two moments once and writing param
and moments once. Moments are fp32 whatever the parameter dtype; the arithmetic is fp32 and
follows ``torch.optim.AdamW`` (decoupled decay, bias-corrected moments) operation for operation.

Legend: L tensors in a group, C chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks
from colfunc.ops.values import AdamWHyper

__all__ = ["adamw_"]

INTERPRETED = checks.interpreting()  # how the kernel below was decorated (read once, at import)


@triton.jit
def _adamw_kernel(
    addrs_ptr,  # [4, L] int64: addresses of the params, grads, exp_avgs, exp_avg_sqs
    numels_ptr,  # [L] int64
    chunk_tensor_ptr, chunk_start_ptr,  # [C] int64 each: which tensor a chunk is in, and where
    p_type_ptr, g_type_ptr,  # a param and a grad of the group: they carry the element types
    L, decay, lerp_coeff, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
    LERP_FROM_START: tl.constexpr,  # lerp from m (weight 1 - beta1 < 0.5) or back from the grad
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + chunk)
    start = tl.load(chunk_start_ptr + chunk)
    numel = tl.load(numels_ptr + t)
    p_ptr = tl.load(addrs_ptr + t).to(tl.pointer_type(p_type_ptr.dtype.element_ty))
    g_ptr = tl.load(addrs_ptr + L + t).to(tl.pointer_type(g_type_ptr.dtype.element_ty))
    m_ptr = tl.load(addrs_ptr + 2 * L + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(addrs_ptr + 3 * L + t).to(tl.pointer_type(tl.float32))
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < numel
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        # torch's roundings: lerp_ as one fma from the nearer end, mul_ then addcmul_ (fused),
        # sqrt, div, add_; then decay and addcdiv_ as p + (c * m) / denom.
        if LERP_FROM_START:
            m = tl.fma(lerp_coeff, g - m, m)
        else:
            m = tl.fma(lerp_coeff, g - m, g)
        v = tl.fma(one_minus_beta2 * g, g, v * beta2)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p * decay + tl.div_rn(neg_step_size * m, denom)
        tl.store(p_ptr + idx, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)


def _chunks(numels: list[int], chunk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per chunk: the tensor it belongs to and its first element."""
    counts = torch.tensor([triton.cdiv(n, chunk) for n in numels], dtype=torch.int64)
    tensor_C = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    start_C = (torch.arange(len(tensor_C)) - first_chunk[tensor_C]) * chunk
    return tensor_C.to(device), start_C.to(device)


def adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
) -> None:
    """One AdamW update in place, with the contract of :func:`colfunc.ops.reference.adamw_`.

    fp32, bf16 or fp16 params and grads, fp32 moments, all contiguous on one device; one launch
    per (param dtype, grad dtype) group.
    """
    checks.adamw(params, grads, exp_avgs, exp_avg_sqs, hyper)
    if not params:
        return
    step, lr, beta1, beta2 = hyper.step, hyper.lr, hyper.beta1, hyper.beta2
    checks.device("adamw_", *params, *grads, *exp_avgs, *exp_avg_sqs, interpreted=INTERPRETED)
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel():
            groups.setdefault((p.dtype, g.dtype), []).append(i)
    block = 64 if INTERPRETED else 1024
    chunk = block if INTERPRETED else 64 * block
    lerp_weight = 1.0 - beta1
    # torch computes weight - 1 in fp32: from the weight rounded to fp32 (the difference is exact)
    lerp_back = float(torch.tensor(lerp_weight, dtype=torch.float32)) - 1.0
    scalars = (
        1.0 - lr * hyper.weight_decay,
        lerp_weight if lerp_weight < 0.5 else lerp_back,
        beta2,
        1.0 - beta2,
        hyper.eps,
        -lr / (1.0 - beta1**step),
        (1.0 - beta2**step) ** 0.5,
    )
    device = params[0].device
    for members in groups.values():
        lists = (params, grads, exp_avgs, exp_avg_sqs)
        addrs = torch.tensor(
            [[ts[i].data_ptr() for i in members] for ts in lists], dtype=torch.int64
        )
        numels = [params[i].numel() for i in members]
        tensor_C, start_C = _chunks(numels, chunk, device)
        numels_L = torch.tensor(numels, dtype=torch.int64).to(device)
        first = members[0]
        _adamw_kernel[(len(tensor_C),)](addrs.to(device), numels_L, tensor_C, start_C,
                                        params[first], grads[first], len(members), *scalars,
                                        LERP_FROM_START=lerp_weight < 0.5, CHUNK=chunk,
                                        BLOCK=block)  # fmt: skip
