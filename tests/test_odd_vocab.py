"""Vocabularies that the tensor-parallel axis does not divide: GPT-2's 50257 tokens over ``tp=2``.

The embedding (and an untied head) split the vocabulary in ``torch.chunk`` pieces, 25129 + 25128
rows: the vocab-parallel lookup, the logits and the cross-entropy follow each rank's range, so
there is no padding row to keep out of the loss, the samples or an export. Training equals one
device in fp64 under ``tp=2`` and ``dp2 x tp2`` (and drawn compositions with ZeRO, sequence
parallelism and remat); the engine under ``tp=2`` gives ``transformers``' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import hf, models, optim
from colfunc.inference import Engine, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

GPT2_VOCAB = 50257


def _problem(model, cfg, *, seed: int = 0, batch: int = 4, steps: int = 2):
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=seed))
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g)
        # ids at both ends of the vocabulary, so both ranks' rows are looked up and predicted
        ids[:, 0], ids[:, 1] = 0, cfg.vocab_size - 1
        labels = ids.clone()
        labels[:, :2] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return params, batches


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_gpt2_vocabulary_trains_under_tp_equal_to_one_device(mesh) -> None:
    cfg = models.gpt.Config(
        vocab_size=GPT2_VOCAB, n_layer=2, n_head=2, d_model=8, d_ff=16, max_seq_len=8
    )
    params, batches = _problem(models.gpt, cfg)
    ref = cf.train_step(models.gpt.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))

    def main(m: cf.Mesh):
        step = cf.shard(ref, m, plan=models.gpt.tp_plan)
        state = step.init(params)
        table = state.params["embed"]["tokens"]
        local_rows = cf.transforms.local.local_piece(table).shape[0]
        losses = cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)
        return local_rows, losses

    out = cf.launch(main, mesh=mesh)
    rows = sorted({r for r, _ in out})
    assert rows == [25128, 25129]  # an uneven split, no padding row
    for _, losses in out:
        assert len(losses) == len(batches)


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(["gpt", "llama", "opt"]),
    vocab=st.integers(33, 61).filter(lambda v: v % 2 or v % 4),
    composition=cf.testing.compositions(
        st.sampled_from([{"dp": 1, "tp": 2}, {"dp": 2, "tp": 2}, {"dp": 1, "tp": 4}]),
        remat_policies=("none", "full"),
    ),
)
def test_odd_vocabularies_under_drawn_compositions(name, vocab, composition) -> None:
    model = getattr(models, name)
    sizes = dict(vocab_size=vocab, n_layer=2, n_head=4, d_model=16, max_seq_len=8)
    cfg = model.Config(**sizes, n_kv_heads=4) if name == "llama" else model.Config(**sizes)
    params, batches = _problem(model, cfg, seed=vocab)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    mesh = composition["mesh"]

    def main(m: cf.Mesh):
        step = cf.testing.compose(ref, m, composition, plan=model.tp_plan)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    cf.launch(main, mesh=mesh)


def test_the_engine_under_tp_gives_transformers_greedy_tokens_and_exports_whole(tmp_path) -> None:
    torch.manual_seed(0)
    c = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=8, vocab_size=GPT2_VOCAB, n_positions=32, eos_token_id=0
    )
    m = transformers.GPT2LMHeadModel(c).double().eval()
    with torch.no_grad():  # off the init, so that the greedy tokens vary
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    cfg, params = hf.from_hf(m)
    prompts = [[1, 2, 3], [50256, 50000, 7], [25128, 25129] * 3]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = cf.testing.hf_greedy(m, prompts, 8)
    chosen = {t for w in want for t in w}
    assert min(chosen) < 25128 and max(chosen) >= 25129  # tokens from both ranks' rows

    def main(mesh: cf.Mesh):
        engine = Engine(models.gpt, cfg, params, mesh=mesh, block_size=4, num_blocks=32)
        tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
        whole = cf.full_state(engine.params)  # gathered: the table has every row, no more
        return tokens, whole

    for tokens, whole in cf.launch(main, mesh={"tp": 2}):
        assert tokens == want
        assert whole["embed"]["tokens"].shape == (GPT2_VOCAB, 8)
    hf.save(tmp_path / "out", cfg, whole)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert back.config.vocab_size == GPT2_VOCAB
    assert torch.equal(back.transformer.wte.weight, m.transformer.wte.weight)
