"""A tiny byte-level LLaMA (RMSNorm, rotary positions, SwiGLU, 2 key/value heads for 4 query
heads) on the Python standard library's own sources.

    colfunc train examples/configs/llama_tiny.py
"""

from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import llama

model = llama.Config(
    vocab_size=256, n_layer=4, n_head=4, n_kv_heads=2, d_model=128, max_seq_len=128
)

optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_norm=1.0, warmup_steps=50)

data = DataConfig(corpus="stdlib", batch_size=16, seq_len=128)

train = TrainConfig(steps=300, eval_every=50)
