"""Linear maps and embedding tables.

Legend: B batch, T sequence, I input features, O output features, V vocabulary, D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colfunc.core import linear_frames, sequence_split
from colfunc.nn.lowrank import LowRank, LowRanks
from colfunc.ops import cpu_rows
from colfunc.ops.dispatch import kernels_choice

__all__ = ["embedding", "linear", "unembed"]


def linear(
    x_BTI: torch.Tensor, w_IO: torch.Tensor, b_O: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w + b`` with ``w`` stored ``[in, out]``.

    ``F.linear`` on the transposed view lowers to a single ``addmm`` on the contiguous ``w``, so the
    bias add is fused and no copy of ``w`` is made.

    Under long-context sequence parallelism (:func:`colfunc.core.sequence_split`), a ShardedTensor
    with batch and sequence dims goes to a ``bmm`` against ``w`` expanded over the batch instead:
    ``F.linear`` folds ``[B, T]`` into one dim first, which a split of ``T`` cannot follow, while
    ``bmm`` keeps ``T`` as its row dim, so each rank multiplies only its own positions.

    Under 2D, 2.5D and 3D tensor parallelism a :class:`~colfunc.core.LinearInterceptor` frame
    runs the mode's matmul (SUMMA's broadcasts, 3D's gathers) on the weights laid out for it.

    A few rows (at most :data:`colfunc.ops.cpu_rows.MAX_ROWS`: a decoding step's tokens) of
    plain fp32 CPU tensors whose gradient is not wanted go to a compiled kernel that reads ``w``
    once where it lies (:func:`colfunc.ops.cpu_rows.linear`), under ``COLFUNC_KERNELS=auto``.

    A :class:`~colfunc.nn.LowRank` weight (a LoRA adapter beside a frozen weight) adds its
    low-rank term: ``x @ w + (x @ a) @ b * scale``.
    """
    if type(w_IO) is not torch.Tensor:
        if type(w_IO) is LowRank or type(w_IO) is LowRanks:
            return w_IO.linear(x_BTI, b_O, linear)
        for frame in linear_frames():
            out = frame.linear(x_BTI, w_IO, b_O)
            if out is not None:
                return out
    if type(x_BTI) is not torch.Tensor and x_BTI.dim() == 3 and sequence_split():
        B = x_BTI.shape[0]
        y = torch.bmm(x_BTI, w_IO.expand(B, *w_IO.shape))
        return y if b_O is None else y + b_O
    if kernels_choice() == "auto" and (fast := cpu_rows.linear(x_BTI, w_IO, b_O)) is not None:
        return fast  # (a few rows without a gradient on the CPU: the weight streamed once)
    return F.linear(x_BTI, w_IO.t(), b_O)


def embedding(ids_BT: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` picked by ``ids``: ``[B, T] -> [B, T, D]``."""
    return F.embedding(ids_BT, table_VD)


def unembed(x_BTD: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
    """Logits against a tied embedding table: ``x @ table.T``, ``[B, T, D] -> [B, T, V]``
    (a ``bmm`` on a ShardedTensor, as in :func:`linear`)."""
    return linear(x_BTD, table_VD.t())
