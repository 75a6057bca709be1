"""The tiny GPT of gpt_tiny.py trained on a mesh of 4 ranks: data parallel 2 x tensor parallel 2
with sequence parallelism, ZeRO stage 2, bf16 autocast and full activation checkpointing.

    colfunc train examples/configs/gpt_tiny_parallel.py --set train.steps=50   # 4 threads
    colfunc run -n 4 train examples/configs/gpt_tiny_parallel.py              # 4 processes

The losses match those of gpt_tiny.py up to bf16 rounding; on one CPU this is a demonstration of
the layout, not a speed-up. A CPU without native bf16 (AVX2 only: no AVX512-BF16 or AMX)
emulates it, 10-20 s a step: there the example computes in fp32.
"""

from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import gpt
from colfunc.transforms.amp import bf16_is_native

model = gpt.Config(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128)
optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_norm=1.0, warmup_steps=50)
data = DataConfig(corpus="stdlib", batch_size=16, seq_len=128, seed=0)
train = TrainConfig(steps=300, log_every=10, eval_every=50, eval_batches=8)

parallel = dict(
    data=2,
    tensor=dict(size=2, sequence_parallel=True),
    zero=dict(stage=2),
    amp=dict(dtype="bf16" if bf16_is_native() else "fp32"),
    remat="full",
)
