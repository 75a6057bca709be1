"""The default run of `colfunc train`, spelled out: a tiny byte-level GPT-2 on the Python
standard library's own sources, in under 3 minutes on 2 CPU cores.

    colfunc train examples/configs/gpt_tiny.py --set train.steps=100
"""

from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import gpt

# 4 layers, 4 heads, width 128, context 128, 256 byte values: about 0.8M parameters.
model = gpt.Config(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128)

optim = OptimConfig(
    lr=3e-3,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    clip_norm=1.0,
    warmup_steps=50,
    final_lr=0.0,
)

data = DataConfig(corpus="stdlib", val_fraction=0.05, batch_size=16, seq_len=128, seed=0)

train = TrainConfig(
    steps=300,
    log_every=10,
    eval_every=50,
    eval_batches=8,
    seed=0,
    name="",
    out_dir="runs",
    sample_prompt="def ",
    sample_tokens=200,
)

# The parallel layout (mesh and transforms); empty: one device.
parallel: dict = {}
