"""Each family's fine-tuning example (``examples/configs/*_finetune_*.py``) on a tiny local folder.

A tiny random ``transformers`` model of the family and a byte-level BPE tokenizer are written
with ``save_pretrained``; the example config names the folder (``COLFUNC_HF_MODEL``), is loaded
as ``colfunc train`` loads it, shrunk by ``--set`` overrides, and trained for a few steps with its
own ``parallel`` section (threads). The first validation loss equals ``transformers``' loss on the
same tokens (so the folder's weights and tokenizer were read as they are), and training lowers
the training loss. Each folder is also served over HTTP (the app ``colfunc serve --hf`` runs):
the openai client's greedy completions, streamed or not, are the engine's own.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

import colfunc as cf
from colfunc import config, train

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
SIZES = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
EXAMPLES = {
    "mistral_finetune_zero.py": ("MistralConfig", {"sliding_window": 16}),
    "qwen2_finetune_offload.py": ("Qwen2Config", {}),
    "qwen3_finetune_pipeline.py": ("Qwen3Config", {"head_dim": 8}),
    "phi3_finetune_tp.py": ("Phi3Config", {"sliding_window": 16}),
    "gemma2_finetune_zero.py": (
        "Gemma2Config",
        {"head_dim": 8, "sliding_window": 16, "attn_logit_softcapping": 5.0},
    ),
    "gemma3_finetune_offload.py": (
        "Gemma3TextConfig",
        {
            "head_dim": 8,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "olmo2_finetune_tp.py": ("Olmo2Config", {}),
    "smollm3_finetune_pipeline.py": ("SmolLM3Config", {"no_rope_layers": [1, 0]}),
    "gpt_neox_finetune_dp.py": ("GPTNeoXConfig", {}),
}
# what shrinks each example to this machine and a few steps (its parallel layout kept)
SHRINK = {
    "qwen2_finetune_offload.py": [
        "parallel.offload={'policy': 'auto', 'device_budget': '1MiB', 'margin': 0.5}"
    ],
    "qwen3_finetune_pipeline.py": [
        "data.batch_size=8",
        "parallel.pipeline={'stages': 2, 'microbatches': 2, 'schedule': '1f1b'}",
    ],
    "gemma3_finetune_offload.py": [
        "parallel.offload={'policy': 'auto', 'device_budget': '1MiB', 'margin': 0.5}"
    ],
    "smollm3_finetune_pipeline.py": [
        "parallel.pipeline={'stages': 2, 'microbatches': 2, 'schedule': '1f1b'}",
    ],
}


def _folder(root: Path, config_class: str, extra: dict) -> Path:
    fast = cf.testing.save_bpe_tokenizer(root, 300, "</s>")
    eos = fast.eos_token_id
    c = getattr(transformers, config_class)(
        **SIZES,
        **extra,
        vocab_size=len(fast) + 7,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(c).save_pretrained(root)
    (root / "corpus.txt").write_text(inspect.getsource(json) * 2)
    return root


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_family_example_fine_tunes_a_local_folder(example, tmp_path, monkeypatch) -> None:
    config_class, extra = EXAMPLES[example]
    folder = _folder(tmp_path / "model", config_class, extra)
    monkeypatch.setenv("COLFUNC_HF_MODEL", str(folder))
    sets = [
        f"data.corpus={folder / 'corpus.txt'}",
        "data.seq_len=32",
        "train.steps=4",
        "train.log_every=2",
        "train.eval_every=4",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "optim.warmup_steps=0",
        "optim.lr=3e-3",
        *SHRINK.get(example, []),
    ]
    cfg = config.load(REPO / "examples" / "configs" / example, sets)
    assert type(cfg.model).__module__ == f"colfunc.models.{example.split('_finetune')[0]}"
    train.run(cfg, tmp_path / "run", progress=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    # the loss before the first step is transformers' own loss on the same tokens
    want = cf.testing.hf_validation_loss(folder, cfg.data.batch_size, 32)
    assert val[0] == pytest.approx(want, abs=1e-4)
    assert len(losses) >= 2 and losses[-1] < losses[0]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_family_is_served_over_http(example, tmp_path) -> None:
    """``colfunc serve --hf``'s app on each family's folder: the openai client's greedy
    completion (text in, text out, through the folder's tokenizer) equals the engine's own, and
    a streamed one equals it too."""
    import openai
    from test_server import NAME, Served

    from colfunc import engines
    from colfunc.inference import SamplingParams

    config_class, extra = EXAMPLES[example]
    folder = _folder(tmp_path / "model", config_class, extra)
    want = (
        engines.from_hf(folder)
        .generate(["def main():"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    served = Served(folder)
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=NAME, prompt="def main():", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
        assert client.completions.create(**kw).choices[0].text == want
        stream = client.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    finally:
        served.stop()
