"""Fine-tune a local Phi-3 mini folder (``Phi3ForCausalLM``: fused ``qkv_proj`` and
``gate_up_proj``, a sliding window) over tensor parallel 2 with Megatron's sequence parallelism.

    COLFUNC_HF_MODEL=path/to/phi-3-mini colfunc train examples/configs/phi3_finetune_tp.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded. Its ``longrope`` variants (128k context) are refused by name.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "phi3")

model = f"hf:{FOLDER}"
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=1.0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=8, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(tensor=dict(size=2, sequence_parallel=True))
