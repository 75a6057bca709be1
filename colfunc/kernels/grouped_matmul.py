"""Grouped matmul (a mixture of experts' rows, sorted by expert, times each expert's weight) in
one launch: the rows of each expert are cut into tiles of ``BM``, every tile of every expert is
one row of the grid (its expert and row range read from a small table made on the host), and
each program computes a ``BM x BN`` tile of the output by a ``tl.dot`` loop over the input dim.
The backward pass is the same kernel on the transposed weights for the rows' gradient, and one
matmul per expert for the weights' gradient.

Legend: N rows, I input dim, O output dim, E experts.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks

__all__ = ["grouped_matmul"]

INTERPRETED = checks.interpreting()  # how the kernel below was decorated (read once, at import)
BM, BN, BK = 16, 32, 32


@triton.jit
def _grouped_kernel(
    x_ptr,  # [N, I]
    w_ptr,  # [E, I, O]
    out_ptr,  # [N, O]
    tile_expert_ptr,  # [T] int32: each row tile's expert
    tile_start_ptr,  # [T] int32: its first row
    tile_end_ptr,  # [T] int32: one past its expert's last row
    n_in, n_out,
    sxn, sxi, swe, swi, swo, son, soo,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    rows = start + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < end
    col_ok = cols < n_out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, n_in, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < n_in
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * sxn + ks[None, :] * sxi,
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        w = tl.load(
            w_ptr + e * swe + ks[:, None] * swi + cols[None, :] * swo,
            mask=k_ok[:, None] & col_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * son + cols[None, :] * soo,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _tiles(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each row tile's expert, first row and its expert's end."""
    expert, start, end = [], [], []
    at = 0
    for e, n in enumerate(sizes):
        for s in range(at, at + n, BM):
            expert.append(e)
            start.append(s)
            end.append(at + n)
        at += n
    make = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return make(expert), make(start), make(end)


def _forward(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    expert, start, end = _tiles(sizes, x.device)
    if expert.numel() and out.shape[1]:
        grid = (expert.numel(), triton.cdiv(w.shape[2], BN))
        _grouped_kernel[grid](
            x, w, out, expert, start, end, x.shape[1], w.shape[2],
            *x.stride(), *w.stride(), *out.stride(), BM=BM, BN=BN, BK=BK,
        )  # fmt: skip
    elif out.numel():  # (an input dim of 0: the products are zero)
        out.zero_()
    return out


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.sizes = sizes
        return _forward(x, w, sizes)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        dx = _forward(dy.contiguous(), w.transpose(1, 2), ctx.sizes)
        dw = torch.zeros_like(w)
        for e, (xe, de) in enumerate(zip(x.split(ctx.sizes), dy.split(ctx.sizes))):
            if ctx.sizes[e]:
                dw[e] = (xe.t().float() @ de.float()).to(w.dtype)
        return dx, dw, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """:func:`colfunc.ops.grouped_matmul` in one launch (fp32 accumulation), differentiable."""
    checks.grouped_matmul(x, w, sizes)
    out: torch.Tensor = _Grouped.apply(x, w, sizes)
    return out
