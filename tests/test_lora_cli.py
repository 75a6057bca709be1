"""LoRA from the command line: ``colfunc train`` on a Hugging Face folder with a ``lora`` section
(QLoRA's NF4 base under offload), then ``colfunc export --peft`` (which peft loads, giving the
logits colfunc gives) and ``--hf --merge`` (which ``transformers`` loads, giving the same)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    import transformers

    import colfunc as cf

    path = tmp_path_factory.mktemp("llama")
    fast = cf.testing.save_bpe_tokenizer(path, 300, "</s>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
        pad_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "corpus.txt").write_text(inspect.getsource(json) * 3)
    return path


def _common(folder: Path, tmp_path: Path, *more: str) -> list[str]:
    """Short runs at a constant learning rate (a longer run does not change it), rank 2."""
    sets = [
        f"data.corpus={folder / 'corpus.txt'}", "data.seq_len=32", "data.batch_size=2",
        "train.eval_every=2", "train.eval_batches=1", "train.sample_tokens=0",
        f"train.out_dir={tmp_path}", "optim.lr=1e-2", "optim.final_lr=1e-2",
        "optim.warmup_steps=0", "lora.rank=2", *more,
    ]  # fmt: skip
    return [a for s in sets for a in ("--set", s)] + ["--no-progress"]


def _same_runs(a: Path, b: Path) -> None:
    """The two runs end at step 4 with bit-identical parameters."""
    from colfunc import train, tree

    x_state, _ = train.load_run(a)
    y_state, _ = train.load_run(b)
    assert x_state.step == y_state.step == 4
    xs, ys = tree.flatten_with_paths(x_state.params)[0], tree.flatten_with_paths(y_state.params)[0]
    for (p, x), (_, y) in zip(xs, ys):
        assert torch.equal(x, y), p
    assert tree.paths(x_state.opt_state) == tree.paths(y_state.opt_state)


def _colfunc(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "colfunc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=cwd)


def test_train_export_peft_and_merged(folder, tmp_path) -> None:
    import peft
    import transformers

    from colfunc import adapters, checkpoint, config, hf, models, train, tree

    example = REPO / "examples" / "configs" / "llama_lora.py"
    env = {**os.environ, "COLFUNC_HF_MODEL": str(folder), "HF_HUB_OFFLINE": "1"}
    sets = [
        f"data.corpus={folder / 'corpus.txt'}", "data.seq_len=32", "data.batch_size=2",
        "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=1",
        "train.sample_tokens=4", f"train.out_dir={tmp_path}", "optim.lr=1e-2",
        "lora.rank=4", "lora.base_dtype='nf4'",
        "parallel.offload={'policy': 'auto', 'device_budget': '4MiB'}",
    ]  # fmt: skip
    args = ["train", str(example), "--name", "run", "--no-progress"]
    for s in sets:
        args += ["--set", s]
    out = _colfunc(*args, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "in rank-4 adapters trained" in out.stdout
    run = tmp_path / "run"
    state, cfg = train.load_run(run)
    lora = config.lora_config(cfg.lora)
    assert lora.base_dtype == "nf4" and lora.rank == 4
    flat = dict(tree.flatten_with_paths(state.params)[0])
    assert any(p.endswith(".nf4") for p in flat)  # the base, in 4 bits
    # the checkpoint holds the adapters and their moments, not the base (made again from
    # the folder): a small fraction of the folder's weights
    raw, _ = checkpoint.load_shard(train.checkpoint_path(run), 0)  # (one rank: dp 1)
    assert tree.paths(raw.params) and all(adapters.is_adapter(p) for p in tree.paths(raw.params))
    saved = sum(f.stat().st_size for f in (run / "checkpoints").rglob("*") if f.is_file())
    adapter_bytes = sum(x.numel() * x.element_size() for p, x in flat.items() if ".lora." in p)
    assert saved < 3 * adapter_bytes + 64 * 1024, (saved, adapter_bytes)  # (and two moments)
    assert sum(float(x.abs().sum()) for p, x in flat.items() if p.endswith(".b")) > 0  # trained
    ids = torch.randint(
        0, cfg.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = adapters.call(lora, models.llama.apply, state.params, ids, cfg.model)

    # the adapters alone, as peft reads them; on the base as colfunc computed it (the NF4
    # base dequantized, written as a transformers folder) peft gives colfunc's logits
    done = _colfunc("export", "--run", str(run), "--peft", str(tmp_path / "ad"), cwd=tmp_path,
                    env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["base_model_name_or_path"] == f"hf:{folder}"
    zero_b = tree.map_with_path(lambda p, x: x * 0 if p.endswith(".b") else x, state.params)
    hf.save(tmp_path / "dq", cfg.model, adapters.merge(zero_b, lora))
    pm = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dq"), tmp_path / "ad"
    )
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ours, rtol=0, atol=1e-4)

    # the merged model, which transformers loads
    assert (
        _colfunc(
            "export", "--run", str(run), "--hf", str(tmp_path / "m"), cwd=tmp_path, env=env
        ).returncode
        == 2
    )  # (adapters: --merge or --peft, said in one line)
    done = _colfunc("export", "--run", str(run), "--hf", str(tmp_path / "m"), "--merge",
                    cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=ids).logits, ours, rtol=0, atol=1e-4)


def test_a_lora_run_resumes_exactly_and_a_bad_section_is_one_line(folder, tmp_path, capsys) -> None:
    """Four steps at once equal two, a checkpoint (adapters and their moments) and two more
    (at a constant learning rate, which a longer run does not change);
    a ``lora`` section with an unknown key or a bad value exits 2 with one line."""
    from colfunc.cli import main

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common = [*_common(folder, tmp_path), "--threads", "1"]
    example = str(REPO / "examples" / "configs" / "llama_lora.py")
    os.environ["COLFUNC_HF_MODEL"] = str(folder)
    try:
        assert main(["train", example, "--name", "whole", "--set", "train.steps=4", *common]) == 0
        assert main(["train", example, "--name", "cut", "--set", "train.steps=2", *common]) == 0
        assert main(["train", "--resume", str(tmp_path / "cut"), "--set", "train.steps=4",
                     "--no-progress", "--threads", "1"]) == 0  # fmt: skip
        capsys.readouterr()
        assert main(["train", example, "--set", "lora.ranks=2", *common]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lora: unknown key 'ranks'" in err[0], err
        assert main(["train", example, "--set", "lora.base_dtype='fp3'", *common]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "base_dtype must be None or one of" in err[0], err
    finally:
        del os.environ["COLFUNC_HF_MODEL"]
    _same_runs(tmp_path / "whole", tmp_path / "cut")


def test_a_parallel_lora_run_saves_shards_of_its_adapters_and_resumes_exactly(
    folder, tmp_path
) -> None:
    """Under dp=2 with ZeRO-3 each rank's shard holds its pieces of the adapters and their
    moments only; four steps at once equal two, the shards, and two more (the same layout)."""
    from colfunc import adapters, checkpoint, train, tree
    from colfunc.cli import main

    more = ("parallel.data=2", "parallel.zero=3", "parallel.offload=None", "parallel.remat='none'")
    common = _common(folder, tmp_path, *more)
    example = str(REPO / "examples" / "configs" / "llama_lora.py")
    os.environ["COLFUNC_HF_MODEL"] = str(folder)
    try:
        assert main(["train", example, "--name", "whole", "--set", "train.steps=4", *common]) == 0
        assert main(["train", example, "--name", "cut", "--set", "train.steps=2", *common]) == 0
        shards = list((tmp_path / "cut" / "checkpoints").rglob("rank-*.safetensors"))
        assert len(shards) == 2
        for rank in range(2):  # each rank's pieces of the adapters (and moments), no base
            raw, _ = checkpoint.load_shard(train.checkpoint_path(tmp_path / "cut"), rank)
            assert all(adapters.is_adapter(p) for p in tree.paths(raw.params))
        assert main(["train", "--resume", str(tmp_path / "cut"), "--set", "train.steps=4",
                     "--no-progress"]) == 0  # fmt: skip
    finally:
        del os.environ["COLFUNC_HF_MODEL"]
    _same_runs(tmp_path / "whole", tmp_path / "cut")
