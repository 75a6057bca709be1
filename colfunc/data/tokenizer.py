"""The byte-level tokenizer: one token per UTF-8 byte, so the vocabulary is exactly 256.

Any text round-trips, no vocabulary file is needed, and a loss in nats per token is a loss in nats
per byte, comparable across corpora.
"""

from __future__ import annotations

import torch

__all__ = ["VOCAB_SIZE", "decode", "encode"]

VOCAB_SIZE = 256


def encode(text: str) -> torch.Tensor:
    """The UTF-8 bytes of ``text`` as a 1-d int64 tensor.

    Example:
        >>> encode("hé").tolist()
        [104, 195, 169]
    """
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes first")
    data = text.encode("utf-8")
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """The text of a 1-d tensor of byte ids; invalid UTF-8 (e.g. a sample cut mid-character)
    becomes U+FFFD rather than an error."""
    if ids.dim() != 1:
        raise ValueError(f"decode takes a 1-d tensor of byte ids, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= VOCAB_SIZE):
        raise ValueError(
            f"decode: ids must lie in [0, {VOCAB_SIZE}), got range "
            f"[{int(ids.min())}, {int(ids.max())}]; is this a byte-level model?"
        )
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
