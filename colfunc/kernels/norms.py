"""RMSNorm and LayerNorm over the last dim, forward and backward, weight and bias gradients included.

As in the Triton layer-norm tutorial: one program normalises one row held whole in registers (in
fp32, whatever the input dtype), saving the row's statistics for the backward. The backward runs a
fixed number of programs, each striding over rows and summing its rows' weight and bias gradients
in registers; the host then adds those few partial sums. Per-row atomics would serialise on the
weight gradient.

Legend: N rows (all leading dims flattened), C features.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks

__all__ = ["layer_norm", "rms_norm"]

INTERPRETED = checks.interpreting()  # how the kernels below were decorated (read once, at import)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # [N, C], rows stride_x apart, features contiguous
    w_ptr,  # [C], or None
    y_ptr,  # [N, C], contiguous
    rstd_ptr,  # [N] fp32: 1 / rms of each row, for the backward
    stride_x, C, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
    # Normalised in fp32 and rounded to the input dtype before the weight, as LLaMA does.
    y = (x * rstd).to(x_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * y.to(tl.float32)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr,  # [N, C], rows stride_dy and stride_x apart
    w_ptr, rstd_ptr,  # as in the forward
    dx_ptr,  # [N, C], contiguous
    dw_ptr,  # [programs, C] fp32: this program's share of the weight gradient
    stride_dy, stride_x, N, C,
    HAS_WEIGHT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    for i in range(pid, N, tl.num_programs(0)):
        row = tl.cast(i, tl.int64)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        if HAS_WEIGHT:
            wdy = w * dy
            dw += dy * x_hat
        else:
            wdy = dy
        # d/dx of w * x * rstd(x): the second term is rstd's own dependence on x.
        dx = (wdy - x_hat * (tl.sum(x_hat * wdy, 0) / C)) * rstd
        tl.store(dx_ptr + row * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,  # [N, C], rows stride_x apart, features contiguous
    w_ptr, b_ptr,  # [C] each, or None
    y_ptr,  # [N, C], contiguous
    mean_ptr, rstd_ptr,  # [N] fp32 each: the row statistics, for the backward
    stride_x, C, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / C
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr,  # [N, C], rows stride_dy and stride_x apart
    w_ptr, mean_ptr, rstd_ptr,  # as in the forward
    dx_ptr,  # [N, C], contiguous
    dw_ptr, db_ptr,  # [programs, C] fp32 each: this program's share of the gradients
    stride_dy, stride_x, N, C,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_C], tl.float32)
    for i in range(pid, N, tl.num_programs(0)):
        row = tl.cast(i, tl.int64)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        if HAS_WEIGHT:
            wdy = w * dy
            dw += dy * x_hat
        else:
            wdy = dy
        db += dy
        # The two subtracted terms are the mean's and rstd's dependence on x.
        dx = (wdy - (x_hat * (tl.sum(x_hat * wdy, 0) / C) + tl.sum(wdy, 0) / C)) * rstd
        tl.store(dx_ptr + row * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_ptr + pid * C + cols, db, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [N, C] with contiguous features (a view where the strides allow)."""
    x_NC = x.reshape(-1, x.shape[-1])
    return x_NC if x_NC.stride(-1) == 1 else x_NC.contiguous()


def _block(C: int) -> dict[str, int]:
    """One row per block; warps as the tutorial sizes them."""
    block_c = triton.next_power_of_2(C)
    return {"BLOCK_C": block_c, "num_warps": min(max(block_c // 256, 1), 8)}


def _programs(x_NC: torch.Tensor) -> int:
    """Backward programs: enough to fill the GPU, few enough that their partial sums are cheap."""
    if INTERPRETED or x_NC.device.type != "cuda":
        return min(x_NC.shape[0], 2)
    sms = torch.cuda.get_device_properties(x_NC.device).multi_processor_count
    return min(x_NC.shape[0], 4 * sms)


def _partial(programs: int, like: torch.Tensor | None, C: int, device: torch.device) -> Any:
    if like is None:
        return None
    return torch.empty((programs, C), dtype=torch.float32, device=device)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        x_NC = _rows(x)
        N, C = x_NC.shape
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        _rms_norm_fwd_kernel[(N,)](x_NC, weight, y, rstd, x_NC.stride(0), C, eps,
                                   HAS_WEIGHT=weight is not None, **_block(C))  # fmt: skip
        ctx.save_for_backward(x_NC, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_NC, weight, rstd = ctx.saved_tensors
        N, C = x_NC.shape
        dy_NC = _rows(dy)
        dx = torch.empty(ctx.x_shape, dtype=x_NC.dtype, device=x_NC.device)
        programs = _programs(x_NC)
        dw = _partial(programs, weight, C, x_NC.device)
        _rms_norm_bwd_kernel[(programs,)](
            dy_NC, x_NC, weight, rstd, dx, dw, dy_NC.stride(0), x_NC.stride(0), N, C,
            HAS_WEIGHT=weight is not None, **_block(C),
        )  # fmt: skip
        return dx, None if weight is None else dw.sum(0).to(weight.dtype), None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:  # fmt: skip
        x_NC = _rows(x)
        N, C = x_NC.shape
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        mean = torch.empty(N, dtype=torch.float32, device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        _layer_norm_fwd_kernel[(N,)](
            x_NC, weight, bias, y, mean, rstd, x_NC.stride(0), C, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **_block(C),
        )  # fmt: skip
        ctx.save_for_backward(x_NC, weight, bias, mean, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_NC, weight, bias, mean, rstd = ctx.saved_tensors
        N, C = x_NC.shape
        dy_NC = _rows(dy)
        dx = torch.empty(ctx.x_shape, dtype=x_NC.dtype, device=x_NC.device)
        programs = _programs(x_NC)
        dw = _partial(programs, weight, C, x_NC.device)
        db = _partial(programs, bias, C, x_NC.device)
        _layer_norm_bwd_kernel[(programs,)](
            dy_NC, x_NC, weight, mean, rstd, dx, dw, db, dy_NC.stride(0), x_NC.stride(0), N, C,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **_block(C),
        )  # fmt: skip
        dweight = None if weight is None else dw.sum(0).to(weight.dtype)
        dbias = None if bias is None else db.sum(0).to(bias.dtype)
        return dx, dweight, dbias, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm with the contract of :func:`colfunc.ops.reference.rms_norm` (fp32 statistics)."""
    checks.rms_norm(x, weight)
    checks.device("rms_norm", *(t for t in (x, weight) if t is not None), interpreted=INTERPRETED)
    out: torch.Tensor = _RMSNorm.apply(x, weight, float(eps))
    return out


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm with the contract of :func:`colfunc.ops.reference.layer_norm` (fp32 statistics)."""
    checks.layer_norm(x, weight, bias)
    tensors = (t for t in (x, weight, bias) if t is not None)
    checks.device("layer_norm", *tensors, interpreted=INTERPRETED)
    out: torch.Tensor = _LayerNorm.apply(x, weight, bias, float(eps))
    return out
