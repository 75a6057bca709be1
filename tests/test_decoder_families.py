"""Mistral, Qwen 2, Qwen 3, Phi-3, OLMo 2, Gemma 2, Gemma 3, SmolLM 3 and GPT-NeoX as
configurations of the one shared decoder.

For each family, on tiny random ``transformers`` models built here (vocabularies that are not a
power of two, no download): logits and loss equal ``transformers``' within 1e-5 (fp32); one AdamW
step equals ``transformers`` + ``torch.optim.AdamW`` (fp64, 1e-9); training under dp2 x tp2 with
ZeRO-3, under a 2-stage pipeline and under tp2 with offload equals one device (fp64 AdamW,
1e-9); the engine, alone and
under ``tp=2``, gives ``generate``'s greedy tokens; export then ``from_pretrained`` gives the same
logits, and a bf16 folder loads; sliding windows shorter than the prompts (Mistral's, Qwen 2's with every layer
sliding; Gemma's sliding layers between global ones) hold through all of it; so do Gemma 2's
soft-capping, OLMo 2's post-norms, SmolLM 3's layers without rotary positions and GPT-NeoX's
parallel residual, partial rotary embedding and per-head fused q/k/v; what the
decoder does not compute (sliding and full layers mixed,
an unknown rope type) is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import colfunc as cf
from colfunc import hf, models, optim
from colfunc.inference import Engine, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

SIZES = dict(
    vocab_size=53, hidden_size=24, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=40, num_hidden_layers=2, max_position_embeddings=48, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
)  # fmt: skip

# family -> (its module, the transformers config class, extra config fields)
FAMILIES: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "mistral": (models.mistral, "MistralConfig", {"sliding_window": None}),
    "qwen2": (models.qwen2, "Qwen2Config", {}),
    "qwen3": (models.qwen3, "Qwen3Config", {"head_dim": 10}),
    "qwen3_bias": (models.qwen3, "Qwen3Config", {"head_dim": 8, "attention_bias": True}),
    "qwen3_gelu": (models.qwen3, "Qwen3Config", {"head_dim": 8, "hidden_act": "gelu"}),
    # dynamic NTK changes nothing within the context: the default frequencies, written back
    "olmo2_dynamic": (
        models.olmo2,
        "Olmo2Config",
        {"pad_token_id": 0, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    ),
    "phi3": (models.phi3, "Phi3Config", {"pad_token_id": 0, "sliding_window": None}),
    # sliding windows shorter than the prompts (20 tokens)
    "phi3_window": (models.phi3, "Phi3Config", {"pad_token_id": 0, "sliding_window": 5}),
    "mistral_window": (models.mistral, "MistralConfig", {"sliding_window": 5}),
    # Phi-3 128k's longrope: short factors up to 16 tokens, long ones past (the prompts are 20
    # long; the engine's cross over as they generate), and Phi-4-mini's partial rotary embedding
    "phi3_longrope": (
        models.phi3,
        "Phi3Config",
        {"pad_token_id": 0, "sliding_window": None, "original_max_position_embeddings": 16,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                             "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 4.0, 8.0]}},
    ),
    "phi3_partial": (
        models.phi3,
        "Phi3Config",
        {"pad_token_id": 0, "sliding_window": None, "head_dim": 8, "partial_rotary_factor": 0.5},
    ),
    "qwen2_window": (
        models.qwen2,
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
    ),
    # the first layer full, the second sliding (max_window_layers=1)
    "qwen2_mixed": (
        models.qwen2,
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "olmo2": (models.olmo2, "Olmo2Config", {"pad_token_id": 0}),
    # global layers alternating with windows shorter than the prompts, soft-capping, a softmax
    # scale of its own
    "gemma2": (
        models.gemma2,
        "Gemma2Config",
        {"head_dim": 8, "query_pre_attn_scalar": 10, "sliding_window": 5, "pad_token_id": 0,
         "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0},
    ),
    "gemma3": (
        models.gemma3,
        "Gemma3TextConfig",
        {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 5, "pad_token_id": 0,
         "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {
             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    ),
    # a quarter of each head rotated (2 of 8 dims), attention and MLP side by side
    "gpt_neox": (
        models.gpt_neox,
        "GPTNeoXConfig",
        {"hidden_size": 32, "layer_norm_eps": 1e-5,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
    ),
    "gpt_neox_serial": (
        models.gpt_neox,
        "GPTNeoXConfig",
        {"hidden_size": 32, "use_parallel_residual": False, "hidden_act": "gelu_new",
         "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5}},
    ),
    "smollm3": (
        models.smollm3,
        "SmolLM3Config",
        {"no_rope_layers": [1, 0], "pad_token_id": 0, "tie_word_embeddings": True},
    ),
}  # fmt: skip


def _hf(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, **extra: Any) -> Any:
    _, config_class, fields = FAMILIES[name]
    cfg = getattr(transformers, config_class)(
        **{**SIZES, **fields, **extra}, attn_implementation="eager"
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        with torch.no_grad():  # biases and norm weights away from their zero and one
            for p in model.parameters():
                p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _batch(seed: int, rows: int = 2, length: int = 20) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 53, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_loss_equal_transformers(name: str) -> None:
    module = FAMILIES[name][0]
    model = _hf(name, seed=1, dtype=torch.float32)
    cfg, params = hf.from_hf(model)
    assert type(cfg) is module.Config
    batch = _batch(1)
    with torch.no_grad():
        ref = model(**batch)
        logits = module.apply(params, batch["input_ids"], cfg)
        loss = module.loss(cfg)(params, batch)
    assert (logits - ref.logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - ref.loss.item()) <= 1e-5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_adamw_step_equals_transformers_and_torch_optim(name: str) -> None:
    module = FAMILIES[name][0]
    model = _hf(name, seed=2)
    cfg, params = hf.from_hf(model)
    params_before = dict(cf.tree.flatten_with_paths(params)[0])
    batch = _batch(2)
    # eps 1e-4: the first update is lr * g / (|g| + eps), so an absolute gradient error d moves
    # it by at most lr * d / eps (see below)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    model(**batch).loss.backward()
    opt.step()
    step = cf.train_step(module.loss(cfg), optim.adamw(**hyper))
    state, _ = step(step.init(params), batch)
    want = dict(cf.tree.flatten_with_paths(hf.from_hf(model)[1])[0])
    got = dict(cf.tree.flatten_with_paths(state.params)[0])
    assert got.keys() == want.keys()
    # transformers' eager attention takes its softmax and rotary tables in fp32 whatever the
    # weights, so its fp64 gradients are fp32-accurate (d up to ~1e-7 on these gradients): the
    # updates then agree to lr * d / eps ~ 1e-5, where the step itself is about lr = 1e-2
    for path, x in got.items():
        torch.testing.assert_close(x, want[path], rtol=0, atol=1e-5)
    moved = max((x - params_before[p]).abs().max().item() for p, x in got.items())
    assert moved >= 0.5e-2  # the step moved the parameters, by about lr


@pytest.mark.parametrize(
    "name",
    [
        "qwen2",
        "qwen3_bias",
        "mistral_window",
        "phi3",
        "olmo2",
        "gemma2",
        "gemma3",
        "smollm3",
        "gpt_neox",
    ],
)
@pytest.mark.parametrize(
    ("mesh", "how"),
    [({"dp": 2, "tp": 2}, "zero3"), ({"pp": 2}, "pipeline"), ({"tp": 2}, "offload")],
    ids=["dp2xtp2_zero3", "pp2", "tp2_offload"],
)
def test_training_under_transforms_equals_one_device(name: str, mesh, how) -> None:
    module = FAMILIES[name][0]
    cfg, params = hf.from_hf(_hf(name, seed=3))
    batches = [_batch(10 + k, rows=4, length=8) for k in range(2)]
    ref = cf.train_step(module.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))

    def main(m: cf.Mesh):
        if how == "zero3":
            step = cf.zero(cf.shard(ref, m, plan=module.tp_plan), stage=3)
        elif how == "offload":  # each rank's tensor-parallel pieces homed on the host
            budget = "512KiB" if name in ("gemma2", "gemma3", "smollm3") else "256KiB"
            step = cf.offload(cf.shard(ref, m, plan=module.tp_plan), "host", budget)
        else:
            step = cf.pipeline(ref, 2, microbatches=2)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    for losses in cf.launch(main, mesh=mesh):
        assert len(losses) == len(batches)


@pytest.mark.parametrize(
    "name",
    [
        "qwen2",
        "qwen3_bias",
        "mistral",
        "mistral_window",
        "qwen2_window",
        "phi3_window",
        "olmo2",
        "gemma2",
        "gemma3",
        "smollm3",
        "gpt_neox",
        "gpt_neox_serial",
        "qwen2_mixed",
        "phi3_longrope",
        "phi3_partial",
    ],
)
def test_the_engine_gives_transformers_greedy_tokens_alone_and_under_tp(name: str) -> None:
    module = FAMILIES[name][0]
    model = _hf(name, seed=7)
    cfg, params = hf.from_hf(model)
    # the second prompt is longer than the windows, and the tokens run on past them
    prompts = [[1, 2, 3, 4], [50, 9, 30, 31, 32, 7, 7, 8, 40, 41, 2, 3]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(module, cfg, params, block_size=4, num_blocks=16)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want
    # preemption forced: the newest sequence is computed again mid-generation, from the full
    # blocks the prefix cache kept of it (where the model allows prefix caching)
    assert cf.testing.greedy_with_preemption(engine, prompts, greedy) == want
    assert engine.stats()["preemptions"] >= 1
    assert engine.stats()["prefix_hits"] > 0 or not engine.allocator.prefix_caching

    def main(mesh: cf.Mesh):
        engine = Engine(module, cfg, params, mesh=mesh, block_size=4, num_blocks=16)
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]

    for tokens in cf.launch(main, mesh={"tp": 2}):
        assert tokens == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_loads_back_and_a_bf16_folder_loads(name: str, tmp_path: Path) -> None:
    model = _hf(name, seed=4)
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert type(back) is type(model)
    for key, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    ids = _batch(4)["input_ids"]
    with torch.no_grad():
        diff = back(input_ids=ids).logits - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5
    assert hf.load(str(tmp_path / "out"), torch.float64)[0] == cfg
    hf.save(tmp_path / "bf16", cfg, params, dtype="bfloat16")
    cfg16, params16 = hf.load(str(tmp_path / "bf16"))
    assert cfg16 == cfg
    ours = dict(cf.tree.flatten_with_paths(params)[0])
    for path, x in cf.tree.flatten_with_paths(params16)[0]:
        assert x.dtype == torch.bfloat16, path
        assert torch.equal(x, ours[path].to(torch.bfloat16)), path


@pytest.mark.parametrize(
    ("name", "extra", "match"),
    [
        ("qwen3", {"hidden_act": "relu"}, "hidden_act='relu'"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_type='linear' on its sliding layers",
        ),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
        ("gpt_neox", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ],
)
def test_what_the_decoder_does_not_compute_is_refused_by_name(name, extra, match) -> None:
    model = _hf(name, **extra)
    with pytest.raises(ValueError, match=match):
        hf.from_hf(model)


def test_an_unknown_rope_type_in_a_folder_is_refused_by_name(tmp_path: Path) -> None:
    import json

    _hf("qwen2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "mystery", "factor": 2.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type='mystery' is not supported"):
        hf.read_config(str(tmp_path))


def test_family_configs_refuse_the_variations_they_do_not_have() -> None:
    with pytest.raises(ValueError, match=r"qwen2\.Config: Qwen 2 has q/k/v biases"):
        models.qwen2.Config(qkv_bias=False)
    with pytest.raises(ValueError, match=r"qwen3\.Config: Qwen 3 has q/k norms"):
        models.qwen3.Config(qkv_bias=True)
    with pytest.raises(ValueError, match=r"mistral\.Config: Mistral has no attention biases"):
        models.mistral.Config(qk_norm=True)
    with pytest.raises(ValueError, match=r"qwen2\.Config: qk_norm must be a bool"):
        models.qwen2.Config(qk_norm=1)
    with pytest.raises(ValueError, match=r"mistral\.Config: sliding_window must be None or an"):
        models.mistral.Config(sliding_window=0)
    with pytest.raises(ValueError, match=r"mistral\.Config: norm_style='post': not a variation"):
        models.mistral.Config(norm_style="post")
    with pytest.raises(ValueError, match=r"gemma2\.Config: Gemma 2 has sandwich norms"):
        models.gemma2.Config(norm_style="pre")
    with pytest.raises(ValueError, match=r"olmo2\.Config: OLMo 2 has post-norms"):
        models.olmo2.Config(qk_norm_width="head")
    with pytest.raises(ValueError, match=r"layer_types has sliding layers but sliding_window"):
        models.gemma3.Config(n_layer=2, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match=r"layer_types must be a tuple of n_layer=2"):
        models.gemma2.Config(n_layer=2, sliding_window=4, layer_types=("full_attention",))
    with pytest.raises(ValueError, match=r"nope_layers must be a tuple of layer indices in"):
        models.smollm3.Config(n_layer=2, nope_layers=(2,))
    with pytest.raises(ValueError, match=r"attn_softcap must be None or a number > 0"):
        models.gemma2.Config(attn_softcap=0.0)
    with pytest.raises(ValueError, match=r"gpt_neox\.Config: GPT-NeoX has LayerNorms"):
        models.gpt_neox.Config(norm_type="rms")
    with pytest.raises(ValueError, match=r"an even number of rotated dims >= 2; head_dim=32 x"):
        models.gpt_neox.Config(rotary_fraction=0.03)
    with pytest.raises(ValueError, match=r"mlp_bias with a gated MLP"):
        models.decoder.Config(mlp_bias=True)


def test_a_window_as_long_as_the_context_reads_as_none_and_the_window_round_trips() -> None:
    long = _hf("mistral", sliding_window=48)  # = max_position_embeddings
    assert hf.from_hf(long)[0].sliding_window is None
    cfg = hf.from_hf(_hf("qwen2_window"))[0]
    assert cfg.sliding_window == 6
    written = hf.hf_config(cfg)
    assert (written.use_sliding_window, written.sliding_window) == (True, 6)
    assert set(written.layer_types) == {"sliding_attention"}


def test_soft_capped_attention_is_the_written_out_formula() -> None:
    """Scores capped at ``c * tanh(s / c)`` before the mask, grouped-query heads, with and
    without a window; the paged op gives the same rows; a bad cap is refused by name."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 7, 4, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for window in (None, 3):
        got = cf.ops.attention(q, k, v, causal=True, window=window, softcap=2.0, scale=0.3)
        s = torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 2.0) * 2.0
        seen = (j <= i) & ((j > i - window) if window else True)
        want = s.masked_fill(~seen, float("-inf")).softmax(-1) @ vv
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the paged op: a prompt of 7 tokens in one prefill, nothing cached (scale 1/sqrt(4) = 0.5)
    q_NHE, k_NKE, v_NKE = (t[0].transpose(0, 1) for t in (q, k, v))
    empty = k_NKE.new_zeros(1, 8, 2, 4)
    batch = cf.ops.PagedBatch(torch.zeros(1, 1, dtype=torch.int32), (0,), (7,))
    paged = cf.ops.paged_attention(q_NHE, k_NKE, v_NKE, empty, empty, batch, softcap=2.0)
    plain = cf.ops.attention(q, k, v, causal=True, softcap=2.0)
    torch.testing.assert_close(paged, plain[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="softcap must be None or a number > 0, got -1"):
        cf.ops.attention(q, k, v, softcap=-1)


def test_the_window_masks_what_it_should() -> None:
    """Each query sees its last ``window`` keys, itself included; under a long-sequence frame a
    window is refused."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    got = cf.ops.attention(q, k, v, causal=True, window=3)
    scores = (q @ k.transpose(-1, -2)) / 2.0
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - 3)), float("-inf"))
    torch.testing.assert_close(got, scores.softmax(-1) @ v, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="window must be None or an int >= 1, got 0"):
        cf.ops.attention(q, k, v, causal=True, window=0)
    with pytest.raises(ValueError, match="a sliding window is for causal attention"):
        cf.ops.attention(q, k, v, causal=False, window=3)


def test_a_window_under_a_long_sequence_shard_is_refused_by_name() -> None:
    cfg, params = hf.from_hf(_hf("mistral_window", seed=5))
    step = cf.train_step(models.mistral.loss(cfg), optim.sgd(0.1))
    batch = _batch(5, rows=2, length=16)

    def main(mesh: cf.Mesh) -> None:
        s = cf.shard(step, mesh, sequence_parallel="ring")
        with pytest.raises(ValueError, match="sliding-window attention under a long-sequence"):
            s(s.init(params), batch)

    cf.launch(main, mesh={"sp": 2})


def test_a_sliding_window_gives_back_the_blocks_before_it() -> None:
    """Under a window of 5 tokens with blocks of 2, a sequence holds at most 5 blocks
    (ceil(5 / 2) + 2) however long it grows; with prefix caching on, a prompt served twice, two
    samples sharing a prompt, and preemptions forced by a small cache, the greedy tokens are
    still ``generate``'s."""
    model = _hf("mistral_window", seed=9)
    cfg, params = hf.from_hf(model)
    long = [(7 * i + 3) % 50 + 1 for i in range(30)]
    prompts = [long, long[:17], [4, 8, 15, 16, 23, 42, 4, 8]]
    want = cf.testing.hf_greedy(model, prompts, 12)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    engine = Engine(models.mistral, cfg, params, block_size=2, num_blocks=64)
    most = 0

    def watch() -> None:
        nonlocal most
        for seq in engine.scheduler.running:
            most = max(most, sum(b >= 0 for b in seq.blocks))

    for prompt, tokens in zip(prompts, want):
        engine.add_request(prompt, greedy, request_id=str(len(prompt)))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            watch()
        assert outs[0].outputs[0].token_ids == tokens
    assert 0 < most <= 5
    assert engine.stats()["blocks_used"] == 0  # every block given back, at the end too
    # preemptions, and the same tokens (two samples of the long prompt share its blocks)
    many = [[(5 * i + 11 * r) % 50 + 1 for i in range(8)] for r in range(6)]
    want_many = cf.testing.hf_greedy(model, many, 12)
    small = Engine(models.mistral, cfg, params, block_size=2, num_blocks=24, max_num_seqs=8)
    two = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    for r, prompt in enumerate(many):
        small.add_request(prompt, greedy, request_id=f"m{r}")
    small.add_request(long, two, request_id="long")
    done: dict[str, list[list[int]]] = {}
    for k in range(200):
        if not small.has_unfinished():
            break
        if k in (6, 9):  # preemption forced: the newest sequence, its windowed blocks given back
            small.scheduler.preempt(small.scheduler.running[-1])
        for o in small.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
    assert [done[f"m{r}"][0] for r in range(6)] == want_many
    assert done["long"] == [want[0], want[0]]
    assert small.stats()["preemptions"] == 2 and small.stats()["blocks_used"] == 0


def test_longrope_recomputes_a_sequence_that_grows_past_the_short_factors() -> None:
    """Phi-3's longrope in the engine, as ``transformers``' ``generate`` runs it: a sequence
    computed with the short factors is computed again, whole, with the long ones once it grows
    past ``original_max_position_embeddings`` (16 here); a prompt already past it runs long
    through a chunked prefill; no block is shared (prefix caching is off for such a model)."""
    model = _hf("phi3_longrope", seed=11)
    cfg, params = hf.from_hf(model)
    assert models.phi3.family.kv_cache(cfg, params).regime == 16
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [(3 * i + 1) % 50 + 1 for i in range(22)]]
    want = cf.testing.hf_greedy(model, prompts, 12)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(models.phi3, cfg, params, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    assert not engine.allocator.prefix_caching
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want
    # the first sequence crossed 16 tokens while decoding: computed again once
    assert engine.stats()["preemptions"] == 1


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_engines_from_hf_serves_each_family_from_its_folder(name: str, tmp_path: Path) -> None:
    """``engines.from_hf(FOLDER)`` (what ``colfunc serve --hf`` runs) reads each family's
    ``save_pretrained`` folder, picks the native family, and gives ``generate``'s greedy
    tokens."""
    from colfunc import engines

    model = _hf(name, seed=12)
    model.save_pretrained(tmp_path)
    engine = engines.from_hf(tmp_path, dtype=torch.float64, block_size=4, num_blocks=16)
    assert engine.model is FAMILIES[name][0]
    prompts = [[1, 2, 3, 4], [50, 9, 30, 31, 32, 7, 7, 8, 40, 41, 2, 3]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    assert got == cf.testing.hf_greedy(model, prompts, 8)
