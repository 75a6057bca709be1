"""The public op layer: attention, norms, cross-entropy and rotary embeddings.

Each op has a plain PyTorch reference (:mod:`colfunc.ops.reference`); model code calls the names
here, so faster implementations slot in without touching a model.
"""

from colfunc.ops.reference import attention, cross_entropy, layer_norm, rms_norm, rope

__all__ = ["attention", "cross_entropy", "layer_norm", "rms_norm", "rope"]
