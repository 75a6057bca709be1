"""Logprobs as the OpenAI API and vLLM report them, from the engine's per-token entries
(``{"token", "logprob", "top"}``, see :class:`colfunc.inference.engine.CompletionOutput`).

``dec`` turns token ids into text (the server's tokenizer). An echoed prompt's first token has no
logprob (nothing predicts it): its entry is None, and its id is given beside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "chat_logprobs",
    "completion_logprobs",
    "logprob_block",
    "merged",
    "vllm_prompt_logprobs",
]

Decode = Callable[[list[int]], str]


def logprob_block(
    entries: Sequence[dict[str, Any] | None],
    dec: Decode,
    tokens: Sequence[int] | None = None,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs of ``entries``: each token's text, its logprob (None for a
    first prompt token, whose id ``tokens`` gives), the most likely tokens', and the offset of
    each token's text in the choice's text, from ``offset`` on."""
    ids: list[int] = []
    for i, e in enumerate(entries):
        if e is not None:
            ids.append(int(e["token"]))
        elif tokens is not None:
            ids.append(int(tokens[i]))
        else:
            raise ValueError("logprob_block: an entry without a logprob needs its token id")
    texts = [dec([t]) for t in ids]
    starts, at = [], offset
    for t in texts:
        starts.append(at)
        at += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e["logprob"] for e in entries],
        "top_logprobs": [
            None if e is None else {dec([t]): v for t, v in e["top"].items()} for e in entries
        ],
        "text_offset": starts,
    }


def merged(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two blocks of :func:`logprob_block`, one after the other."""
    return b if a is None else {k: a[k] + b[k] for k in b}


def completion_logprobs(
    out: Any, o: Any, dec: Decode, lead: str, echo: bool = False
) -> dict[str, Any] | None:
    """A completion choice's logprobs: with ``echo`` the prompt's first, then its own tokens'
    (offsets counted in the choice's text, whose first ``len(lead)`` characters precede them);
    None where logprobs were not asked for."""
    if o.logprobs is None:
        return None
    block = None
    if echo and out.prompt_logprobs is not None:
        block = logprob_block(out.prompt_logprobs, dec, out.prompt_token_ids)
    return merged(block, logprob_block(o.logprobs, dec, offset=len(lead)))


def vllm_prompt_logprobs(out: Any, dec: Decode) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each a map of
    token id to its logprob, rank and text (the prompt's own token and the most likely ones)."""
    if out.prompt_logprobs is None:
        return None
    rows: list[Any] = []
    for e in out.prompt_logprobs:
        if e is None:
            rows.append(None)
            continue
        ranked = sorted(e["top"].items(), key=lambda kv: -kv[1])
        row = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": dec([t])}
            for r, (t, v) in enumerate(ranked)
        }
        if str(e["token"]) not in row:
            row[str(e["token"])] = {
                "logprob": e["logprob"],
                "rank": None,
                "decoded_token": dec([e["token"]]),
            }
        rows.append(row)
    return rows


def chat_logprobs(entries: Sequence[dict[str, Any]], dec: Decode) -> dict[str, Any]:
    """The chat API's logprobs: for each token its text, logprob and UTF-8 bytes, and the most
    likely tokens' (``top_logprobs``)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = dec([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **one(int(e["token"]), e["logprob"]),
                "top_logprobs": [one(int(t), v) for t, v in e["top"].items()],
            }
            for e in entries
        ]
    }
