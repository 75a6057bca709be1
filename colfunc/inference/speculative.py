"""Speculative decoding: drafts verified in one pass, by prompt lookup (here) or by a draft model
(:mod:`colfunc.inference.draft_model`, which shares :func:`draft`, :func:`settle` and
:func:`verify`).

Each step, a decoding sequence proposes up to ``k`` draft tokens by n-gram lookup (Saxena 2023,
vLLM's ``ngram``): its last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) are
searched for in its earlier tokens, prompt and output, and the tokens that followed their latest
earlier occurrence are the drafts (where those run into the sequence's end, the drafts go on
copying themselves: a loop is drafted around as many times as ``k`` allows). The engine computes
the sequence's last token and its drafts in one pass, as a chunk of a prefill, with logits at
every position, and :func:`verify` takes
tokens from them by the rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023) for a
draft that is one token for sure: the target's distribution ``p`` (with the request's
temperature, penalties and top-k/p/min-p) accepts draft ``d`` with probability ``p(d)``; on a
rejection the token is drawn from ``p`` without ``d``, renormalized, and the step ends; when every
draft is accepted, one more token is drawn from the position after the last. Each token then has
the target's distribution exactly, and a greedy request gets the target's argmax at each position:
the tokens decoding one at a time gives. A step thus yields between one and ``k + 1`` tokens for
the price of one pass over the weights (what decoding on a CPU or a small batch costs), and the
keys and values of rejected drafts are dropped by moving the sequence's computed length back.

Speculation is skipped for a sequence with a structured output (its grammar checks one token at a
time) and while a request's other completions wait to share its prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

import torch

from colfunc.inference.sampling import SamplingParams, filtered_probs, next_token, penalised
from colfunc.inference.scheduler import Sequence

__all__ = ["Ngram", "draft", "propose", "rows_of_drafts", "settle", "verify"]


@dataclasses.dataclass(frozen=True)
class Ngram:
    """Prompt-lookup drafting: up to ``tokens`` drafts per step, from the longest n-gram of
    ``ngram_max`` down to ``ngram_min`` tokens that ends the sequence and occurred before."""

    tokens: int
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self) -> None:
        for name in ("tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative decoding: {name} must be an int >= 1, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"speculative decoding: ngram_min={self.ngram_min} is above "
                f"ngram_max={self.ngram_max}"
            )


def propose(tokens: Seq[int], spec: Ngram, limit: int) -> list[int]:
    """``min(spec.tokens, limit)`` drafts for a sequence of ``tokens``: what followed the latest
    earlier occurrence of its longest suffix of ``ngram_max`` to ``ngram_min`` tokens, continued
    past the sequence's end by the drafts so far (a repeating stretch repeats on); none when no
    suffix occurred before."""
    k = min(spec.tokens, limit)
    T = len(tokens)
    if k <= 0 or T < 2:
        return []
    seq = list(tokens)
    for n in range(min(spec.ngram_max, T - 1), spec.ngram_min - 1, -1):
        tail = seq[T - n :]
        for start in range(T - n - 1, -1, -1):  # the latest earlier occurrence
            if seq[start : start + n] == tail:
                # what followed it; past the sequence's end, the drafts themselves (a loop of
                # period T - start - n, continued)
                out: list[int] = []
                for j in range(start + n, start + n + k):
                    out.append(seq[j] if j < T else out[j - T])
                return out
    return []


def draft(seqs: Seq[Sequence], spec: Any, max_seq_len: int) -> dict[Sequence, int]:
    """Each decoding sequence's drafts (not one with a structured output), appended to its
    output for the scheduler to see; how many, per sequence. For a draft model
    (:class:`colfunc.inference.draft_model.DraftModel`), placeholders its drafts replace once
    the step's blocks are allocated."""
    out = {}
    for seq in seqs:
        if seq.num_tokens - seq.computed != 1 or seq.guide is not None:
            continue
        room = min(seq.params.max_tokens - len(seq.output), max_seq_len - seq.num_tokens) - 1
        if isinstance(spec, Ngram):
            got = propose(seq.tokens, spec, room)
        else:
            got = [seq.tokens[-1]] * max(0, min(spec.tokens, room))
        if got:
            seq.output += got
            seq.drafts = out[seq] = len(got)
    return out


def settle(
    items: Seq[tuple[Sequence, int]], drafts: dict[Sequence, int]
) -> dict[Sequence, tuple[int, int]]:
    """The speculating sequences of a step's ``items``: per sequence, its length without its
    drafts and how many drafts its chunk covers. The drafts a chunk does not cover are taken
    back, and all of a sequence's that the step does not reach its last token of."""
    spec = {}
    scheduled = dict(items)
    for seq, k in drafts.items():
        base = seq.num_tokens - k
        end = seq.computed + scheduled.get(seq, 0)  # (the first position the step leaves)
        covered = min(k, end - base) if end >= base else 0
        del seq.output[len(seq.output) - k + covered :]
        seq.drafts = 0
        if seq in scheduled and end >= base:
            spec[seq] = (base, covered)
    return spec


def rows_of_drafts(
    items: Seq[tuple[Sequence, int]], spec: dict[Sequence, tuple[int, int]]
) -> list[int]:
    """The rows, in a step's tokens, of each speculating sequence's last token and drafts."""
    rows: list[int] = []
    at = 0
    for seq, n in items:
        if seq in spec:
            base, _ = spec[seq]
            rows += range(at + base - 1 - seq.computed, at + n)
        at += n
    return rows


def verify(
    logits_JV: torch.Tensor,
    drafts: Seq[int],
    p: SamplingParams,
    prompt: Seq[int],
    output: Seq[int],
    generator: torch.Generator,
    q_JV: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a step yields from the target's logits at the last token and each draft
    (``len(drafts) + 1`` rows): the accepted drafts, then one token of the target's own (see
    the module docstring); ``output`` is the sequence's output before them. ``q``: the
    distributions the drafts were drawn from (a draft model's, one row per draft); None for
    drafts that are one token for sure (prompt lookup, a greedy draft)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        x_V = penalised(logits_JV[j], p, prompt, [*output, *out])
        if p.greedy:
            best = int(x_V.argmax())
            out.append(best)
            if best != d:
                return out
            continue
        probs_V = filtered_probs(x_V, p)
        q = 1.0 if q_JV is None else float(q_JV[j, d])
        if float(torch.rand((), generator=generator)) * q < float(probs_V[d]):
            out.append(d)  # accepted with probability min(1, p(d) / q(d))
            continue
        if q_JV is None:
            rest_V = probs_V.clone()
            rest_V[d] = 0.0  # (p(d) < 1 here: something else has mass)
        else:  # the residual max(0, p - q): where the target has more mass than the draft
            rest_V = (probs_V - q_JV[j].to(probs_V.dtype)).clamp_(min=0)
            if float(rest_V.sum()) <= 0:  # (p = q to rounding: p itself)
                rest_V = probs_V
        out.append(int(torch.multinomial(rest_V / rest_V.sum(), 1, generator=generator)))
        return out
    last = logits_JV[len(drafts)]
    out.append(next_token(last, p, prompt, [*output, *out], generator))
    return out
