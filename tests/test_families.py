"""Model families as registered adapters: a family added from outside ``colfunc/`` (here, in this
file) goes through ``hf.load``/``hf.save``, the run config and the engine, against
``transformers``, with no edit to colfunc.

The toy family is Mistral without a sliding window (LLaMA's computation) with a parameter tree of
its own (everything under ``"net"``), so that nothing on the way may assume the built-in
families' paths (``params["embed"]["tokens"]``). colfunc builds Mistral natively too
(:mod:`colfunc.models.mistral`): each test here sets that one aside, as a registry without it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

import colfunc as cf
from colfunc import config, engines, hf, models
from colfunc.inference import Engine, SamplingParams
from colfunc.models import Family, HFMapping, HFWeight, KVCacheSpec
from colfunc.models.family import require

transformers = pytest.importorskip("transformers")

llama = models.llama


# --- the family: all of it is in this block ----------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(llama.Config):
    """Mistral's sizes: LLaMA's, served without a sliding window."""


def _nest(params: Any) -> Any:
    return {"net": params}


def _param_shapes(cfg: MistralConfig) -> dict[str, tuple[int, ...]]:
    return {f"net.{p}": s for p, s in llama.param_shapes(cfg).items()}


def _init(cfg: MistralConfig, seed: int = 0, *, abstract: bool = False) -> Any:
    return _nest(llama.init(cfg, seed, abstract=abstract))


def _loss(cfg: MistralConfig) -> Any:
    inner = llama.loss(cfg)
    return lambda params, batch: inner(params["net"], batch)


def _paged_forward(params, tokens, batch, cache, cfg, select):  # type: ignore[no-untyped-def]
    return llama.paged_forward(params["net"], tokens, batch, cache, cfg, select)


def _weights(cfg: MistralConfig) -> tuple[list[HFWeight], list[HFWeight]]:
    top, layer = llama.family.hf.weights(cfg)  # the same names as LLaMA's, under "net."
    prefix = lambda es: [e._replace(paths=tuple(f"net.{p}" for p in e.paths)) for e in es]  # noqa: E731
    return prefix(top), prefix(layer)


def _read_config(c: Any) -> MistralConfig:
    require("Mistral", c, "sliding_window", (None,))
    base = llama.family.hf.read_config(c)
    return MistralConfig(**dataclasses.asdict(base))


def _write_config(cfg: MistralConfig) -> dict[str, Any]:
    return {**llama.family.hf.write_config(cfg), "sliding_window": None}


def _kv_cache(cfg: MistralConfig, params: Any) -> KVCacheSpec:
    return KVCacheSpec.like(
        params["net"]["embed"]["tokens"],
        layers=cfg.n_layer,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.d_model // cfg.n_head,
    )


mistral = types.SimpleNamespace(
    Config=MistralConfig,
    init=_init,
    loss=_loss,
    param_shapes=_param_shapes,
    paged_forward=_paged_forward,
    tp_plan={f"net.{p}": v for p, v in llama.tp_plan.items()},
)
FAMILY = Family(
    name="mistral_toy",
    module=mistral,
    config=MistralConfig,
    hf=HFMapping(
        architectures=("MistralForCausalLM",),
        model_type="mistral",
        weights=_weights,
        read_config=_read_config,
        write_config=_write_config,
    ),
    kv_cache=_kv_cache,
)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _the_first_families_only():
    """The registry as a user adding Mistral finds it when colfunc does not build Mistral: the
    native LLaMA-shaped families that also read these folders (``mistral``; the Qwens, Phi-3,
    OLMo 2, the Gemmas, SmolLM 3, GPT-NeoX and the mixtures of experts, for the registry's contents) step aside for each test, and
    come back after it."""
    native = ("mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "smollm3")
    native += ("gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
    aside = [models.unregister(name) for name in native]
    try:
        yield
    finally:
        for f in aside:
            models.register(f)


@pytest.fixture
def family():
    with models.registered(FAMILY) as f:
        yield f
    assert "mistral_toy" not in models.FAMILIES


def _hf_mistral(seed: int = 0, vocab: int = 97) -> Any:
    c = transformers.MistralConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    m = transformers.MistralForCausalLM(c).double().eval()
    with torch.no_grad():  # off the init: unit norms would hide a swapped norm weight
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def test_a_family_registered_outside_colfunc_round_trips_through_hf_and_the_engine(
    family, tmp_path
) -> None:
    m = _hf_mistral()
    m.save_pretrained(tmp_path / "in")
    cfg = hf.read_config(str(tmp_path / "in"))
    assert type(cfg) is MistralConfig and cfg.n_kv_heads == 2 and cfg.vocab_size == 97
    cfg, params = hf.load(str(tmp_path / "in"), dtype=torch.float64)
    assert set(params) == {"net"}
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits
    got = llama.apply(params["net"], ids, cfg)
    # transformers keeps the rotary frequencies in fp32 in an fp64 model: 3e-7 apart here
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # described and made one tensor at a time: the same values
    _, described = hf.load_abstract(str(tmp_path / "in"))
    made = cf.random.materialize(described)
    for (p, a), (_, b) in zip(
        cf.tree.flatten_with_paths(made)[0], cf.tree.flatten_with_paths(params)[0], strict=True
    ):
        assert torch.equal(a, b), p

    # out again: transformers loads the folder as the same Mistral
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64
    ).eval()
    assert type(back).__name__ == "MistralForCausalLM" and back.config.sliding_window is None
    want_state = m.state_dict()
    assert set(back.state_dict()) == set(want_state)
    for key, value in back.state_dict().items():
        assert torch.equal(value, want_state[key]), key
    with torch.no_grad():  # the weights are equal; the rotary tables are made anew (see above)
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=1e-5)

    # the engine: the cache from the family's spec, transformers' greedy tokens
    prompts = [[3, 5, 7], list(range(1, 18)), [40] * 9]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = engines.from_hf(tmp_path / "in", dtype=torch.float64, block_size=4)
    assert engine.cache["k"].shape[0] == 2 and engine.cache["k"].shape[3:] == (2, 8)
    assert engine.cache["k"].dtype == torch.float64
    got_tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    assert got_tokens == cf.testing.hf_greedy(m, prompts, 10)

    # and a run config names it
    default = config.default()
    data = dataclasses.replace(default.data, seq_len=32, tokenizer=f"hf:{tmp_path / 'in'}")
    run = dataclasses.replace(default, model=cfg, data=data)
    assert config.to_dict(run)["model"]["family"] == "mistral_toy"
    assert config.from_dict(config.to_dict(run)).model == cfg
    assert config.model_module(cfg) is mistral


def test_the_engine_under_tp_reads_the_family_spec(family) -> None:
    m = _hf_mistral(seed=2, vocab=96)  # the vocabulary splits over tp=2
    cfg, params = hf.from_hf(m)
    prompts = [[3, 5, 7, 9], [11] * 6]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = cf.testing.hf_greedy(m, prompts, 8)

    def main(mesh: cf.Mesh) -> list[list[int]]:
        engine = Engine(mistral, cfg, params, mesh=mesh, block_size=8)
        assert engine.cache["k"].shape[3] == 1  # this rank's one of the two kv heads
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]

    for got in cf.launch(main, mesh={"tp": 2}):
        assert got == want


def test_the_registry_refuses_clashes_and_names_what_is_registered() -> None:
    with pytest.raises(ValueError, match="family 'llama' already has the name 'llama'"):
        models.register(dataclasses.replace(FAMILY, name="llama"))
    with pytest.raises(ValueError, match="the config class Config"):
        models.register(dataclasses.replace(FAMILY, config=llama.Config))
    clash = dataclasses.replace(
        FAMILY, hf=dataclasses.replace(FAMILY.hf, architectures=("LlamaForCausalLM",))
    )
    with pytest.raises(ValueError, match="the architecture 'LlamaForCausalLM'"):
        models.register(clash)
    clash = dataclasses.replace(FAMILY, hf=dataclasses.replace(FAMILY.hf, model_type="gpt2"))
    with pytest.raises(ValueError, match="the model_type 'gpt2'"):
        models.register(clash)
    with pytest.raises(ValueError, match=r"no family named 'nope'.*'llama'"):
        models.unregister("nope")
    with pytest.raises(TypeError, match=r"register takes a colfunc\.models\.Family"):
        models.register(llama)  # type: ignore[arg-type]
    assert set(models.FAMILIES) == {"gpt", "llama", "opt", "dit", "transformers"}


def test_unregistered_configs_and_malformed_families_are_named(tmp_path_factory) -> None:
    # not registered: every edge names the registry
    cfg = MistralConfig(vocab_size=97, n_layer=1, n_head=2, d_model=16, max_seq_len=8)
    params = _init(cfg)
    with pytest.raises(TypeError, match=r"registered model family.*colfunc.models.register"):
        hf.to_hf(cfg, params)
    with pytest.raises(ValueError, match=r"model: expected the Config of a registered"):
        dataclasses.replace(config.default(), model=cfg)
    with pytest.raises(ValueError, match=r"reads MistralForCausalLM.*colfunc.models.register"):
        hf.from_hf(_hf_mistral(), model_impl="native")
    # (by default an architecture no family reads runs through its own module)
    assert isinstance(hf.from_hf(_hf_mistral())[0], models.hf_module.Config)
    with pytest.raises(ValueError, match="has no Hugging Face counterpart"):
        hf.hf_config(models.dit.Config.tiny())
    with (
        pytest.raises(TypeError, match="declares no KV cache"),
        models.registered(dataclasses.replace(FAMILY, kv_cache=None)),
    ):
        Engine(mistral, cfg, params)
    # a family is checked when it is declared
    with pytest.raises(TypeError, match="has no init"):
        Family(name="x", module=types.SimpleNamespace(loss=_loss), config=MistralConfig)
    with pytest.raises(TypeError, match="no paged_forward"):
        Family(
            name="x",
            module=types.SimpleNamespace(init=_init, loss=_loss, param_shapes=_param_shapes),
            config=MistralConfig,
            kv_cache=_kv_cache,
        )
    with pytest.raises(ValueError, match="name must be an identifier"):
        dataclasses.replace(FAMILY, name="a-b")
    with pytest.raises(ValueError, match="architectures must be a non-empty tuple"):
        dataclasses.replace(FAMILY.hf, architectures="MistralForCausalLM")
    with pytest.raises(ValueError, match="kv_heads must be an int >= 1"):
        KVCacheSpec(
            layers=1, kv_heads=0, head_dim=4, dtype=torch.float32, device=torch.device("cpu")
        )
    # a folder whose architecture no family reads: the folder, what it holds, what is read
    folder = tmp_path_factory.mktemp("mistral")
    _hf_mistral().save_pretrained(folder)
    with pytest.raises(ValueError, match=r"no registered model family reads.*'mistral'.*Llama"):
        hf.read_config(str(folder), model_impl="native")
