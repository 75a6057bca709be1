"""Linear maps and embedding tables.

Legend: B batch, T sequence, I input features, O output features, V vocabulary, D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embedding", "linear", "unembed"]


def linear(
    x_BTI: torch.Tensor, w_IO: torch.Tensor, b_O: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w + b`` with ``w`` stored ``[in, out]``.

    ``F.linear`` on the transposed view lowers to a single ``addmm`` on the contiguous ``w``, so the
    bias add is fused and no copy of ``w`` is made.
    """
    return F.linear(x_BTI, w_IO.t(), b_O)


def embedding(ids_BT: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` picked by ``ids``: ``[B, T] -> [B, T, D]``."""
    return F.embedding(ids_BT, table_VD)


def unembed(x_BTD: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
    """Logits against a tied embedding table: ``x @ table.T``, ``[B, T, D] -> [B, T, V]``."""
    return F.linear(x_BTD, table_VD)
