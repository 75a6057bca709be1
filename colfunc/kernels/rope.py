"""Rotary position embedding in the rotate-half convention, forward and backward.

Each position's two halves rotate by the angle whose cosine and sine are given:
``y1 = x1 cos - x2 sin``, ``y2 = x2 cos + x1 sin``. A rotation's transpose is the rotation by the
opposite angle, so the backward is the same kernel with the sine negated.

Legend: R rows (all leading dims, B*H, flattened), T positions, D head dim, K = D / 2 frequencies.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks

__all__ = ["rope"]

INTERPRETED = checks.interpreting()  # how the kernel below was decorated (read once, at import)


@triton.jit
def _rope_kernel(
    x_ptr,  # [R, T, D], strides stride_r, stride_t, 1
    cos_ptr, sin_ptr,  # [T, K] each, contiguous
    y_ptr,  # [R, T, D], contiguous
    stride_r, stride_t, T, K,
    INVERSE: tl.constexpr,  # rotate by minus the angle: the backward
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (offs_t[:, None] < T) & (offs_k[None, :] < K)
    x_base = x_ptr + r * stride_r + offs_t[:, None] * stride_t + offs_k[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + K, mask=mask, other=0.0).to(tl.float32)
    offs_tk = offs_t[:, None] * K + offs_k[None, :]
    cos = tl.load(cos_ptr + offs_tk, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + offs_tk, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    y_base = y_ptr + r * T * 2 * K + offs_t[:, None] * 2 * K + offs_k[None, :]
    tl.store(y_base, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_base + K, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    T, D = x.shape[-2:]
    x_RTD = x.reshape(-1, T, D)
    if x_RTD.stride(-1) != 1:
        x_RTD = x_RTD.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    K = D // 2
    block_k = triton.next_power_of_2(K)
    block_t = max(1, min(triton.next_power_of_2(T), (16 if INTERPRETED else 4096) // block_k))
    grid = (x_RTD.shape[0], triton.cdiv(T, block_t))
    _rope_kernel[grid](x_RTD, cos, sin, y, x_RTD.stride(0), x_RTD.stride(1), T, K,
                       INVERSE=inverse, BLOCK_T=block_t, BLOCK_K=block_k)  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, inverse=True), None, None


def rope(x_BHTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with the contract of :func:`colfunc.ops.reference.rope`.

    ``cos`` and ``sin`` get no gradient (they are tables, not parameters); passing ones that
    require it raises ValueError.
    """
    checks.rope(x_BHTD, cos_TK, sin_TK)
    checks.device("rope", x_BHTD, cos_TK, sin_TK, interpreted=INTERPRETED)
    out: torch.Tensor = _Rope.apply(x_BHTD, cos_TK.contiguous(), sin_TK.contiguous())
    return out
