"""Fine-tune OPT from a local Hugging Face folder under cf.offload (policy "auto"), as the
seed's example did: parameters, gradients and Adam moments in host memory, streamed to a device
budget, with the folder's own tokenizer cutting the corpus.

    COLFUNC_HF_MODEL=path/to/opt-125m colfunc train examples/configs/opt_finetune_offload.py

The folder is what ``save_pretrained`` writes (``config.json`` and safetensors, and its
tokenizer); nothing is downloaded. GPT-2 and LLaMA folders work the same way.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "opt-125m")

model = f"hf:{FOLDER}"  # its config and its weights
# no clipping: device-homed chunks (margin) are updated by the fused AdamW kernels themselves
optim = OptimConfig(lr=5e-5, weight_decay=0.0, clip_norm=0, warmup_steps=20, final_lr=5e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=4, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4, sample_prompt="def ")

parallel = dict(offload=dict(policy="auto", device_budget="2GiB", margin=0.8), remat="full")
