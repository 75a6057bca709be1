"""The inference engine against ``transformers`` and against its own bookkeeping.

Greedy outputs are token-identical to ``generate`` of tiny random GPT-2, LLaMA (grouped-query)
and OPT models built from ``transformers`` configs (fp64, so that no near-tie of random logits
can flip an argmax), on prompts of different lengths batched together, with prefix caching on
and off, chunked prefill, and caches so small that sequences are preempted and recomputed. The
KV cache is empty again once every request has ended; a shared prefix is served from exactly its
full cached blocks; sampled frequencies match the filtered distribution (chi-squared).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import engines, hf
from colfunc.inference import ByteTokenizer, Engine, SamplingParams, next_token
from colfunc.inference.sampling import filtered_probs

pytestmark = pytest.mark.timeout(300)

V, CONTEXT = 97, 64


def _hf_model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed({"gpt": 0, "llama": 1, "opt": 2}[kind])
    if kind == "gpt":
        c = transformers.GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=32,
            vocab_size=V,
            n_positions=CONTEXT,
            bos_token_id=0,
            eos_token_id=0,
        )
        m = transformers.GPT2LMHeadModel(c)
    elif kind == "llama":
        c = transformers.LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=V,
            max_position_embeddings=CONTEXT,
        )
        m = transformers.LlamaForCausalLM(c)
    else:
        c = transformers.OPTConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            ffn_dim=64,
            vocab_size=V,
            max_position_embeddings=CONTEXT,
            word_embed_proj_dim=32,
        )
        m = transformers.OPTForCausalLM(c)
    m = m.double().eval()
    m.generation_config.eos_token_id = None  # run every request to max_new_tokens
    m.generation_config.pad_token_id = 0
    return m


def _engine(m: transformers.PreTrainedModel, **kwargs) -> Engine:
    cfg, params = hf.from_hf(m)
    module = getattr(cf.models, type(cfg).__module__.rsplit(".", 1)[-1])
    return Engine(module, cfg, params, **kwargs)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYOUTS = {
    "default": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preempting": {"block_size": 4, "num_blocks": 17},
    "few_blocks": {"block_size": 16, "num_blocks": 5},
}


@pytest.mark.parametrize("kind", ["gpt", "llama", "opt"])
def test_greedy_equals_transformers_generate(kind) -> None:
    m = _hf_model(kind)
    prompts = _prompts([3, 17, 9, 33, 1, 20, 17])
    expected = cf.testing.hf_greedy(m, prompts, GREEDY.max_tokens)
    for name, layout in LAYOUTS.items():
        engine = _engine(m, **layout)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
        assert got == expected, name
        stats = engine.stats()
        assert stats["blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
        assert all(r == 0 for r in engine.allocator.refs)
        if name == "preempting":
            assert stats["preemptions"] >= 1  # the layout forces recomputation


def test_shared_prefix_is_served_from_exactly_its_full_cached_blocks() -> None:
    m = _hf_model("llama")
    engine = _engine(m, block_size=8)
    (prefix,) = _prompts([29])
    first = [*prefix, 5]  # 30 tokens: (30 - 1) // 8 = 3 full blocks may be reused later
    engine.generate([first], GREEDY)
    assert engine.allocator.hits == 0
    second = [*prefix[:24], 7, 7, 7]  # shares the first 3 blocks (24 tokens), not the 4th
    (out,) = engine.generate([second], GREEDY)
    assert engine.allocator.hits == 3
    assert out.outputs[0].token_ids == cf.testing.hf_greedy(m, [second], GREEDY.max_tokens)[0]
    engine.generate([second], GREEDY)  # all 3 full blocks of 27 tokens: (27 - 1) // 8 = 3
    assert engine.allocator.hits == 6
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("block_size", [8, 16])
def test_kv_waste_is_small_and_every_block_comes_back(block_size) -> None:
    """A mixed workload (prompts 16-256 tokens, outputs 16-128): blocks are taken as tokens
    arrive, so a running sequence wastes less than one block (on this workload 2.0% of the
    allocated slots with blocks of 8, 4.1% with blocks of 16)."""
    cfg = cf.models.gpt.Config(vocab_size=V, n_layer=1, n_head=2, d_model=16, max_seq_len=512)
    engine = Engine(
        cf.models.gpt, cfg, cf.models.gpt.init(cfg), max_num_seqs=16, block_size=block_size
    )
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(16, 257, (32,), generator=g).tolist()
    outs = torch.randint(16, 129, (32,), generator=g).tolist()
    for p, n in zip(_prompts(lengths, seed=4), outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    allocated = used = seq_steps = 0
    aborted = False
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        allocated += sum(len(s.blocks) for s in running) * block_size
        used += sum(s.computed for s in running)
        seq_steps += len(running)
        if not aborted and len(running) > 4:
            engine.abort(running[2].request_id)  # an abort frees its blocks too
            aborted = True
    assert aborted
    assert allocated - used < seq_steps * block_size
    if block_size == 8:
        assert (allocated - used) / allocated < 0.04
    assert engine.stats()["blocks_used"] == 0
    assert all(r == 0 for r in engine.allocator.refs)


def test_n_completions_share_the_prompt_and_copy_on_write() -> None:
    m = _hf_model("opt")
    engine = _engine(m, block_size=4)
    (prompt,) = _prompts([10])  # ends mid-block: every completion writes into the shared block
    (out,) = engine.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8))
    expected = cf.testing.hf_greedy(m, [prompt], 8)[0]
    assert [o.token_ids for o in out.outputs] == [expected] * 3
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5)
    (many,) = engine.generate([prompt], sampled)
    (one,) = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, seed=5))
    assert many.outputs[0].token_ids == one.outputs[0].token_ids  # the same stream
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1  # the others their own
    assert engine.stats()["blocks_used"] == 0


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    m = _hf_model("gpt")
    p = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=11)
    (target,) = _prompts([13], seed=8)
    alone = _engine(m).generate([target], p)[0].outputs[0].token_ids
    others = _prompts([5, 30, 2, 19], seed=9)
    mixed = _engine(m, max_num_batched_tokens=16).generate(
        [*others[:2], target, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=7)] * 2
        + [p]
        + [SamplingParams(temperature=0.5, max_tokens=12)] * 2,
    )
    assert mixed[2].outputs[0].token_ids == alone


def test_stops_and_logprobs() -> None:
    m = _hf_model("gpt")
    engine = _engine(m)
    (prompt,) = _prompts([6], seed=12)
    free = engine.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,), logprobs=3),
    )[0].outputs[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    cfg, params = hf.from_hf(m)
    logits = cf.models.gpt.apply(params, torch.tensor([prompt + out.token_ids]), cfg)[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)
    for k, entry in enumerate(out.logprobs):
        assert math.isclose(entry["logprob"], float(lp[k, entry["token"]]), abs_tol=1e-9)
        assert max(entry["top"].values()) == pytest.approx(float(lp[k].max()), abs=1e-9)
        assert len(entry["top"]) == 3
    length = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_stop_strings_cut_the_text() -> None:
    cfg = cf.models.gpt.Config(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_seq_len=64)
    engine = Engine(cf.models.gpt, cfg, cf.models.gpt.init(cfg), tokenizer=ByteTokenizer())
    free = engine.generate(["ab"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop = free.text[3:5]
    cut = free.text.find(stop)
    out = engine.generate(["ab"], SamplingParams(temperature=0, max_tokens=20, stop=stop))
    assert out[0].outputs[0].text == free.text[:cut]
    assert out[0].outputs[0].finish_reason == "stop"


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    if dof == 0:  # one token kept: it is always drawn, as asserted apart
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, then top-p, then min-p, written out token by token."""
    x = (logits / p.temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[: p.top_k] if p.top_k else order)
    z = [math.exp(x[i]) if i in keep else 0.0 for i in range(len(x))]
    total = sum(z)
    probs = [v / total for v in z]
    if p.top_p < 1:
        mass, kept = 0.0, set()
        for i in order:
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [v if i in kept else 0.0 for i, v in enumerate(probs)]
    if p.min_p > 0:
        top = max(probs)
        probs = [v if v >= p.min_p * top else 0.0 for v in probs]
    total = sum(probs)
    return torch.tensor([v / total for v in probs], dtype=torch.float64)


