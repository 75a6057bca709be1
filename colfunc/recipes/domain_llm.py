"""A domain LLM in the manner of Colossal-LLaMA: extend the tokenizer, expand the model's
vocabulary, continue pre-training on a bucketed mix of corpora, fine-tune on chat, evaluate.

Each step is a function over plain values (token tensors, a model module, its params), so that
each can be tested alone and the whole recipe (``examples/colossal_llama/``) is a short script:

1. :func:`extend_tokenizer`: a byte-level BPE trained on the new domain's text; its tokens the base
   tokenizer lacks are added to it (``tokenizers`` / ``transformers``, local files only).
2. :func:`expand_vocabulary`: each new token's embedding and output rows are the mean of the rows
   of the old tokens it used to split into, so the expanded model starts where the old one was;
   the old tokens' rows, and so their logits on old text, are unchanged.
3. :class:`BucketedMix`: continual pre-training batches from several corpora. Each corpus is cut
   into ``buckets`` bins in order; bucket ``k`` holds bin ``k`` of every corpus, its windows
   shuffled together by ``(seed, k)``; buckets run in order. The order is a function of the seed.
4. :func:`chat_example` and :func:`pack`: supervised fine-tuning on a chat template, the prompt's
   tokens masked out of the loss (label ``-100``), short examples packed into full rows.
5. :func:`perplexity` per corpus, and :func:`multiple_choice` scored by the logit of each choice's
   first token after the prompt (Colossal-LLaMA's protocol).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BucketedMix",
    "chat_example",
    "expand_vocabulary",
    "extend_tokenizer",
    "multiple_choice",
    "pack",
    "perplexity",
]

IGNORE = -100


def extend_tokenizer(base: Any, texts: Sequence[str], vocab_size: int) -> tuple[Any, list[str]]:
    """``(tokenizer, added)``: a copy of the ``transformers`` fast tokenizer ``base`` with the
    tokens of a byte-level BPE of ``vocab_size`` trained on ``texts`` that ``base`` does not have
    as single tokens, in the order the BPE learned them."""
    import copy

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not texts:
        raise ValueError("extend_tokenizer: texts is empty; give the new domain's text")
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"extend_tokenizer: texts must be strings, got a {type(bad).__name__}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(list(texts), trainer)
    learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    added: list[str] = []
    seen = set()
    for _, i in learned:
        text = bpe.decode([i])
        if len(text) < 2 or text in seen or text.isspace():
            continue
        seen.add(text)
        if len(base.encode(text, add_special_tokens=False)) > 1:  # base splits it
            added.append(text)
    tok = copy.deepcopy(base)
    tok.add_tokens(added)
    return tok, added


def expand_vocabulary(
    module: Any, cfg: Any, params: Any, old_tokenizer: Any, new_tokenizer: Any
) -> tuple[Any, Any]:
    """``(cfg, params)`` with room for ``new_tokenizer``'s ids: each token it has and
    ``old_tokenizer`` lacks gets, in the embedding and (when untied) the output head, the mean
    of the rows of the old tokens its text splits into. Every other row is kept as it is."""
    import dataclasses

    n_old, n_new = len(old_tokenizer), len(new_tokenizer)
    if n_new < n_old:
        raise ValueError(
            f"expand_vocabulary: the new tokenizer has {n_new} tokens, fewer than {n_old}"
        )
    vocab = max(cfg.vocab_size, n_new)
    new_cfg = dataclasses.replace(cfg, vocab_size=vocab)

    def grow(table: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((vocab, *table.shape[1:]), dtype=table.dtype)
        out[: table.shape[0]] = table
        for i in range(n_old, n_new):
            text = new_tokenizer.decode([i])
            old = old_tokenizer.encode(text, add_special_tokens=False)
            if not old:
                raise ValueError(f"expand_vocabulary: token {i} ({text!r}) has no old tokens")
            out[i] = table[torch.tensor(old)].mean(0)
        return out

    new = {**params, "embed": {**params["embed"], "tokens": grow(params["embed"]["tokens"])}}
    if "head" in params:  # an untied output layer, stored [d_model, vocab]
        head = params["head"]
        w = head["weight"]
        new["head"] = {**head, "weight": grow(w.t().contiguous()).t().contiguous()}
    want = module.param_shapes(new_cfg)
    got = {"embed.tokens": tuple(new["embed"]["tokens"].shape)}
    if tuple(want["embed.tokens"]) != got["embed.tokens"]:
        raise ValueError(f"expand_vocabulary: {got} does not fit {type(cfg).__name__}")
    return new_cfg, new


class BucketedMix:
    """Batches of ``[batch_size, seq_len]`` token windows from several corpora (1-d token
    tensors), bucketed: corpus ``c`` is cut into ``buckets`` equal bins in order; bucket ``k``
    holds bin ``k`` of every corpus; its windows are shuffled together by a generator seeded
    with ``(seed, k)``; the buckets run in order. ``buckets_of`` says what each bucket holds."""

    def __init__(
        self,
        corpora: Mapping[str, torch.Tensor],
        *,
        buckets: int,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
    ) -> None:
        if not corpora:
            raise ValueError("BucketedMix: no corpora")
        for name, x in corpora.items():
            if x.dim() != 1 or x.numel() < buckets * seq_len:
                raise ValueError(
                    f"BucketedMix: corpus {name!r} has {x.numel()} tokens, fewer than "
                    f"buckets * seq_len = {buckets * seq_len}"
                )
        self.corpora, self.buckets, self.seq_len = dict(corpora), buckets, seq_len
        self.batch_size, self.seed = batch_size, seed

    def bins(self, name: str) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` token ranges of corpus ``name``'s bins, in order."""
        n = self.corpora[name].numel()
        edges = [n * k // self.buckets for k in range(self.buckets + 1)]
        return list(itertools.pairwise(edges))

    def buckets_of(self) -> list[dict[str, tuple[int, int]]]:
        """Per bucket, the bin of each corpus it holds."""
        return [{c: self.bins(c)[k] for c in self.corpora} for k in range(self.buckets)]

    def windows(self, k: int) -> list[tuple[str, int]]:
        """Bucket ``k``'s windows ``(corpus, start)``, in their shuffled order."""
        out = []
        for c, (lo, hi) in self.buckets_of()[k].items():
            out += [(c, s) for s in range(lo, hi - self.seq_len + 1, self.seq_len)]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rows: list[torch.Tensor] = []
        for k in range(self.buckets):
            for c, s in self.windows(k):
                rows.append(self.corpora[c][s : s + self.seq_len])
                if len(rows) == self.batch_size:
                    ids = torch.stack(rows)
                    yield {"input_ids": ids, "labels": ids}
                    rows = []


def chat_example(
    tokenizer: Any, messages: Sequence[Mapping[str, str]]
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a conversation under the tokenizer's chat template; the
    labels of every token up to the last message (the prompt) are ``-100``, so that only the
    answer is learned."""
    if len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise ValueError("chat_example: give the prompt's messages and then the assistant's answer")
    prompt = tokenizer.apply_chat_template(
        list(messages[:-1]), tokenize=True, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(list(messages), tokenize=True)
    if hasattr(prompt, "input_ids"):  # (a BatchEncoding in newer transformers)
        prompt, full = prompt["input_ids"], full["input_ids"]
    prompt, full = list(prompt), list(full)
    if full[: len(prompt)] != prompt:
        raise ValueError("chat_example: the template does not extend the prompt with the answer")
    return full, [IGNORE] * len(prompt) + full[len(prompt) :]


def pack(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Examples ``(input_ids, labels)`` packed greedily into rows of ``seq_len`` (an example that
    does not fit the rest of a row starts the next; a longer one is cut): the batch
    ``{"input_ids", "labels"}``, padding labelled ``-100``, and each example's first token too
    (it is not predicted from the example before it)."""
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for x, y in examples:
        x, y = list(x)[:seq_len], list(y)[:seq_len]
        if len(ids) + len(x) > seq_len:
            rows.append((ids, labels))
            ids, labels = [], []
        ids += x
        labels += [IGNORE, *y[1:]]
    if ids:
        rows.append((ids, labels))
    out_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    out_labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        out_ids[r, : len(x)] = torch.tensor(x)
        out_labels[r, : len(y)] = torch.tensor(y)
    return {"input_ids": out_ids, "labels": out_labels}


@torch.no_grad()
def perplexity(
    module: Any, cfg: Any, params: Any, tokens: torch.Tensor, seq_len: int, windows: int = 8
) -> float:
    """``exp`` of the mean next-token loss over the first ``windows`` windows of ``tokens``."""
    n = min(windows, tokens.numel() // seq_len)
    if n < 1:
        raise ValueError(f"perplexity: {tokens.numel()} tokens make no window of {seq_len}")
    ids = tokens[: n * seq_len].view(n, seq_len)
    loss = module.loss(cfg)(params, {"input_ids": ids, "labels": ids})
    return math.exp(float(loss))


@torch.no_grad()
def multiple_choice(
    module: Any, cfg: Any, params: Any, tokenizer: Any, items: Sequence[Mapping[str, Any]]
) -> float:
    """The fraction of ``items`` (``{"prompt", "choices", "answer"}``, the answer an index)
    whose answer has the highest logit, among the choices' first tokens, after the prompt."""
    if not items:
        raise ValueError("multiple_choice: no items")
    right = 0
    for item in items:
        prompt = tokenizer.encode(item["prompt"], add_special_tokens=False)[-cfg.max_seq_len :]
        firsts = [tokenizer.encode(c, add_special_tokens=False)[0] for c in item["choices"]]
        if len(set(firsts)) != len(firsts):
            raise ValueError(f"multiple_choice: choices {item['choices']} share a first token")
        logits = module.apply(params, torch.tensor([prompt]), cfg)[0, -1]
        right += int(int(torch.stack([logits[t] for t in firsts]).argmax()) == item["answer"])
    return right / len(items)
