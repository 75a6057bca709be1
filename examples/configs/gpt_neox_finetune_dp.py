"""Fine-tune a local GPT-NeoX or Pythia folder (``GPTNeoXForCausalLM``: parallel residual, a
quarter of each head rotated) on 2 data-parallel ranks with full activation checkpointing.

    COLFUNC_HF_MODEL=path/to/pythia-410m colfunc train examples/configs/gpt_neox_finetune_dp.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "pythia")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(data=2, remat="full")
