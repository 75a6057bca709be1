"""The seed's example end to end: fine-tune OPT from a local Hugging Face folder under offload.

A tiny random OPT and a byte-level BPE tokenizer are written with ``save_pretrained``; the
example config (``examples/configs/opt_finetune_offload.py``) names the folder; ``colfunc train``
reads the model's config and weights and the folder's tokenizer, and trains under
``offload(policy="auto")``. The validation loss before the first step equals the loss that
``transformers`` computes for the same tokens (so the weights and the tokenizer were read as they
are), and training lowers it.
"""

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

    path = tmp_path_factory.mktemp("opt")
    fast = cf.testing.save_bpe_tokenizer(path, 300, "</s>")
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        vocab_size=len(fast),
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=256,
        word_embed_proj_dim=32,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.eos_token_id,
        pad_token_id=fast.eos_token_id,
    )
    transformers.OPTForCausalLM(cfg).save_pretrained(path)
    corpus = path / "corpus.txt"
    corpus.write_text(inspect.getsource(json) * 3)
    return path


def test_the_opt_example_fine_tunes_a_local_folder_under_offload(folder, tmp_path):
    import colfunc as cf
    from colfunc import hf
    from colfunc.inference.tokenizers import load_hf_tokenizer

    example = REPO / "examples" / "configs" / "opt_finetune_offload.py"
    sets = [
        f"data.corpus={folder / 'corpus.txt'}",
        "data.seq_len=32",
        "data.batch_size=2",
        "train.steps=6",
        "train.log_every=3",
        "train.eval_every=6",
        "train.eval_batches=2",
        "train.sample_tokens=4",
        f"train.out_dir={tmp_path}",
        "parallel.offload={'policy': 'auto', 'device_budget': '4MiB', 'margin': 0.5}",
    ]
    env = {**os.environ, "COLFUNC_HF_MODEL": str(folder), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "colfunc", "train", str(example), "--name", "run", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    # the loss before the first step is transformers' own loss on the same tokens
    want = cf.testing.hf_validation_loss(folder, 2, 32, batches=2)
    assert val[0] == pytest.approx(want, abs=1e-4)
    assert val[-1] < val[0]
    assert hf.read_config(f"hf:{folder}").n_layer == 2
    # serving the run speaks its tokenizer, not bytes
    tok = load_hf_tokenizer(folder)
    assert tok is not None
    from colfunc import engines
    from colfunc.inference import SamplingParams

    engine = engines.from_run(tmp_path / "run", max_num_seqs=2)
    text = "def f(x):\n    return x"
    assert engine.encode_prompt(text) == tok.encode(text)
    (out,) = engine.generate([text], SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == tok.encode(text) and len(out.outputs[0].token_ids) == 4


def test_a_missing_folder_is_named(tmp_path):
    from colfunc import hf

    with pytest.raises(ValueError, match=r"has no config\.json"):
        hf.read_config(f"hf:{tmp_path / 'nowhere'}")
