"""Sampling parameters, checked, and the choice of each sequence's next token.

Semantics follow vLLM's ``SamplingParams`` (and through it the OpenAI API): penalties first
(``repetition_penalty`` over prompt and output as in ``transformers``, ``presence_penalty`` and
``frequency_penalty`` over the output as in OpenAI's), then temperature, then top-k, top-p and
min-p filtering; ``temperature=0`` is greedy (the argmax of the penalised logits). Each sequence
draws from its own generator, seeded by the request's ``seed``, so its tokens do not depend on what
else is in the batch. Reported logprobs are those of the model's own distribution (the raw logits'
log-softmax), as vLLM reports them.

Legend: V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from colfunc.inference.grammar import Structure

__all__ = ["SamplingParams", "filtered_probs", "next_token", "penalised"]


def _number(name: str, value: object, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"SamplingParams: {name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"SamplingParams: {name} must be in [{low}, {high}], got {value!r}")


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams: {name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"SamplingParams: {name} must be >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request: its length, its distribution and when to stop.

    ``n`` completions share the prompt's KV cache blocks (copied on write). ``top_k=0`` and
    ``top_p=1`` keep every token; ``min_p`` drops tokens below that fraction of the most likely
    one's probability. ``stop`` strings end a completion and are cut from its text;
    ``stop_token_ids`` (and the model's end-of-sequence token unless ``ignore_eos``) end it and
    stay in its token ids. ``logit_bias`` (token id -> a number in [-100, 100], a dict or pairs)
    is added to those tokens' logits before sampling, as OpenAI's. ``structure``
    (:class:`~colfunc.inference.grammar.Structure`: a JSON schema, any JSON object, a regex or a
    choice) confines each completion to it, the other tokens masked before sampling. ``logprobs=N`` reports each sampled token's logprob and the ``N`` most
    likely tokens'; ``prompt_logprobs=N`` the same for every prompt token after the first (the
    whole prompt is then computed, none of it taken from the prefix cache). ``max_tokens=0``
    generates nothing (with ``prompt_logprobs``: the prompt is scored). ``lora`` names the
    adapter (``Engine.add_lora``) the request runs with; None: the base model.

    Example:
        >>> SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=1)
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structure: Structure | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        _int("n", self.n, 1)
        _int("max_tokens", self.max_tokens, 0)
        _number("temperature", self.temperature, 0.0)
        _int("top_k", self.top_k, 0)
        _number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ValueError("SamplingParams: top_p must be in (0, 1], got 0")
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0)
        if self.repetition_penalty == 0:
            raise ValueError("SamplingParams: repetition_penalty must be > 0, got 0")
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int("seed", self.seed, 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams: stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids[...]", t, 0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0)
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise TypeError(
                    f"SamplingParams: logit_bias maps token ids to numbers, got {bias!r}"
                )
            _int("logit_bias token id", pair[0], 0)
            _number(f"logit_bias[{pair[0]}]", pair[1], -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if self.structure is not None and not isinstance(self.structure, Structure):
            raise TypeError(
                f"SamplingParams: structure must be a colfunc.inference.grammar.Structure, got "
                f"{self.structure!r}"
            )
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise TypeError(
                f"SamplingParams: lora must be an adapter's name or None, got {self.lora!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalised(
    logits_V: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """The logits with the request's logit bias and repetition, presence and frequency
    penalties applied."""
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=logits_V.device)
        bias = torch.tensor(
            [b for _, b in p.logit_bias], dtype=logits_V.dtype, device=logits_V.device
        )
        logits_V = logits_V.clone().index_add_(0, ids, bias)
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted({*prompt, *output}), device=logits_V.device)
        x = logits_V[seen]
        logits_V = logits_V.clone()
        logits_V[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        ids = torch.tensor(output, device=logits_V.device)
        counts_V = torch.bincount(ids, minlength=logits_V.numel()).to(logits_V.dtype)
        logits_V = logits_V - p.frequency_penalty * counts_V
        logits_V = logits_V - p.presence_penalty * (counts_V > 0).to(logits_V.dtype)
    return logits_V


def filtered_probs(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampled from: softmax of ``logits / temperature`` after top-k, top-p
    and min-p (``temperature > 0``)."""
    x_V = logits_V / p.temperature
    if p.top_k and p.top_k < x_V.numel():
        kth = torch.topk(x_V, p.top_k).values[-1]
        x_V = x_V.masked_fill(x_V < kth, -math.inf)
    probs_V = torch.softmax(x_V, dim=-1)
    if p.top_p < 1.0:
        sorted_V, order_V = torch.sort(probs_V, descending=True)
        before_V = torch.cumsum(sorted_V, dim=-1) - sorted_V  # mass strictly above each token
        drop_V = before_V >= p.top_p  # the smallest set whose mass reaches top_p is kept
        probs_V = probs_V.clone()
        probs_V[order_V[drop_V]] = 0.0
    if p.min_p > 0.0:
        probs_V = probs_V.masked_fill(probs_V < p.min_p * probs_V.max(), 0.0)
    return probs_V / probs_V.sum()


def next_token(
    logits_V: torch.Tensor,
    p: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    generator: torch.Generator,
) -> int:
    """The next token of a sequence with ``prompt`` and ``output`` so far, from the model's
    ``logits`` for it, drawn with the sequence's own ``generator``."""
    x_V = penalised(logits_V, p, prompt, output)
    if p.greedy:
        return int(x_V.argmax())
    probs_V = filtered_probs(x_V, p)
    return int(torch.multinomial(probs_V, 1, generator=generator))
