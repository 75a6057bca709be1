"""Fine-tune a local Gemma 3 text folder (``Gemma3ForCausalLM``: per-head q/k norms, a rotary
base for its sliding layers and another for its global ones) on one device whose memory is
smaller than the model: parameters, gradients and Adam moments in host memory, streamed to a
device budget (``cf.offload``, policy "auto").

    COLFUNC_HF_MODEL=path/to/gemma-3-1b colfunc train examples/configs/gemma3_finetune_offload.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "gemma3")

model = f"hf:{FOLDER}"
# no clipping: device-homed chunks (margin) are updated by the fused AdamW kernels themselves
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=4, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(offload=dict(policy="auto", device_budget="2GiB", margin=0.8), remat="full")
