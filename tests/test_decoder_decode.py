"""The decoder's layers on the CPU by direct kernel calls (:mod:`colfunc.models.decoder_decode`),
which ``decoder.paged_forward`` takes for the plain decoder on plain fp32 CPU tensors: the
logits and the new keys and values equal, bit for bit, those of the generic layers (the path
set aside) on drawn configurations (biases, norm offsets, activations, gated or not, tied
heads, grouped heads) and steps (decoding only, prompts and decoding mixed, more rows than the
few-row product takes); the engine's tokens and logprobs are those of the generic layers and
the path runs in them; anything else (q/k norms, windows, soft caps, a gradient wanted, fp64,
LoRA adapters, ``COLFUNC_KERNELS=torch``) goes to the generic layers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc import models
from colfunc.inference import Engine, SamplingParams
from colfunc.inference.kv_cache import paged_batch
from colfunc.models import decoder, decoder_decode

pytestmark = pytest.mark.skipif(
    decoder_decode.cpu_rows._linear_extension() is None,
    reason="no AVX-512 or AVX2 with FMA on this CPU",
)

BLOCK = 4


def _config(**changes) -> decoder.Config:  # type: ignore[no-untyped-def]
    base = dict(vocab_size=97, n_layer=2, n_head=4, n_kv_heads=2, d_model=32, d_ff=40,
                max_seq_len=64)  # fmt: skip
    return decoder.Config(**{**base, **changes})


def _step(cfg: decoder.Config, params, contexts: list[int], queries: list[int], seed: int):  # type: ignore[no-untyped-def]
    """One paged step over a cache of random keys and values: sequence ``s`` has
    ``contexts[s]`` tokens cached and brings ``queries[s]``."""
    g = torch.Generator().manual_seed(seed)
    E = cfg.head_dim
    per_seq = -(-cfg.max_seq_len // BLOCK)
    shape = (cfg.n_layer, per_seq * len(contexts) + 1, BLOCK, cfg.n_kv_heads, E)
    cache = {"k": torch.randn(shape, generator=g), "v": torch.randn(shape, generator=g)}
    order = torch.randperm(shape[1] - 1, generator=g).tolist()  # blocks anywhere in the cache
    items = []
    for s, (c, n) in enumerate(zip(contexts, queries, strict=True)):
        blocks = order[s * per_seq : s * per_seq + -(-(c + n) // BLOCK)]
        items.append((blocks, c, n, c + n))
    batch, _ = paged_batch(items, BLOCK, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (sum(queries),), generator=g)
    ends = torch.tensor(queries).cumsum(0) - 1
    return tokens, batch, cache, ends


def _both(cfg, params, tokens, batch, cache, select, monkeypatch):  # type: ignore[no-untyped-def]
    calls = []
    real = decoder_decode.layers

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    with torch.inference_mode():
        monkeypatch.setattr(decoder_decode, "layers", counted)
        fast = decoder.paged_forward(params, tokens, batch, cache, cfg, select)
        monkeypatch.setattr(decoder_decode, "layers", lambda *a, **k: None)
        generic = decoder.paged_forward(params, tokens, batch, cache, cfg, select)
    return fast, generic, calls


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.integers(1, 20),
    prompts=st.integers(0, 3),
    biases=st.booleans(),
    offset=st.sampled_from([0.0, 1.0]),
    act=st.sampled_from(["silu", "gelu_tanh", "gelu"]),
    gated=st.booleans(),
    tied=st.booleans(),
    kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_equals_the_generic_layers_bit_for_bit(
    seqs, prompts, biases, offset, act, gated, tied, kv_heads, seed
) -> None:
    cfg = _config(qkv_bias=biases, o_bias=biases, mlp_bias=biases and not gated, norm_offset=offset,
                  mlp_act=act, mlp_gated=gated, tie_embeddings=tied, embed_scale=offset > 0,
                  n_kv_heads=kv_heads)  # fmt: skip
    assert decoder_decode.takes(cfg)
    params = decoder.init(cfg, seed % 7)
    rng = random.Random(seed)
    contexts = [rng.randint(0, 40) for _ in range(seqs)]
    queries = [1] * seqs
    for s in rng.sample(range(seqs), min(prompts, seqs)):  # some of them prompts (or chunks)
        queries[s] = rng.randint(2, 12)
    tokens, batch, cache, select = _step(cfg, params, contexts, queries, seed)
    with pytest.MonkeyPatch.context() as mp:
        (logits, ys), (logits0, ys0), calls = _both(cfg, params, tokens, batch, cache, select, mp)
    assert calls == [True]
    assert torch.equal(logits, logits0)
    assert ys.keys() == ys0.keys() and all(torch.equal(ys[k], ys0[k]) for k in ys)


def test_the_engine_gives_the_generic_tokens_and_logprobs(monkeypatch) -> None:
    cfg = models.qwen2.Config(
        vocab_size=97, n_layer=3, n_head=4, n_kv_heads=2, d_model=32, d_ff=40, max_seq_len=64
    )  # fmt: skip (q/k/v biases)
    params = decoder.init(cfg, 1)
    prompts = [[5, 6, 7], list(range(1, 30)), [9] * 11]
    sampling = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

    def run() -> list:
        engine = Engine(decoder, cfg, params, block_size=BLOCK, enable_prefix_caching=False)
        out = engine.generate(prompts, sampling)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]

    taken = []
    real = decoder_decode.layers
    monkeypatch.setattr(
        decoder_decode,
        "layers",
        lambda *a, **k: taken.append(1) or real(*a, **k),  # type: ignore[func-returns-value]
    )
    fast = run()
    assert len(taken) == 12  # (every step: the prompts, then the decoding)
    monkeypatch.setattr(decoder_decode, "layers", lambda *a, **k: None)
    assert fast == run()


@pytest.mark.parametrize(
    "change",
    [
        dict(qk_norm=True),
        dict(sliding_window=8),
        dict(attn_softcap=30.0),
        dict(attn_scale_dim=16.0),
        dict(norm_style="post"),
        dict(norm_type="layer"),
        dict(parallel_residual=True, norm_type="layer"),
        dict(rotary_fraction=0.5),
    ],
    ids=lambda c: ",".join(c),
)
def test_other_layers_are_not_taken(change) -> None:
    cfg = _config(**change)
    assert not decoder_decode.takes(cfg)
    params = decoder.init(cfg, 0)
    _, batch, cache, _ = _step(cfg, params, [3, 5], [1, 1], 0)
    x = torch.randn(1, 2, cfg.d_model)
    rope = (torch.ones(2, cfg.head_dim // 2), torch.zeros(2, cfg.head_dim // 2))
    got = decoder_decode.layers(params["blocks"], x, rope, batch, cache, cfg, torch.sigmoid)
    assert got is None


def test_anything_but_plain_fp32_without_a_gradient_goes_to_the_generic_layers(
    monkeypatch,
) -> None:
    cfg = _config()
    params = decoder.init(cfg, 0)
    _, batch, cache, _ = _step(cfg, params, [3, 5], [1, 1], 0)
    half = cfg.head_dim // 2
    rope = (torch.ones(2, half), torch.zeros(2, half))

    def layers(blocks, x=None, c=cache):  # type: ignore[no-untyped-def]
        x = torch.randn(1, 2, cfg.d_model) if x is None else x
        return decoder_decode.layers(blocks, x, rope, batch, c, cfg, torch.sigmoid)

    with torch.no_grad():
        assert layers(params["blocks"]) is not None
    wanting = {p: {n: t.clone().requires_grad_() for n, t in g.items()} for p, g in
               params["blocks"].items()}  # fmt: skip
    assert layers(wanting) is None  # (a gradient wanted: autograd's layers)
    doubled = {p: {n: t.double() for n, t in g.items()} for p, g in params["blocks"].items()}
    dcache = {k: c.double() for k, c in cache.items()}
    assert layers(doubled, torch.randn(1, 2, cfg.d_model, dtype=torch.float64), dcache) is None
    strided = {**params["blocks"], "mlp": {**params["blocks"]["mlp"]}}
    strided["mlp"]["w_up"] = strided["mlp"]["w_up"].transpose(1, 2).contiguous().transpose(1, 2)
    assert layers(strided) is None
    monkeypatch.setenv("COLFUNC_KERNELS", "torch")
    assert layers(params["blocks"]) is None


def test_lora_adapters_go_to_the_generic_layers(monkeypatch) -> None:
    from colfunc.adapters.lora import LoraConfig, add_adapters

    cfg = models.llama.Config(vocab_size=97, n_layer=2, n_head=4, n_kv_heads=2, d_model=32,
                              d_ff=40, max_seq_len=64)  # fmt: skip
    params = decoder.init(cfg, 0)
    lora = LoraConfig(rank=2, targets=("blocks.attn.wq",))
    engine = Engine(decoder, cfg, params, block_size=BLOCK, max_loras=1)
    taken = []
    real = decoder_decode.layers
    monkeypatch.setattr(
        decoder_decode, "layers", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    )
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert taken and all(t is not None for t in taken)  # (no adapter: the direct calls)
    engine.add_lora("a", (lora, add_adapters(lora, params)))
    taken.clear()
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, lora="a", temperature=0))
    assert taken and all(t is None for t in taken)  # (the adapters' weights: generic layers)


def test_a_context_past_the_block_table_is_refused_by_name() -> None:
    cfg = _config()
    params = decoder.init(cfg, 0)
    _, batch, cache, _ = _step(cfg, params, [3, 5], [1, 1], 0)
    batch = dataclasses.replace(batch, context_lens=(3, 10_000))
    rope = (torch.ones(2, cfg.head_dim // 2), torch.zeros(2, cfg.head_dim // 2))
    with torch.no_grad(), pytest.raises(ValueError, match="context of 10000 tokens"):
        decoder_decode.layers(
            params["blocks"], torch.randn(1, 2, 32), rope, batch, cache, cfg, torch.sigmoid
        )
