"""A deeper tiny GPT (12 layers of gpt_tiny.py's width) with its model states offloaded
(cf.offload, policy "auto"): parameters, gradients and Adam moments (38 MB) in host memory,
streamed to a device budget of 48 MiB that must also hold the activations (full activation
checkpointing keeps those to a layer's worth).

    colfunc train examples/configs/gpt_tiny_offload.py --set train.steps=50

On a machine without a GPU the CPU stands for the device: the run shows the placement and its
account (offload/device_peak_bytes stays within the budget), not a speed-up. The losses match
the same model's in-memory run up to the CPU Adam's rounding.
"""

from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import gpt

model = gpt.Config(vocab_size=256, n_layer=12, n_head=4, d_model=128, max_seq_len=128)
# no clipping: device-homed chunks (margin) are updated by the fused AdamW kernels themselves
optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_norm=0, warmup_steps=50)
data = DataConfig(corpus="stdlib", batch_size=16, seq_len=128, seed=0)
train = TrainConfig(steps=300, log_every=10, eval_every=50, eval_batches=8)

parallel = dict(offload=dict(policy="auto", device_budget="48MiB", margin=0.5), remat="full")
