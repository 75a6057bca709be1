"""What every causal language model shares: checking its input, its loss, building its params.

Legend: B batch, T sequence, S = T - 1 predicted positions, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import ops

__all__ = ["batch_field", "check_input_ids", "nest", "next_token_loss"]


def batch_field(batch: Any, name: str) -> Any:
    """``batch[name]``, or a ValueError naming the field, the keys there are and the form."""
    if isinstance(batch, dict) and name in batch:
        return batch[name]
    keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise ValueError(
        f"the batch has no {name!r} (it has {keys}); a language model's batch is "
        "{'input_ids': LongTensor [B, T], 'labels': LongTensor [B, T]} (labels = input_ids for "
        "next-token prediction, -100 where no loss is wanted)"
    )


def _check_range(name: str, ids: torch.Tensor, vocab_size: int, ignore: int | None) -> None:
    """Token ids within ``[0, vocab_size)`` (or ``ignore``). Checked on plain CPU tensors only: on
    an accelerator the check would wait for the device every step."""
    if type(ids) is not torch.Tensor or ids.device.type != "cpu" or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore is not None:
        bad &= ids != ignore
    if bool(bad.any()):
        value = int(ids[bad][0])
        allowed = f"[0, {vocab_size})" + (f" or {ignore}" if ignore is not None else "")
        raise ValueError(
            f"{name} holds the token id {value}, outside the vocabulary: ids must be in "
            f"{allowed} (model vocab_size={vocab_size}); check the tokenizer against the model"
        )


def check_input_ids(
    input_ids_BT: Any, max_seq_len: int, vocab_size: int | None = None
) -> torch.Tensor:
    """``input_ids`` itself if it is a 2-D LongTensor no longer than ``max_seq_len`` (with ids
    in ``[0, vocab_size)`` when given), else raise."""
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
    if vocab_size is not None:
        _check_range("input_ids", input_ids_BT, vocab_size, None)
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
    _check_range("labels", labels_BT, V, -100)
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
