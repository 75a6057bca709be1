"""Speculative decoding by prompt lookup (``Engine(speculative=Ngram(k))``).

- Greedy: the tokens equal decoding without speculation, token for token, on drawn repetitive
  prompts, draft counts, block sizes and token budgets (chunks that cover only some drafts),
  with ``n`` > 1, stop tokens, a second round of the same prompts served from the prefix cache
  (no block keyed with a rejected draft's keys and values), and preemptions (a small cache).
- Sampled: :func:`verify`'s first token has the target's filtered distribution, and after an
  accepted draft the next one too (chi-squared, penalties and top-k/p included), so the rule
  keeps the target's distribution exactly.
- The drafts: :func:`propose` finds the latest earlier occurrence of the longest suffix.
- The engine counts drafts and accepted ones; ``/metrics`` reports them; ``colfunc serve
  --speculative-ngram`` takes the count and refuses a bad one with exit code 2.
- A draft model (``Engine(speculative=DraftModel(...))``): greedy tokens equal decoding without
  speculation (drawn layouts, another family as the draft, preemptions, the prefix cache); the
  engine's own model as its draft has every draft accepted, greedy and sampled (its cache of
  keys and values follows the engine's blocks exactly, and ``q`` is the distribution ``p`` is);
  :func:`verify` with ``q`` keeps the target's distribution (chi-squared); what it cannot
  follow is refused by name; ``colfunc serve --speculative-model`` serves with one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_inference import V, _chi2_pvalue, _engine, _hf_model

import colfunc as cf
from colfunc import hf
from colfunc.inference import DraftModel, SamplingParams
from colfunc.inference.sampling import filtered_probs, penalised
from colfunc.inference.speculative import Ngram, propose, verify

pytestmark = pytest.mark.timeout(300)

MODELS: dict[str, Any] = {}


def _model(kind: str) -> Any:
    if kind not in MODELS:
        MODELS[kind] = _hf_model(kind)
    return MODELS[kind]


def _repetitive(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup drafts from), and a random one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        phrase = torch.randint(0, V, (int(torch.randint(2, 7, (), generator=g)),), generator=g)
        reps = int(torch.randint(2, 5, (), generator=g))
        out.append(phrase.tolist() * reps + [i % V])
    out.append(torch.randint(0, V, (9,), generator=g).tolist())
    return out


def _tokens(engine: Any, prompts: list[list[int]], p: SamplingParams) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in engine.generate(prompts, p)]


@settings(max_examples=6, deadline=None)
@given(
    kind=st.sampled_from(["gpt", "llama"]),
    k=st.integers(1, 5),
    block=st.sampled_from([2, 4, 16]),
    budget=st.sampled_from([3, 8, 2048]),
    n=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000),
)
def test_greedy_tokens_equal_decoding_one_at_a_time(kind, k, block, budget, n, seed) -> None:
    m = _model(kind)
    prompts = _repetitive(seed, 3)
    p = SamplingParams(temperature=0, max_tokens=24, n=n, stop_token_ids=[5])
    kw = dict(block_size=block, max_num_batched_tokens=budget)
    plain = _engine(m, **kw)
    spec = _engine(m, speculative=Ngram(k, 3, 1), **kw)
    want = _tokens(plain, prompts, p)
    assert _tokens(spec, prompts, p) == want
    assert _tokens(spec, prompts, p) == want  # again, the prompts' blocks from the cache
    stats = spec.stats()
    assert stats["prefix_hits"] > 0 or block == 16  # (prompts of fewer than 17 tokens)
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["blocks_used"] == 0  # every block given back


def test_speculation_survives_preemption_and_accepts_on_repetitive_text() -> None:
    m = _model("llama")
    prompts = _repetitive(7, 6)
    p = SamplingParams(temperature=0, max_tokens=40)
    want = _tokens(_engine(m), prompts, p)
    spec = _engine(m, speculative=Ngram(4), block_size=4, num_blocks=24)  # too few for all
    assert _tokens(spec, prompts, p) == want
    stats = spec.stats()
    assert stats["preemptions"] > 0
    assert stats["accepted_tokens"] > 0.2 * stats["draft_tokens"] > 0
    # sampled: a seeded request's tokens are its own whatever else runs, with speculation too
    sampled = SamplingParams(temperature=0.8, max_tokens=30, seed=3)
    alone = _tokens(_engine(m, speculative=Ngram(4)), prompts[:1], sampled)
    assert _tokens(spec, prompts, sampled)[0] == alone[0]


def test_propose_takes_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    spec = Ngram(3, ngram_max=3, ngram_min=1)
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], spec, 10) == [7, 8, 1]
    assert propose([4, 5, 6, 4, 5], spec, 10) == [6, 4, 5]
    assert propose([4, 5, 6, 4, 5], spec, 2) == [6, 4]  # (room for two)
    assert propose([1, 2, 3], spec, 10) == []  # no earlier occurrence
    assert propose([7, 7], Ngram(3, 1, 1), 10) == [7, 7, 7]  # a loop, drafted on around
    assert propose([1, 8, 9, 8], Ngram(5, 2, 1), 10) == [9, 8, 9, 8, 9]
    with pytest.raises(ValueError, match="tokens must be an int >= 1, got 0"):
        Ngram(0)
    with pytest.raises(ValueError, match="ngram_min=3 is above ngram_max=2"):
        Ngram(2, ngram_max=2, ngram_min=3)


@settings(max_examples=5, deadline=None)
@given(
    temperature=st.sampled_from([0.7, 1.0]),
    top_k=st.sampled_from([0, 5]),
    penalty=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 1000),
)
def test_sampled_tokens_keep_the_targets_distribution(temperature, top_k, penalty, seed) -> None:
    """Drafts that are one token for sure, checked by rejection sampling: the first token
    drawn is distributed as the target's first position says, whichever draft was proposed,
    and the token after an accepted draft as the second position says."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 8, generator=g, dtype=torch.float64) * 1.5
    p = SamplingParams(temperature=temperature, top_k=top_k, frequency_penalty=penalty)
    prompt, output = [1, 2], [3]
    first = filtered_probs(penalised(logits[0], p, prompt, output), p)
    draft = int(first.argmax())
    second = filtered_probs(penalised(logits[1], p, prompt, [*output, draft]), p)
    counts0 = torch.zeros(8, dtype=torch.float64)
    counts1 = torch.zeros(8, dtype=torch.float64)
    draw = torch.Generator().manual_seed(seed + 1)
    for _ in range(3000):
        got = verify(logits, [draft], p, prompt, output, draw)
        counts0[got[0]] += 1
        if got[0] == draft:
            assert len(got) == 2
            counts1[got[1]] += 1
        else:
            assert len(got) == 1
    assert float(counts0[first == 0].sum()) == 0 and float(counts1[second == 0].sum()) == 0
    assert _chi2_pvalue(counts0, first) > 1e-4
    assert _chi2_pvalue(counts1, second) > 1e-4


