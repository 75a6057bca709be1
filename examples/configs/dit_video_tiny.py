"""The tiny spatial-temporal DiT on the synthetic moving-shapes clips (rectified flow).

    colfunc train examples/configs/dit_video_tiny.py
    colfunc sample --run runs/dit_video_tiny-... --prompt "red square moving right"

Four 16x16 frames per clip, 2x2 patches, 4 layers of width 64; the caption's three words
(colour, shape, direction) condition every block through cross-attention, dropped one time in
ten for classifier-free guidance. At the end the run writes samples.gif, one clip per caption.
"""

from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import dit

model = dit.Config.tiny()
optim = OptimConfig(lr=2e-3, weight_decay=0.0, warmup_steps=100, final_lr=1e-4, clip_norm=1.0)
data = DataConfig(corpus="moving-shapes", batch_size=16)
train = TrainConfig(steps=2000, log_every=50, eval_every=250, eval_batches=2, sample_tokens=1)
