"""Fine-tune a local Qwen 2 / Qwen 2.5 folder (``Qwen2ForCausalLM``) on one device whose memory
is smaller than the model: parameters, gradients and Adam moments in host memory, streamed to a
device budget (``cf.offload``, policy "auto").

    COLFUNC_HF_MODEL=path/to/qwen2.5-0.5b colfunc train examples/configs/qwen2_finetune_offload.py

The folder is what ``save_pretrained`` writes (``config.json``, safetensors, its tokenizer);
nothing is downloaded.
"""

import os

from colfunc.config import DataConfig, OptimConfig, TrainConfig

FOLDER = os.environ.get("COLFUNC_HF_MODEL", "qwen2")

model = f"hf:{FOLDER}"
# no clipping: device-homed chunks (margin) are updated by the fused AdamW kernels themselves
optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_norm=0, warmup_steps=20, final_lr=1e-6)
data = DataConfig(corpus="stdlib", tokenizer=f"hf:{FOLDER}", batch_size=4, seq_len=256, seed=0)
train = TrainConfig(steps=200, log_every=10, eval_every=50, eval_batches=4)

parallel = dict(offload=dict(policy="auto", device_budget="2GiB", margin=0.8), remat="full")
