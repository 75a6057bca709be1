"""Cross-entropy over a large vocabulary, forward and backward, without an fp32 softmax in memory.

One program per row streams the row's logits in blocks, keeping a running max and sum (the online
log-sum-exp), so the forward reads the logits once and writes one loss and one log-sum-exp per
row. The backward recomputes each probability from the saved log-sum-exp and writes the gradient
directly in the logits' dtype: no [N, V] fp32 buffer ever exists, which for a 128k vocabulary is
most of the memory of a small model's loss.

Legend: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks

__all__ = ["cross_entropy"]

INTERPRETED = checks.interpreting()  # how the kernels below were decorated (read once, at import)


@triton.jit
def _ce_fwd_kernel(
    logits_ptr,  # [N, V], rows stride_row apart, vocabulary contiguous
    labels_ptr,  # [N] int
    loss_ptr,  # [N] fp32: this row's loss, 0 where ignored
    lse_ptr,  # [N] fp32: log-sum-exp of the row, for the backward
    stride_row, V, ignore_index,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    # Every block holds at least one real logit, so m is finite after the first.
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row).to(tl.int64)
    keep = label != ignore_index
    x_label = tl.load(base + label, mask=keep & (label >= 0) & (label < V), other=0.0)
    tl.store(loss_ptr + row, tl.where(keep, lse - x_label.to(tl.float32), 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, labels_ptr, lse_ptr,  # as in the forward
    dlogits_ptr,  # [N, V], contiguous, in the logits' dtype
    grad_ptr,  # [1] fp32: d(loss) / count, the gradient every kept row's loss receives
    stride_row, V, ignore_index,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    grad = tl.where(label != ignore_index, tl.load(grad_ptr), 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        # d(lse - x[label]) / dx = softmax(x) - onehot(label)
        dx = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * grad
        tl.store(dlogits_ptr + row * V + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=cols < V)


def _block(V: int) -> int:
    """Vocabulary block: large enough to stream at full bandwidth on a GPU, small in the
    interpreter, where every element is a numpy operation."""
    return min(triton.next_power_of_2(V), 64 if INTERPRETED else 4096)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor,
                ignore_index: int) -> torch.Tensor:  # fmt: skip
        N, V = logits.shape
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        _ce_fwd_kernel[(N,)](logits, labels, loss, lse, logits.stride(0), V, ignore_index,
                             BLOCK_V=_block(V))  # fmt: skip
        count = (labels != ignore_index).sum().to(torch.float32)
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.ignore_index = ignore_index
        return loss.sum() / count  # 0 / 0 = nan when every label is ignored, as in torch

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, labels, lse, count = ctx.saved_tensors
        N, V = logits.shape
        dlogits = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
        grad = (dloss.to(torch.float32) / count).reshape(1)
        _ce_bwd_kernel[(N,)](logits, labels, lse, dlogits, grad, logits.stride(0), V,
                             ctx.ignore_index, BLOCK_V=_block(V))  # fmt: skip
        return dlogits, None, None


def cross_entropy(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over kept labels, with the contract of
    :func:`colfunc.ops.reference.cross_entropy`: an fp32 scalar, whatever the logits' dtype.

    A label outside ``[0, V)`` that is not ``ignore_index`` is not detected (that would need a
    device sync); it reads as logit 0.
    """
    checks.cross_entropy(logits_NV, labels_N)
    checks.device("cross_entropy", logits_NV, labels_N, interpreted=INTERPRETED)
    logits = logits_NV if logits_NV.stride(1) == 1 else logits_NV.contiguous()
    out: torch.Tensor = _CrossEntropy.apply(logits, labels_N.contiguous(), int(ignore_index))
    return out
