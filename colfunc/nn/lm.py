"""What every causal language model shares: checking its input, its loss, building its params.

Legend: B batch, T sequence, S = T - 1 predicted positions, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import ops

__all__ = ["check_input_ids", "nest", "next_token_loss"]


def check_input_ids(input_ids_BT: Any, max_seq_len: int) -> torch.Tensor:
    """``input_ids`` itself if it is a 2-D LongTensor no longer than ``max_seq_len``, else raise."""
    if not isinstance(input_ids_BT, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor [B, T], got {type(input_ids_BT)}")
    if input_ids_BT.dtype != torch.long:
        raise ValueError(
            f"input_ids must have dtype torch.long, got {input_ids_BT.dtype}; use .long()"
        )
    if input_ids_BT.dim() != 2:
        raise ValueError(
            f"input_ids must be 2-D [B, T], got shape {tuple(input_ids_BT.shape)}; "
            "add a batch dim with [None]"
        )
    T = input_ids_BT.shape[1]
    if not 1 <= T <= max_seq_len:
        raise ValueError(
            f"input_ids has sequence length {T}; the model takes 1 to max_seq_len={max_seq_len} "
            "tokens"
        )
    return input_ids_BT


def next_token_loss(logits_BSV: torch.Tensor, labels_BT: Any) -> torch.Tensor:
    """Mean cross-entropy of the logits at positions ``0..T-2`` against ``labels[:, 1:]``.

    Labels are aligned with the inputs and shifted here (the Hugging Face convention); ``-100``
    marks a label to ignore. The caller drops the last position before the head, since it has no
    next token inside the sequence and its logits would be computed only to be thrown away.
    """
    if not isinstance(labels_BT, torch.Tensor) or labels_BT.dtype != torch.long:
        raise ValueError(
            f"labels must be a torch.LongTensor [B, T], got {getattr(labels_BT, 'dtype', labels_BT)}"
        )
    B, S, V = logits_BSV.shape
    if tuple(labels_BT.shape) != (B, S + 1):
        raise ValueError(
            f"labels must have the shape of input_ids {(B, S + 1)}, got {tuple(labels_BT.shape)}"
        )
    return ops.cross_entropy(logits_BSV.reshape(B * S, V), labels_BT[:, 1:].reshape(B * S))


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x, "a.c": y} -> {"a": {"b": x, "c": y}}``: a params tree from dotted paths."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out
