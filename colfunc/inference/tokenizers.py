"""Text in and out of the engine: colfunc's byte tokenizer, or a model folder's own.

A Hugging Face folder's tokenizer is loaded by ``transformers.AutoTokenizer`` from local files
only, with its chat template when it has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Protocol

from colfunc import data

__all__ = [
    "ByteTokenizer",
    "Detokenized",
    "HFTokenizer",
    "Tokenizer",
    "detokenize",
    "load_hf_tokenizer",
]


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> str: ...


class Detokenized(NamedTuple):
    """Where the incremental decoding of a sequence's tokens stands: the text of its tokens
    up to ``read`` (complete characters), and the token from which the next window is decoded
    (``prefix``: a few tokens of context before ``read``)."""

    text: str = ""
    prefix: int = 0
    read: int = 0


def detokenize(tokenizer: Tokenizer, ids: list[int], at: Detokenized) -> tuple[str, Detokenized]:
    """The text of ``ids`` (equal to ``tokenizer.decode(ids)``), decoding only the tokens past
    ``at`` with a little context (as vLLM and text-generation-inference do): a stream of tokens
    costs each one two short decodes, not a decode of everything so far. A window that ends in
    an incomplete character (U+FFFD) is held until it completes, and returned as it stands."""
    before = tokenizer.decode(ids[at.prefix : at.read])
    window = tokenizer.decode(ids[at.prefix :])
    if len(window) > len(before) and not window.endswith("\ufffd"):
        done = Detokenized(at.text + window[len(before) :], at.read, len(ids))
        return done.text, done
    return at.text + window[len(before) :], at


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255 (colfunc's training runs); no end-of-sequence token."""

    vocab_size = data.VOCAB_SIZE
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in data.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> str:
        """Messages as ``role: content`` lines, ending with ``assistant:`` (no template here;
        tools are given as a system message, see :mod:`colfunc.inference.tools`)."""
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])


class HFTokenizer:
    """A ``transformers`` tokenizer behind the :class:`Tokenizer` protocol."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def renders_tools(self) -> bool:
        """Whether the chat template reads the request's tools."""
        return "tools" in str(getattr(self.tok, "chat_template", None) or "")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> str:
        if getattr(self.tok, "chat_template", None):
            return str(
                self.tok.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True
                )
            )
        return ByteTokenizer.apply_chat_template(ByteTokenizer(), messages)


def load_hf_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """The tokenizer saved in ``folder`` (local files only), or None if it has none."""
    folder = Path(folder)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((folder / n).is_file() for n in names):
        return None
    import transformers

    return HFTokenizer(transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True))
