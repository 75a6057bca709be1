"""``colfunc export``: a trained run as a Hugging Face folder that ``transformers`` loads, its
logits equal to colfunc's, for GPT-2, LLaMA and OPT."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import colfunc as cf
from colfunc import checkpoint, config, models, optim
from colfunc import train as trainer
from colfunc.cli import main

transformers = pytest.importorskip("transformers")

MODELS = {
    "gpt": models.gpt.Config(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=16),
    "llama": models.llama.Config(
        vocab_size=256, n_layer=2, n_head=4, n_kv_heads=2, d_model=32, d_ff=48, max_seq_len=16
    ),
    "opt": models.opt.Config(
        vocab_size=256, n_layer=2, n_head=2, d_model=32, d_ff=48, max_seq_len=16
    ),
}


def _run(tmp_path: Path, kind: str) -> tuple[Path, config.RunConfig, cf.TrainState]:
    """A run folder whose checkpoint holds parameters after a few AdamW steps (so that no
    weight is at its initial value)."""
    base = config.default()
    cfg = dataclasses.replace(
        base, model=MODELS[kind], data=dataclasses.replace(base.data, seq_len=16)
    )
    module = config.model_module(cfg.model)
    step = cf.train_step(module.loss(cfg.model), optim.adamw(1e-2))
    state = step.init(module.init(cfg.model, seed=1))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        state, _ = step(state, {"input_ids": ids, "labels": ids})
    run = tmp_path / f"run-{kind}"
    checkpoint.commit(run / trainer.CHECKPOINTS, state.step, state, cfg)
    return run, cfg, state


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_exported_logits_equal_colfunc(tmp_path: Path, kind: str) -> None:
    run, cfg, state = _run(tmp_path, kind)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--hf", str(out)]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5))
    module = config.model_module(cfg.model)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        ours = module.apply(state.params, ids, cfg.model)
    assert theirs.dtype == torch.float32
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_export_casts_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _, state = _run(tmp_path, "gpt")
    out = tmp_path / "hf16"
    assert main(["export", "--run", str(run), "--hf", str(out), "--dtype", "bfloat16"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    wte = model.get_input_embeddings().weight
    assert torch.equal(wte, state.params["embed"]["tokens"].to(torch.bfloat16))
    capsys.readouterr()
    before = sorted(p.name for p in out.iterdir())
    assert main(["export", "--run", str(run), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not an empty folder; refusing to overwrite it" in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(["export", "--run", str(tmp_path / "nothing"), "--hf", str(tmp_path / "x")]) == 2
    assert "is not a run folder or a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_byte_level_run_exports_its_tokenizer_and_the_umask_modes(tmp_path: Path) -> None:
    """The folder of a byte-level run carries a tokenizer.json (token id = byte value) that
    transformers and the server load, so text prompts work on it; its files follow the umask."""
    import os

    from colfunc import engines
    from colfunc.generate import sample
    from colfunc.inference import SamplingParams

    run, cfg, state = _run(tmp_path, "gpt")
    out = tmp_path / "hf"
    old = os.umask(0o027)
    try:
        assert main(["export", "--run", str(run), "--hf", str(out)]) == 0
    finally:
        os.umask(old)
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o640, path.name
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "def f(x):\n    return x  # héllo"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode())
    engine = engines.from_hf(out, dtype=torch.float32)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    got = engine.generate(["def "], greedy)[0]
    assert got.prompt_token_ids == list(b"def ")
    ids = torch.tensor([list(b"def ")])
    want = sample(
        config.model_module(cfg.model).apply, state.params, cfg.model, ids[0], 6, temperature=0
    )
    assert got.outputs[0].token_ids == want[4:].tolist()
