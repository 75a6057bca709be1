"""Fine-tune a local Starcoder2 folder (``Starcoder2ForCausalLM``) through its own
``transformers`` module, split over 2 tensor-parallel ranks by the config's own
``base_model_tp_plan`` (q/k/v and the MLP's input column-parallel, the output projections
row-parallel).

    COLFUNC_HF_MODEL=path/to/starcoder2-3b colfunc train examples/configs/starcoder2_finetune_tp.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "starcoder2")

model = f"hf:{FOLDER}"
model_impl = "hf"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(tensor=2)
