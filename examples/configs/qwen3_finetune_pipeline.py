"""Fine-tune a local Qwen 3 folder (``Qwen3ForCausalLM``, dense) on 4 ranks: a pipeline of 2
stages (1F1B, 8 microbatches) x data parallel 2, ZeRO stage 1.

    COLFUNC_HF_MODEL=path/to/qwen3-0.6b colfunc train examples/configs/qwen3_finetune_pipeline.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "qwen3")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.1, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=16, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(data=2, pipeline=dict(stages=2, microbatches=8, schedule="1f1b"), zero=1)
