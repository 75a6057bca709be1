"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes the
tokens the engine's model verifies (Leviathan et al. 2023; Chen et al. 2023; vLLM's
``--speculative-model``).

The draft model keeps its keys and values in a paged cache of its own, laid out by the engine's
block tables: a draft block ``b`` holds the draft's keys and values for the tokens that the
engine's block ``b`` holds, so the draft needs no allocator, shares what prefix caching shares
and is copied on write with the engine's blocks. Each step, the scheduler is given ``k``
placeholders after each decoding sequence (:func:`colfunc.inference.speculative.draft`); once
their blocks are allocated, :meth:`Drafter.propose` runs the draft over the tokens it has not
seen (the whole prompt the first time; after that the last accepted token or two) and then
``k - 1`` times over one token, writing the drafts over the placeholders. A greedy request
drafts the draft's argmax; a sampled one draws each draft from the draft's distribution ``q``
under the request's temperature, penalties and top-k/p/min-p, and
:func:`colfunc.inference.speculative.verify` accepts draft ``d`` with probability
``min(1, p(d) / q(d))`` and on a rejection draws from ``max(0, p - q)``, renormalized: the
target's distribution ``p`` exactly, whatever the draft.

The draft's cache entries past a sequence's accepted tokens are simply overwritten later
(:attr:`Sequence.draft_computed` moves back). A draft model with a sliding window or two
regimes of positions (LongRoPE), or an engine model with them, is refused: their blocks are
given back or recomputed in ways the draft would have to follow.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from colfunc import models
from colfunc.inference.kv_cache import paged_batch, store
from colfunc.inference.sampling import filtered_probs, penalised
from colfunc.inference.scheduler import Sequence

__all__ = ["DraftModel", "Drafter"]


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
    """Speculative decoding by a draft model: up to ``tokens`` drafts a step from ``model``
    (a family module with ``paged_forward``) with ``cfg`` and ``params``, whose vocabulary must
    be the engine's (the token ids of one tokenizer; a vocabulary padded to another size is
    fine). ``colfunc serve --speculative-model FOLDER`` reads one from a Hugging Face folder
    (:func:`colfunc.engines.speculative`)."""

    model: Any
    cfg: Any
    params: Any
    tokens: int

    def __post_init__(self) -> None:
        value = self.tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"speculative decoding: tokens must be an int >= 1, got {value!r}")
        if not callable(getattr(self.model, "paged_forward", None)):
            raise TypeError(
                f"DraftModel: {self.model!r} has no paged_forward; the draft must be the module "
                "of a causal language model family"
            )


def _check_layout(what: str, spec: Any) -> None:
    if spec.window is not None or spec.regime is not None:
        kind = "a sliding window" if spec.window is not None else "two regimes of positions"
        raise ValueError(
            f"speculative decoding with a draft model: {what} has {kind}, which a draft model "
            "does not follow; use prompt lookup (Ngram) for it, or a model without"
        )


class Drafter:
    """A :class:`DraftModel` at work beside an engine whose model has the KV cache layout
    ``target_kv`` and ``context`` tokens, with ``num_blocks`` blocks of ``block_size`` slots and
    ``vocab`` token ids."""

    def __init__(
        self,
        spec: DraftModel,
        target_kv: Any,
        context: int,
        num_blocks: int,
        block_size: int,
        vocab: int,
    ) -> None:
        _check_layout("the engine's model", target_kv)
        family = models.of_config(spec.cfg)
        if family.kv_cache is None:
            raise TypeError(f"DraftModel: the {family.name!r} model family declares no KV cache")
        kv = family.kv_cache(spec.cfg, spec.params)
        _check_layout("the draft model", kv)
        if spec.cfg.max_seq_len < context:
            raise ValueError(
                f"DraftModel: the draft's context ({spec.cfg.max_seq_len} tokens) is shorter "
                f"than the engine model's ({context}); give a draft of at least that context"
            )
        self.spec, self.block_size = spec, block_size
        self.vocab = min(vocab, spec.cfg.vocab_size)  # draftable ids (a padded tail is not)
        self.target_vocab = vocab
        shape = (kv.layers, num_blocks, block_size, kv.kv_heads, kv.head_dim)
        self.cache = {
            "k": torch.zeros(shape, dtype=kv.dtype, device=kv.device),
            "v": torch.zeros(shape, dtype=kv.dtype, device=kv.device),
        }

    def propose(self, spec: dict[Sequence, tuple[int, int]]) -> dict[Sequence, torch.Tensor]:
        """Write each speculating sequence's drafts over its placeholders (``spec``: its length
        without them and how many its chunk covers, as :func:`~colfunc.inference.speculative.settle`
        gives them); the draft's distributions ``q [covered, V]`` of the sampled requests'."""
        feed: dict[Sequence, tuple[int, list[int]]] = {}
        for seq, (base, covered) in spec.items():
            if covered:
                start = min(seq.draft_computed, base - 1)
                feed[seq] = (start, seq.tokens[start:base])
        qs: dict[Sequence, list[torch.Tensor]] = {s: [] for s in feed if not s.params.greedy}
        j = 0
        while feed:
            items = list(feed.items())
            logits_SV = self._forward([(seq, at, toks) for seq, (at, toks) in items])
            feed = {}
            for row, (seq, (at, toks)) in enumerate(items):
                seq.draft_computed = at + len(toks)
                base, covered = spec[seq]
                cut = len(seq.output) - covered  # the first placeholder
                token = self._choose(seq, logits_SV[row], seq.output[: cut + j], qs.get(seq))
                seq.output[cut + j] = token
                if j + 1 < covered:
                    feed[seq] = (base + j, [token])
            j += 1
        return {seq: torch.stack(q) for seq, q in qs.items()}

    def _choose(
        self, seq: Sequence, logits_V: torch.Tensor, output: list[int], qs: list | None
    ) -> int:
        x_V = logits_V[: self.vocab].float()
        if qs is None:  # a greedy request: the draft's argmax (a draft that is one token for sure)
            return int(x_V.argmax())
        p = seq.params
        probs_V = filtered_probs(penalised(x_V, p, seq.prompt, output), p)
        q_V = probs_V.new_zeros(self.target_vocab)
        q_V[: self.vocab] = probs_V
        qs.append(q_V)
        return int(torch.multinomial(probs_V, 1, generator=seq.generator))

    def _forward(self, items: list[tuple[Sequence, int, list[int]]]) -> torch.Tensor:
        """The draft's logits at the last of each sequence's new tokens (``(sequence, first
        position, tokens)``), their keys and values written into the draft's cache."""
        tokens = [t for _, _, toks in items for t in toks]
        rows = list(itertools.accumulate(len(toks) for _, _, toks in items))
        device = self.cache["k"].device
        laid = [(seq.blocks, at, len(toks), at + len(toks)) for seq, at, toks in items]
        batch, slot_N = paged_batch(laid, self.block_size, device)
        d = self.spec
        logits_SV, ys = d.model.paged_forward(
            d.params,
            torch.tensor(tokens, device=device),
            batch,
            self.cache,
            d.cfg,
            torch.tensor(rows, dtype=torch.long, device=device) - 1,
        )
        store(self.cache, slot_N, ys)
        return logits_SV