@settings(max_examples=8, deadline=None)
@given(
    top_k=st.sampled_from([0, 3, 6]),
    top_p=st.sampled_from([1.0, 0.8, 0.5]),
    min_p=st.sampled_from([0.0, 0.1]),
    temperature=st.sampled_from([0.7, 1.0, 1.5]),
    seed=st.integers(0, 1000),
)
def test_sampled_frequencies_match_the_filtered_distribution(
    top_k, top_p, min_p, temperature, seed
) -> None:
    logits = torch.randn(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = _reference_probs(logits, p)
    assert torch.allclose(filtered_probs(logits, p), expected, atol=1e-12)
    g = torch.Generator().manual_seed(seed)
    draws = torch.tensor([next_token(logits, p, [], [], g) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=10).double()
    assert float(counts[expected == 0].sum()) == 0  # nothing filtered out is ever drawn
    assert _chi2_pvalue(counts, expected) > 1e-4


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    g = torch.Generator()
    rep = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert next_token(logits, rep, [3], [], g) == 0  # 3.0 / 4 < 2.0
    presence = SamplingParams(temperature=0, presence_penalty=1.5)
    assert next_token(logits, presence, [], [3], g) == 0  # 3.0 - 1.5 < 2.0
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert next_token(logits, freq, [], [3], g) == 3  # 3.0 - 0.6 > 2.0
    assert next_token(logits, freq, [], [3, 3], g) == 0  # 3.0 - 1.2 < 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_and_engines_are_refused() -> None:
    m = _hf_model("gpt")
    engine = _engine(m)
    with pytest.raises(ValueError, match="context is 64"):
        engine.add_request(list(range(64)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        engine.add_request([3, 97])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text")
    with pytest.raises(ValueError, match="at least 4 blocks"):
        _engine(m, num_blocks=3)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1], {"temperature": 0})  # type: ignore[arg-type]
    assert not engine.has_unfinished()


def test_from_hf_folder_with_its_tokenizer(tmp_path) -> None:
    m = _hf_model("gpt")
    m.save_pretrained(tmp_path)
    engine = engines.from_hf(tmp_path, dtype=torch.float64)
    assert engine.tokenizer is None  # the folder has no tokenizer: prompts are ids
    prompts = _prompts([5, 11])
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == cf.testing.hf_greedy(m, prompts, GREEDY.max_tokens)


def test_allocator_evicts_the_least_recently_released_cached_block() -> None:
    from colfunc.inference import BlockAllocator, block_hash

    a = BlockAllocator(num_blocks=3, block_size=2)
    keys = [block_hash(None, [t, t]) for t in range(3)]
    blocks = [a.allocate() for _ in range(3)]
    for b, k in zip(blocks, keys):
        a.register(b, k)
    for b in (blocks[1], blocks[0], blocks[2]):  # released in this order: 1 is the oldest
        a.release(b)
    assert a.free_count() == 3 and a.used_count() == 0
    assert a.lookup(keys[0]) == blocks[0]  # a hit takes a cached block back from eviction
    fresh = a.allocate()  # no never-cached block is left: the oldest released goes
    assert fresh == blocks[1] and a.lookup(keys[1]) is None
    assert a.lookup(keys[2]) == blocks[2]
    assert (a.hits, a.queries) == (2, 3)
    with pytest.raises(RuntimeError, match="no free block"):
        a.allocate()
    for b in (blocks[0], blocks[2], fresh):
        a.release(b)
    with pytest.raises(RuntimeError, match="released more often"):
        a.release(fresh)


def test_several_end_of_sequence_ids_each_stop_as_transformers_does(tmp_path) -> None:
    # Llama 3 ends a turn with any of several ids (generation_config.json's list)
    m = _hf_model("llama")
    (prompt,) = _prompts([7], seed=5)
    free = cf.testing.hf_greedy(m, [prompt], 12)[0]
    stop_at = free[5]
    unused = next(t for t in range(V) if t not in free)
    m.generation_config.eos_token_id = [unused, stop_at]
    m.save_pretrained(tmp_path)
    ids = torch.tensor([prompt])
    ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    ref_tokens = ref[0, len(prompt) :].tolist()
    assert ref_tokens == free[: free.index(stop_at) + 1]  # transformers stops at the list's id
    engine = engines.from_hf(tmp_path, dtype=torch.float64)
    assert engine.eos_token_ids == (unused, stop_at)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == ref_tokens and out.finish_reason == "stop"
    again = _engine(m, eos_token_id=stop_at)  # one id still works
    assert again.generate([prompt], GREEDY)[0].outputs[0].token_ids == free  # ignore_eos


@pytest.mark.parametrize("eos", ["2", 1.5, [3, "4"], [True], -1])
def test_bad_end_of_sequence_ids_are_refused(eos) -> None:
    with pytest.raises(TypeError, match="eos_token_id must be an id >= 0"):
        _engine(_hf_model("gpt"), eos_token_id=eos)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):  # type: ignore[no-untyped-def]
    from colfunc.inference.tokenizers import load_hf_tokenizer

    path = tmp_path_factory.mktemp("bpe")
    cf.testing.save_bpe_tokenizer(path, 320, "<|endoftext|>")
    return load_hf_tokenizer(path)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 319), max_size=40))
def test_incremental_detokenizing_equals_decoding_everything(bpe_tokenizer, ids) -> None:
    """Token by token, the incremental text equals the tokenizer's decode of all the tokens so
    far, for a byte-level BPE and for bytes; windows that end inside a character are completed
    later, not lost."""
    from colfunc.inference.tokenizers import ByteTokenizer, Detokenized, detokenize

    for tok, seq in ((bpe_tokenizer, ids), (ByteTokenizer(), [t % 256 for t in ids])):
        at = Detokenized()
        for n in range(1, len(seq) + 1):
            text, at = detokenize(tok, seq[:n], at)
            assert text == tok.decode(seq[:n])
