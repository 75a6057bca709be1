"""Seeded batches of random windows, each a pure function of ``(seed, step)``.

Because batch ``i`` depends only on the seed and ``i`` (never on how many batches were drawn
before), a resumed run sees exactly the batches the uninterrupted run would have seen.

Shapes: ``N`` corpus bytes, ``B`` batch size, ``T`` window length.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from colfunc import random

__all__ = ["batch_at", "batches"]


def batch_at(
    tokens_N: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int
) -> dict[str, torch.Tensor]:
    """Batch number ``step``: ``batch_size`` windows of ``seq_len`` tokens at random offsets.

    Returns ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` with labels equal to
    the inputs (the loss shifts them).
    """
    if tokens_N.dim() != 1:
        raise ValueError(f"tokens must be 1-d, got shape {tuple(tokens_N.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    n_starts = tokens_N.numel() - seq_len + 1
    if n_starts < 1:
        raise ValueError(
            f"seq_len={seq_len} is longer than the {tokens_N.numel()} tokens available; "
            f"use a larger corpus or a shorter seq_len"
        )
    g = random.generator(seed, f"batch.{step}")
    starts_B = torch.randint(0, n_starts, (batch_size,), generator=g)
    idx_BT = starts_B[:, None] + torch.arange(seq_len)
    ids_BT = tokens_N[idx_BT].long()
    return {"input_ids": ids_BT, "labels": ids_BT.clone()}


def batches(
    tokens_N: torch.Tensor, batch_size: int, seq_len: int, seed: int, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """The endless stream ``batch_at(..., step)`` for ``step = start, start + 1, ...``.

    Resume a run at step ``s`` with ``start=s``.
    """
    step = start
    while True:
        yield batch_at(tokens_N, batch_size, seq_len, seed, step)
        step += 1
