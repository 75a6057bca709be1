"""Scaled rotary embeddings (Llama 3.1's ``llama3``, ``linear``) against ``transformers`` (YaRN:
``test_rope_yarn.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc import hf, models, nn

transformers = pytest.importorskip("transformers")


def _llama(rope: dict[str, Any], *, max_pos: int = 96, vocab: int = 61, seed: int = 0) -> Any:
    """A random ``transformers`` Llama whose rope is ``rope`` (head dim 16: 8 frequencies)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=24, num_hidden_layers=2, max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        rope_parameters=rope, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
    return model.eval()


def _llama3(factor: float, low: float, high: float, original: int, theta: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": original,
    }  # fmt: skip


@settings(max_examples=6, deadline=None)
@given(
    factor=st.sampled_from([2.0, 8.0, 32.0]),
    low=st.sampled_from([1.0, 2.0]),
    high=st.sampled_from([4.0, 8.0]),
    original=st.sampled_from([8, 16, 32]),
    theta=st.sampled_from([500.0, 10000.0, 500000.0]),
    seed=st.integers(0, 2**16),
)
def test_llama3_scaling_matches_transformers(
    factor: float, low: float, high: float, original: int, theta: float, seed: int
) -> None:
    # prompts longer than the original context, so every frequency band is in play
    model = _llama(_llama3(factor, low, high, original, theta), seed=seed)
    cfg, params = hf.from_hf(model)
    assert isinstance(cfg, models.llama.Config)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_seq_len) == (
        "llama3",
        factor,
        original,
    )
    ids = torch.randint(0, 61, (2, 90), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = models.llama.apply(params, ids, cfg)
        ref = model(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= 1e-5


def test_the_three_bands_are_all_scaled_as_transformers_does() -> None:
    # theta 500000 over 8 frequencies with an original context of 64 puts wavelengths below
    # 64/4, between, and above 64/1: kept, interpolated, divided
    model = _llama(_llama3(8.0, 1.0, 4.0, 64, 500000.0))
    inv_freq_ref = model.model.rotary_emb.inv_freq
    wavelen = 2 * torch.pi * 500000.0 ** (torch.arange(0, 16, 2) / 16)  # unscaled
    assert (wavelen < 16).any() and (wavelen > 64).any() and ((wavelen > 16) & (wavelen < 64)).any()
    cfg, _ = hf.from_hf(model)
    cos, sin = nn.rope_tables(96, 16, cfg.rope_theta, None, cfg.rope_scaling)
    angle = torch.arange(96, dtype=torch.float32)[:, None] * inv_freq_ref[None, :]
    torch.testing.assert_close(cos, angle.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angle.sin(), rtol=0, atol=1e-6)
    unscaled, _ = nn.rope_tables(96, 16, cfg.rope_theta)
    assert not torch.allclose(unscaled, cos)  # the scaling changed the tables


def test_linear_scaling_matches_transformers() -> None:
    model = _llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    cfg, params = hf.from_hf(model)
    ids = torch.randint(0, 61, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = models.llama.apply(params, ids, cfg) - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5


def test_export_and_from_pretrained_keep_the_scaling(tmp_path: Path) -> None:
    model = _llama(_llama3(8.0, 1.0, 4.0, 32, 500000.0))
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "out", cfg, params)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(0, 61, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = loaded(input_ids=ids).logits - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5
    cfg2, _ = hf.load(str(tmp_path / "out"))
    assert cfg2 == cfg


def test_the_engine_decodes_with_the_scaled_tables() -> None:
    # the paged decode path takes its own tables at each token's position
    from colfunc.inference import Engine, SamplingParams

    model = _llama(_llama3(8.0, 1.0, 4.0, 16, 500000.0))
    cfg, params = hf.from_hf(model)
    prompt = torch.randint(1, 61, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(
            prompt[None], max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, 20:]
    engine = Engine("llama", cfg, params, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (out,) = engine.generate([prompt.tolist()], greedy)
    assert out.outputs[0].token_ids == ref.tolist()


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        (
            {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "factor": 2.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 32,
            },
            "rope_type='longrope'",
        ),
    ],
)
def test_rope_types_not_built_are_refused_by_name(rope: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf.from_hf(_llama(rope))


def test_dynamic_scaling_is_the_default_within_the_context() -> None:
    """Dynamic NTK changes the base only past ``max_position_embeddings``, which colfunc's
    models never reach: the logits equal ``transformers``' and the type is kept for export."""
    model = _llama({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    cfg, params = hf.from_hf(model)
    assert cfg.rope_type == "dynamic"
    ids = torch.randint(0, 61, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = models.llama.apply(params, ids, cfg) - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5
    assert hf.hf_config(cfg).rope_parameters["rope_type"] == "dynamic"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rope_type": "ntk"}, "type='ntk' is not built"),
        ({"rope_type": "linear", "rope_factor": 0.0}, "factor must be > 0"),
        (
            {"rope_type": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0},
            "high_freq_factor > low_freq_factor",
        ),
    ],
)
def test_the_config_checks_its_rope_fields(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"llama.Config: the rope_\\* fields: .*{match}"):
        models.llama.Config(**fields)
