"""A head dim other than ``d_model / n_head`` (Qwen 3, Gemma, Llama folders with ``head_dim``).

q/k/v are ``n_head * head_dim`` wide, the output projection maps that back to ``d_model``, and
the attention scale is ``1/sqrt(head_dim)``: logits (1e-5) and gradients equal ``transformers``' in
fp32; the
folder exports and loads back; training under tensor and data parallelism equals one device
(fp64 AdamW, 1e-9); the engine, alone and under ``tp=2``, gives ``transformers``' greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import hf, models, optim
from colfunc.inference import Engine, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)


def _hf(
    head_dim: int,
    *,
    hidden: int = 24,
    heads: int = 4,
    kv: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=53, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=48,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@settings(max_examples=5, deadline=None)
@given(
    head_dim=st.sampled_from([2, 4, 10, 16]),
    heads_kv=st.sampled_from([(4, 2), (4, 4), (2, 1)]),
    seed=st.integers(0, 2**16),
)
def test_logits_and_gradients_equal_transformers(head_dim, heads_kv, seed) -> None:
    heads, kv = heads_kv
    # fp32, as transformers computes its loss and rotary tables in fp32 whatever the weights
    model = _hf(head_dim, heads=heads, kv=kv, seed=seed, dtype=torch.float32)
    cfg, params = hf.from_hf(model)
    assert cfg.head_dim == head_dim and cfg.d_model == 24
    ids = torch.randint(0, 53, (2, 20), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    params = cf.tree.map(lambda x: x.detach().requires_grad_(), params)
    ours = models.llama.loss(cfg)(params, {"input_ids": ids, "labels": labels})
    ours.backward()
    with torch.no_grad():
        logits = models.llama.apply(params, ids, cfg)
    assert (logits - ref.logits).abs().max().item() <= 1e-5
    assert abs(ours.item() - ref.loss.item()) <= 1e-5
    layer = model.model.layers[1].self_attn
    for ours_g, ref_g in [
        (params["blocks"]["attn"]["wq"].grad[1], layer.q_proj.weight.grad.T),
        (params["blocks"]["attn"]["wk"].grad[1], layer.k_proj.weight.grad.T),
        (params["blocks"]["attn"]["wo"].grad[1], layer.o_proj.weight.grad.T),
    ]:
        torch.testing.assert_close(ours_g, ref_g, rtol=1e-4, atol=1e-6)


def test_export_loads_back_with_its_head_dim(tmp_path: Path) -> None:
    model = _hf(10)
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert back.config.head_dim == 10
    ids = torch.randint(0, 53, (1, 30), generator=torch.Generator().manual_seed(1))
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    # the same weights; transformers makes its rotary tables anew on load (in its own precision)
    with torch.no_grad():
        diff = back(input_ids=ids).logits - model(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5
    assert hf.load(str(tmp_path / "out"), torch.float64)[0] == cfg


@pytest.mark.parametrize(
    "mesh", [{"dp": 1, "tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2_zero3"]
)
def test_training_under_tensor_parallelism_equals_one_device(mesh) -> None:
    cfg = models.llama.Config(
        vocab_size=37, n_layer=2, n_head=4, n_kv_heads=2, d_model=12, head_dim=6, max_seq_len=8
    )
    params = cf.tree.map(lambda x: x.double(), models.llama.init(cfg, seed=3))
    assert params["blocks"]["attn"]["wq"].shape == (2, 12, 24)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 37, (4, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    ref = cf.train_step(models.llama.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))

    def main(m: cf.Mesh):
        step = cf.zero(cf.shard(ref, m, plan=models.llama.tp_plan), stage=3)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    for losses in cf.launch(main, mesh=mesh):
        assert len(losses) == len(batches)


def test_the_engine_gives_transformers_greedy_tokens_alone_and_under_tp() -> None:
    model = _hf(16, hidden=24, heads=4, kv=2, seed=7)
    cfg, params = hf.from_hf(model)
    prompts = [[1, 2, 3, 4], [50, 9, 30, 31, 32, 7, 7]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(models.llama, cfg, params, block_size=4, num_blocks=16)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want

    def main(mesh: cf.Mesh):
        engine = Engine(models.llama, cfg, params, mesh=mesh, block_size=4, num_blocks=16)
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]

    for tokens in cf.launch(main, mesh={"tp": 2}):
        assert tokens == want


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"d_model": 10, "n_head": 4}, "n_head=4 must divide d_model=10 \\(or give head_dim\\)"),
        ({"head_dim": 5}, "even head dim; head_dim=5"),
        ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
    ],
)
def test_head_dims_that_cannot_work_are_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        models.llama.Config(**fields)
