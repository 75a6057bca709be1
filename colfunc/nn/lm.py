"""What every causal language model shares: checking its input, its loss, building its params.

Legend: B batch, T sequence, S = T - 1 predicted positions, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import ops
from colfunc.core import positions, sequence_split

__all__ = [
    "batch_field",
    "causal_lm_loss",
    "check_input_ids",
    "nest",
    "next_token_loss",
    "next_token_targets",
]


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
    low, high = torch.aminmax(ids)  # one pass; the full check only when something is outside
    if int(low) >= 0 and int(high) < vocab_size:
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


def next_token_targets(labels_BT: Any) -> torch.Tensor:
    """Each position's target: the label of the next position, ``-100`` after the last one.

    The positions come from :func:`colfunc.core.positions`, so a sequence stored out of order
    (zigzag ring attention) still gets each position's true successor; split over a sequence
    axis, the labels are gathered first (they are small), so targets are right across shard
    boundaries.
    """
    if not isinstance(labels_BT, torch.Tensor) or labels_BT.dtype != torch.long:
        raise ValueError(
            f"labels must be a torch.LongTensor [B, T], got {getattr(labels_BT, 'dtype', labels_BT)}"
        )
    if labels_BT.dim() != 2:
        raise ValueError(f"labels must be 2-D [B, T], got shape {tuple(labels_BT.shape)}")
    T = labels_BT.shape[1]
    pos_T = positions(T, labels_BT.device)
    where_T = torch.empty_like(pos_T)
    where_T[pos_T] = torch.arange(T, device=pos_T.device)  # the index holding each position
    next_T = where_T[(pos_T + 1).clamp(max=T - 1)]
    targets_BT = labels_BT[:, next_T]
    return torch.where(pos_T == T - 1, torch.full_like(targets_BT, -100), targets_BT)


def causal_lm_loss(head: Any, x_BTD: torch.Tensor, labels_BT: Any) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(hidden)`` against the shifted labels.

    ``head`` maps hidden states ``[..., D]`` to logits ``[..., V]``. Labels are aligned with the
    inputs (the Hugging Face convention); ``-100`` marks a label to ignore. The last position has
    no next token inside the sequence, so it is dropped before the head (:func:`next_token_loss`).

    Under long-context sequence parallelism (:func:`colfunc.core.sequence_split`) the sequence
    is split, so dropping the last position would fall on one rank only: the head then runs on
    every position, laid out sequence-major (rows of ``[T * B, D]``) so that the rows follow the split, against :func:`next_token_targets` (``-100`` after the last position). Each rank
    computes its own positions' logits and loss; only the mean's count is summed across ranks.
    """
    if not sequence_split():
        return next_token_loss(head(x_BTD[:, :-1]), labels_BT)
    targets_BT = next_token_targets(labels_BT)
    B, T = x_BTD.shape[0], x_BTD.shape[1]
    if tuple(targets_BT.shape) != (B, T):
        raise ValueError(
            f"labels must have the shape of input_ids {(B, T)}, got {tuple(labels_BT.shape)}"
        )
    # sequence-major rows: the fold of [T, B] keeps T's split, and the head runs on 2-D rows
    logits_NV = head(x_BTD.transpose(0, 1).reshape(T * B, x_BTD.shape[-1]))
    return ops.cross_entropy(logits_NV, targets_BT.t().reshape(T * B))


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
