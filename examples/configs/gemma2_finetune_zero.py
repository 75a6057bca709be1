"""Fine-tune a local Gemma 2 folder (``Gemma2ForCausalLM``: sandwich norms, soft-capped attention
and logits, sliding layers between global ones) on 2 data-parallel ranks with ZeRO stage 2 and
bf16 mixed precision.

    COLFUNC_HF_MODEL=path/to/gemma-2-2b colfunc train examples/configs/gemma2_finetune_zero.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "gemma2")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(data=2, zero=dict(stage=2), amp="bf16")
