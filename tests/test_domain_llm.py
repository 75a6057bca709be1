"""The domain-LLM recipe's steps (Colossal-LLaMA's): vocabulary expansion, bucketed mixing, chat
fine-tuning's masks and packing, and the multiple-choice score."""

from __future__ import annotations

import inspect
import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from colfunc import models, testing
from colfunc.recipes import domain_llm as rec

transformers = pytest.importorskip("transformers")

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> object:
    return testing.save_bpe_tokenizer(tmp_path_factory.mktemp("tok"), 300, "</s>", TEMPLATE)


def _docstrings() -> list[str]:
    import collections
    import functools

    docs = [inspect.getdoc(f) for m in (collections, functools) for _, f in inspect.getmembers(m)]
    return [d for d in docs if isinstance(d, str)][:400]


def test_new_rows_are_the_mean_of_their_old_pieces_and_old_logits_stay(base: object) -> None:
    new_tok, added = rec.extend_tokenizer(base, _docstrings(), vocab_size=420)
    assert added and len(new_tok) == len(base) + len(added)
    cfg = models.llama.Config(
        vocab_size=len(base), n_layer=1, n_head=2, n_kv_heads=1, d_model=16, d_ff=32,
        max_seq_len=32, tie_embeddings=False,
    )  # fmt: skip
    params = models.llama.init(cfg, seed=0)
    new_cfg, new = rec.expand_vocabulary(models.llama, cfg, params, base, new_tok)
    assert new_cfg.vocab_size == len(new_tok)
    emb, head = new["embed"]["tokens"], new["head"]["weight"]
    for i in range(len(base), len(new_tok)):
        pieces = torch.tensor(base.encode(new_tok.decode([i]), add_special_tokens=False))
        assert len(pieces) > 1
        torch.testing.assert_close(
            emb[i], params["embed"]["tokens"][pieces].mean(0), rtol=0, atol=0
        )
        old_rows = params["head"]["weight"].t()[pieces]  # the head's rows, one per token
        torch.testing.assert_close(head[:, i], old_rows.mean(0), rtol=0, atol=0)
    assert torch.equal(emb[: len(base)], params["embed"]["tokens"])
    ids = torch.tensor([base.encode("def f(x):\n    return x", add_special_tokens=False)[:32]])
    before = models.llama.apply(params, ids, cfg)
    after = models.llama.apply(new, ids, new_cfg)
    torch.testing.assert_close(after[..., : len(base)], before, rtol=1e-6, atol=1e-6)


def test_every_bucket_holds_one_bin_of_every_corpus_in_a_seeded_order() -> None:
    corpora = {"code": torch.arange(1000), "docs": torch.arange(10_000, 10_700)}
    mix = rec.BucketedMix(corpora, buckets=4, seq_len=10, batch_size=3, seed=1)
    buckets = mix.buckets_of()
    assert len(buckets) == 4
    for name, x in corpora.items():
        bins = [b[name] for b in buckets]
        assert bins[0][0] == 0 and bins[-1][1] == x.numel()
        assert all(
            a[1] == b[0] for a, b in itertools.pairwise(bins)
        )  # in order, no gap, no overlap
    for k, bucket in enumerate(buckets):
        windows = mix.windows(k)
        assert {c for c, _ in windows} == set(corpora)  # one bin of every corpus
        for c, s in windows:
            lo, hi = bucket[c]
            assert lo <= s and s + 10 <= hi
    first = [b["input_ids"].clone() for b in mix]
    assert all(b.shape == (3, 10) for b in first)
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(first, mix))  # deterministic
    other = rec.BucketedMix(corpora, buckets=4, seq_len=10, batch_size=3, seed=2)
    assert not all(torch.equal(a, b["input_ids"]) for a, b in zip(first, other))
    # the buckets run in order: every window of bucket 0 comes before any of bucket 1
    seen = [int(row[0]) for b in first for row in b]
    cut = len(mix.windows(0)) // 3 * 3
    lo1 = {c: buckets[1][c][0] for c in corpora}
    assert all(v < lo1["code"] or 10_000 <= v < 10_000 + lo1["docs"] for v in seen[:cut])


def test_prompt_tokens_contribute_exactly_zero_loss(base: object) -> None:
    talks = [
        [{"role": "user", "content": f"what is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]
        for i in range(6)
    ]  # fmt: skip
    examples = [rec.chat_example(base, t) for t in talks]
    for (ids, labels), talk in zip(examples, talks):
        prompt = base.apply_chat_template(talk[:1], tokenize=True, add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "input_ids") else prompt)
        assert labels[: len(prompt)] == [-100] * len(prompt)
        assert labels[len(prompt) :] == ids[len(prompt) :] and len(ids) > len(prompt)
    batch = rec.pack(examples, seq_len=96, pad_id=0)
    assert batch["input_ids"].shape[1] == 96 and batch["input_ids"].shape[0] < len(examples)
    cfg = models.llama.Config(
        vocab_size=len(base), n_layer=1, n_head=2, d_model=16, d_ff=32, max_seq_len=96
    )
    params = models.llama.init(cfg, seed=0)
    loss = models.llama.loss(cfg)(params, batch)
    logits = models.llama.apply(params, batch["input_ids"], cfg)[:, :-1]
    target = batch["labels"][:, 1:]
    answer = target != -100
    want = F.cross_entropy(logits[answer], target[answer])  # the answers' tokens only
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    n_answer = sum(sum(1 for y in labels if y != -100) for _, labels in examples)
    assert int(answer.sum()) == n_answer  # each answer token counted once, no prompt token


def test_multiple_choice_scores_the_first_token_of_each_choice(base: object) -> None:
    cfg = models.llama.Config(
        vocab_size=len(base), n_layer=1, n_head=2, d_model=16, d_ff=32, max_seq_len=32
    )
    params = models.llama.init(cfg, seed=0)
    items = [
        {"prompt": "def f(x):\n    return", "choices": ["x", "None", "1"], "answer": a}
        for a in range(3)
    ]
    logits = models.llama.apply(params, torch.tensor([base.encode(items[0]["prompt"])]), cfg)[0, -1]
    firsts = [base.encode(c)[0] for c in items[0]["choices"]]
    best = int(torch.stack([logits[t] for t in firsts]).argmax())
    assert rec.multiple_choice(models.llama, cfg, params, base, items) == pytest.approx(1 / 3)
    assert rec.multiple_choice(models.llama, cfg, params, base, [items[best]]) == 1.0


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_the_whole_recipe_runs_in_a_few_steps(tmp_path: Path, lora: int) -> None:
    """``examples/colossal_llama/recipe.py`` end to end, a few steps per stage; with
    ``--sft-lora`` the chat stage trains adapters, saved as a peft folder."""
    import runpy
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "colossal_llama" / "recipe.py"
    argv = sys.argv
    sys.argv = [str(script), "--out", str(tmp_path / "run"), "--steps", "3", "--sft-steps", "2"]
    sys.argv += ["--sft-lora", str(lora)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    figures = json.loads((tmp_path / "run" / "figures.json").read_text())
    assert set(figures) >= {
        "perplexity_before",
        "perplexity_after",
        "multiple_choice",
        "added_tokens",
    }
    assert set(figures["perplexity_before"]) == {"code", "docs"}
    assert figures["added_tokens"] > 0
    assert figures["sft_lora_rank"] == lora
    adapter = tmp_path / "run" / "sft_adapter" / "adapter_config.json"
    assert adapter.is_file() == bool(lora)
    if lora:
        assert json.loads(adapter.read_text())["r"] == lora
