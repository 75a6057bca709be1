"""YaRN rotary scaling (Qwen 2.5's and many long-context folders') against ``transformers``.

Logits equal ``transformers``' within 1e-5 (fp32) for LLaMA and Qwen 2 folders whose
``rope_parameters`` are ``yarn`` (drawn factor, original context shorter than the prompts,
beta bounds, ``truncate``, an explicit ``attention_factor`` or the ``mscale`` pair); the settings
survive export; the engine's greedy tokens are ``generate``'s; a partial rotary yarn is refused by
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import hf, models
from colfunc.inference import Engine, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)


def _model(kind: str, rope: dict[str, Any], seed: int = 0) -> Any:
    config = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    cfg = config(
        vocab_size=61, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=24, num_hidden_layers=2, max_position_embeddings=96,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        rope_parameters=rope, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _yarn(factor: float, original: int, theta: float, **extra: Any) -> dict[str, Any]:
    return {
        "rope_type": "yarn", "rope_theta": theta, "factor": factor,
        "original_max_position_embeddings": original, **extra,
    }  # fmt: skip


@settings(max_examples=6, deadline=None)
@given(
    kind=st.sampled_from(["llama", "qwen2"]),
    factor=st.sampled_from([2.0, 4.0, 8.0]),
    original=st.sampled_from([8, 16, 32]),
    theta=st.sampled_from([10000.0, 1_000_000.0]),
    extra=st.sampled_from(
        [
            {},
            {"beta_fast": 16.0, "beta_slow": 2.0},
            {"truncate": False},
            {"attention_factor": 1.3},
            {"mscale": 1.0, "mscale_all_dim": 0.5},
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_yarn_logits_equal_transformers(kind, factor, original, theta, extra, seed) -> None:
    model = _model(kind, _yarn(factor, original, theta, **extra), seed=seed)
    cfg, params = hf.from_hf(model)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_seq_len) == (
        "yarn",
        factor,
        original,
    )
    module = models.of_config(cfg).module
    # prompts longer than the original context, so every frequency band is in play
    ids = torch.randint(1, 61, (2, 60), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = module.apply(params, ids, cfg)
    assert (got - want).abs().max().item() <= 1e-5


def test_yarn_survives_export_and_the_engine_gives_generates_tokens(tmp_path: Path) -> None:
    rope = _yarn(4.0, 16, 1_000_000.0, mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0)
    model = _model("qwen2", rope, seed=3)
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    written = back.config.rope_parameters
    assert (written["rope_type"], written["factor"], written["beta_fast"]) == ("yarn", 4.0, 16.0)
    assert (written["mscale"], written["mscale_all_dim"]) == (1.0, 0.5)
    assert hf.load(str(tmp_path / "out"))[0] == cfg
    ids = torch.randint(1, 61, (1, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() <= 1e-5
    prompts = [list(range(1, 40)), [5, 9, 2]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    engine = Engine(models.qwen2, cfg, params, block_size=4, num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want


def test_what_yarn_does_not_compute_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"yarn with partial_rotary_factor=0\.5"):
        hf.from_hf(_model("llama", _yarn(2.0, 16, 10000.0, partial_rotary_factor=0.5)))
    with pytest.raises(ValueError, match=r"the rope_\* fields: beta_fast must be > 0, got 0\.0"):
        models.llama.Config(rope_type="yarn", rope_factor=2.0, rope_beta_fast=0.0)
