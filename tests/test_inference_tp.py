"""Tensor-parallel inference: ``Engine(..., mesh={"tp": 2})`` gives the tokens of one device.

Each rank holds its shards of the model's tensor-parallel plan (heads, MLP width, vocabulary) and
its heads of the KV cache; the paged attention op runs on local heads under its own sharding rule,
so nothing falls back to gathering. Threads and gloo processes, GPT-2 and LLaMA with grouped-query
attention (2 key/value heads over tp=2).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import colfunc as cf
from colfunc import hf
from colfunc.inference import Engine, SamplingParams
from colfunc.sharding import distribute
from colfunc.sharding.placement import Shard

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 2, 3], list(range(5, 25)), [7] * 9, [40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LAYOUT = {"block_size": 4, "num_blocks": 40, "max_num_batched_tokens": 16}


def _hf(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        c = transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=96, n_positions=64, eos_token_id=0
        )
        m = transformers.GPT2LMHeadModel(c)
    else:
        c = transformers.LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=96,
            max_position_embeddings=64,
        )
        m = transformers.LlamaForCausalLM(c)
    m = m.double().eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _model(kind: str):
    return hf.from_hf(_hf(kind))


def _generate(kind: str, built, mesh=None):
    cfg, params = built
    engine = Engine(getattr(cf.models, kind), cfg, params, mesh=mesh, **LAYOUT)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _on_rank(mesh):
    """Importable, for gloo: each process builds the same models (seeded) and compares."""
    out = {}
    for kind in ("gpt", "llama"):
        built = _model(kind)
        out[kind] = (_generate(kind, built, mesh), _generate(kind, built))
    return out, cf.sharding.fallback_counts(mesh)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tensor_parallel_engine_on_threads_equals_one_device(kind) -> None:
    m = _hf(kind)
    built = hf.from_hf(m)  # built once: the ranks are threads sharing the global RNG
    want = _generate(kind, built)
    assert cf.testing.hf_greedy(m, PROMPTS, 10) == want  # one device is transformers' greedy

    def main(mesh):
        return _generate(kind, built, mesh), cf.sharding.fallback_counts(mesh)

    for got, fallbacks in cf.launch(main, mesh={"tp": 2}):
        assert got == want
        assert fallbacks == {}


def test_tensor_parallel_engine_on_gloo_processes_equals_one_device() -> None:
    for out, fallbacks in cf.launch(_on_rank, mesh={"tp": 2}, backend="gloo", timeout=240):
        for kind, (tp, single) in out.items():
            assert tp == single, kind
        assert fallbacks == {}


def test_a_mesh_the_model_cannot_split_is_refused() -> None:
    built = _model("llama")

    def main(mesh):
        with pytest.raises(ValueError, match="not divisible by tp=4"):
            Engine(cf.models.llama, *built, mesh=mesh)
        with pytest.raises(ValueError, match="one axis 'tp'"):
            Engine(cf.models.llama, *built, mesh=cf.Mesh({"dp": 4}, mesh.rank, world=mesh.world))
        return True

    assert all(cf.launch(main, mesh={"tp": 4}))


def test_advanced_indexing_keeps_other_splits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, dtype=torch.float64, generator=g)
    idx = torch.tensor([[5, 0], [2, 2]])

    def main(mesh):
        outs = []
        for dim in (0, 2):
            xs = distribute(x, mesh, {"tp": Shard(dim)})
            got = xs[:, idx]
            outs.append(((got.full_tensor() - x[:, idx]).abs().max().item(), got.placements))
        return outs, cf.sharding.fallback_counts(mesh)

    for outs, fallbacks in cf.launch(main, mesh={"tp": 2}):
        assert outs == [(0.0, (Shard(0),)), (0.0, (Shard(3),))]
        assert fallbacks == {}
