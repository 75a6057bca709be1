"""Fine-tune a local SmolLM 3 folder (``SmolLM3ForCausalLM``: every fourth layer without rotary
positions, tied embeddings) over a pipeline of 2 stages (1F1B, 4 microbatches).

    COLFUNC_HF_MODEL=path/to/SmolLM3-3B colfunc train examples/configs/smollm3_finetune_pipeline.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "smollm3")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(pipeline=dict(stages=2, microbatches=4, schedule="1f1b"))
