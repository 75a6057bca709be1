"""Fine-tune a local OLMo 2 folder (``Olmo2ForCausalLM``: norms after each sub-layer, q/k norms
over all heads) on 4 ranks: data parallel 2 x tensor parallel 2.

    COLFUNC_HF_MODEL=path/to/olmo-2-1b colfunc train examples/configs/olmo2_finetune_tp.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "olmo2")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(data=2, tensor=2)
