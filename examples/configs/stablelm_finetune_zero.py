"""Fine-tune a local StableLM folder (``StableLmForCausalLM``), which colfunc has no native
family for, through its own ``transformers`` module: ZeRO-3 over 2 data-parallel ranks with full
activation checkpointing. Any other causal LM whose layers all have the same parameters runs
the same way (see docs/checkpoints.md, "Any other architecture").

    COLFUNC_HF_MODEL=path/to/stablelm-2-1_6b colfunc train examples/configs/stablelm_finetune_zero.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "stablelm")

model = f"hf:{FOLDER}"
model_impl = "auto"  # a native family where colfunc has one, else the module; "hf" forces it
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(data=2, zero=3, remat="full")