def test_the_server_reports_speculation_and_the_cli_checks_the_count(tmp_path, capsys) -> None:
    from fastapi.testclient import TestClient

    from colfunc.cli import main
    from colfunc.inference.server import EngineLoop, build_app

    engine = _engine(_model("gpt"), speculative=Ngram(4))
    with TestClient(build_app(EngineLoop(engine), "tiny")) as client:  # (stops the loop after)
        body = {"model": "tiny", "prompt": _repetitive(3, 1)[0], "max_tokens": 16}
        assert client.post("/v1/completions", json={**body, "temperature": 0}).status_code == 200
        text = client.get("/metrics").text
    stats = engine.stats()
    assert stats["draft_tokens"] > 0
    assert f"colfunc_spec_decode_draft_tokens_total {float(stats['draft_tokens'])}" in text
    assert f"colfunc_spec_decode_accepted_tokens_total {float(stats['accepted_tokens'])}" in text
    assert "colfunc_spec_decode_acceptance_rate" in text
    assert main(["serve", "--hf", str(tmp_path), "--speculative-ngram", "-1"]) == 2
    assert "tokens must be an int >= 1, got -1" in capsys.readouterr().err


def _draft(kind: str, k: int) -> DraftModel:
    cfg, params = hf.from_hf(_model(kind))
    return DraftModel(getattr(cf.models, kind), cfg, params, k)


@settings(max_examples=5, deadline=None)
@given(
    draft_kind=st.sampled_from(["llama", "gpt"]),
    k=st.integers(1, 5),
    block=st.sampled_from([2, 4, 16]),
    budget=st.sampled_from([5, 2048]),
    n=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000),
)
def test_a_draft_model_keeps_the_greedy_tokens(draft_kind, k, block, budget, n, seed) -> None:
    m = _model("llama")
    prompts = _repetitive(seed, 3)
    p = SamplingParams(temperature=0, max_tokens=20, n=n, stop_token_ids=[5])
    kw = dict(block_size=block, max_num_batched_tokens=budget)
    want = _tokens(_engine(m, **kw), prompts, p)
    spec = _engine(m, speculative=_draft(draft_kind, k), **kw)
    assert _tokens(spec, prompts, p) == want
    assert _tokens(spec, prompts, p) == want  # again, the prompts' blocks from the cache
    stats = spec.stats()
    assert stats["draft_tokens"] > 0 and stats["blocks_used"] == 0
    if draft_kind == "llama":  # the model itself as its draft: every draft accepted
        assert stats["accepted_tokens"] == stats["draft_tokens"]


def test_the_model_as_its_own_draft_is_always_accepted_even_when_preempted() -> None:
    m = _model("llama")
    prompts = _repetitive(5, 6)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    want = _tokens(_engine(m), prompts, greedy)
    spec = _engine(m, speculative=_draft("llama", 4), block_size=4, num_blocks=24)
    assert _tokens(spec, prompts, greedy) == want
    stats = spec.stats()
    assert stats["preemptions"] > 0 and stats["accepted_tokens"] == stats["draft_tokens"] > 0
    # sampled, penalised and filtered: q is the very distribution p is, so p(d)/q(d) = 1 (to
    # rounding between a decoding pass and a verifying one)
    sampled = SamplingParams(temperature=0.9, top_k=20, frequency_penalty=0.5, max_tokens=40)
    spec = _engine(m, speculative=_draft("llama", 3))
    outs = _tokens(spec, prompts, sampled)
    stats = spec.stats()
    assert stats["accepted_tokens"] >= 0.98 * stats["draft_tokens"] > 0
    assert all(len(o[0]) == 40 for o in outs)
    # a seeded request's tokens are its own whatever else runs, with a draft model too
    seeded = SamplingParams(temperature=0.8, max_tokens=30, seed=3)
    other = _engine(m, speculative=_draft("gpt", 3))
    alone = _tokens(other, prompts[:1], seeded)
    assert _tokens(other, prompts, seeded)[0] == alone[0]


