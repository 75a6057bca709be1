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
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_inference import V, _chi2_pvalue, _engine, _hf_model

from colfunc.inference import SamplingParams
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