@settings(max_examples=4, deadline=None)
@given(
    temperature=st.sampled_from([0.7, 1.0]),
    top_k=st.sampled_from([0, 5]),
    seed=st.integers(0, 1000),
)
def test_drafts_drawn_from_q_keep_the_targets_distribution(temperature, top_k, seed) -> None:
    """Drafts drawn from a draft distribution q: the first token verify yields has the target's
    distribution p, and the token after an accepted draft too (chi-squared)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 8, generator=g, dtype=torch.float64) * 1.5
    p = SamplingParams(temperature=temperature, top_k=top_k)
    prompt, output = [1, 2], [3]
    first = filtered_probs(penalised(logits[0], p, prompt, output), p)
    q = torch.softmax(torch.randn(8, generator=g, dtype=torch.float64), -1)  # another model's
    counts0 = torch.zeros(8, dtype=torch.float64)
    counts1 = torch.zeros(8, dtype=torch.float64)
    after = 0
    draw = torch.Generator().manual_seed(seed + 1)
    for _ in range(3000):
        d = int(torch.multinomial(q, 1, generator=draw))
        got = verify(logits, [d], p, prompt, output, draw, q[None])
        counts0[got[0]] += 1
        if len(got) == 2:  # accepted: the next token from the second position
            assert got[0] == d
            if d == 0:
                counts1[got[1]] += 1
                after += 1
    assert float(counts0[first == 0].sum()) == 0
    assert _chi2_pvalue(counts0, first) > 1e-4
    if after > 100:
        second = filtered_probs(penalised(logits[1], p, prompt, [*output, 0]), p)
        assert _chi2_pvalue(counts1, second) > 1e-4


def test_a_draft_model_refuses_what_it_cannot_follow(tmp_path, capsys) -> None:
    import transformers

    from colfunc.cli import main

    with pytest.raises(ValueError, match="tokens must be an int >= 1, got 0"):
        _draft("llama", 0)
    with pytest.raises(TypeError, match="has no paged_forward"):
        DraftModel(object(), None, None, 2)
    c = transformers.MistralConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
        intermediate_size=32, vocab_size=V, max_position_embeddings=64, sliding_window=4,
    )  # fmt: skip
    windowed = transformers.MistralForCausalLM(c)
    with pytest.raises(ValueError, match="the engine's model has a sliding window"):
        _engine(windowed, speculative=_draft("llama", 2))
    cfg, params = hf.from_hf(windowed)
    with pytest.raises(ValueError, match="the draft model has a sliding window"):
        _engine(_model("llama"), speculative=DraftModel(cf.models.mistral, cfg, params, 2))
    gpt_cfg, gpt_params = hf.from_hf(_model("gpt"))
    short_cfg = dataclasses.replace(gpt_cfg, max_seq_len=8)
    with pytest.raises(ValueError, match="draft's context \\(8 tokens\\) is shorter"):
        _engine(_model("llama"), speculative=DraftModel(cf.models.gpt, short_cfg, gpt_params, 2))
    folder = tmp_path / "draft"
    _model("gpt").save_pretrained(folder)
    for argv, said in [
        (["--num-speculative-tokens", "3"], "goes with --speculative-model"),
        (["--speculative-model", str(folder)], "needs --num-speculative-tokens"),
        (["--speculative-model", str(folder), "--num-speculative-tokens", "0"], ">= 1, got 0"),
        (["--speculative-model", str(tmp_path), "--num-speculative-tokens", "2"], "no config"),
        (["--speculative-ngram", "2", "--speculative-model", str(folder)], "not both"),
    ]:
        assert main(["serve", "--hf", str(tmp_path), *argv]) == 2
        assert said in capsys.readouterr().err


def test_serve_with_a_draft_model_folder(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from colfunc import engines
    from colfunc.inference.server import EngineLoop, build_app

    folder = tmp_path / "draft"
    _model("llama").save_pretrained(folder)
    spec = engines.speculative(0, folder, 3)
    assert isinstance(spec, DraftModel) and spec.tokens == 3
    engine = _engine(_model("llama"), speculative=spec)
    prompt = _repetitive(4, 1)[0]
    with TestClient(build_app(EngineLoop(engine), "tiny")) as client:  # (stops the loop after)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        got = client.post("/v1/completions", json=body)
        text = client.get("/metrics").text
    assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 16
    stats = engine.stats()
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    assert f"colfunc_spec_decode_accepted_tokens_total {float(stats['accepted_tokens'])}" in text
