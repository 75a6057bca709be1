"""The public op layer: attention (also over a paged KV cache), norms, cross-entropy, rotary
embeddings and fused AdamW, and the values their backends take (:class:`AdamWHyper`,
:class:`PagedBatch`).

Model and optimizer code call the names here. Each op runs its Triton kernel on CUDA tensors and
its plain PyTorch reference (:mod:`colfunc.ops.reference`) elsewhere; ``COLFUNC_KERNELS=auto|
triton|torch`` overrides the choice at call time (see :mod:`colfunc.ops.dispatch`).
:func:`cpu_adamw_` updates optimizer states offloaded to host memory with a C++ kernel.
"""

from colfunc.ops import reference
from colfunc.ops.cpu_adam import cpu_adamw_
from colfunc.ops.dispatch import (
    adamw_,
    attention,
    attention_block,
    attention_block_backward,
    attention_lse,
    cross_entropy,
    dequantize_nf4,
    layer_norm,
    paged_attention,
    rms_norm,
    rope,
    varlen_attention,
)
from colfunc.ops.moe import grouped_matmul, moe_ffn
from colfunc.ops.values import AdamWHyper, PagedBatch

__all__ = [
    "AdamWHyper",
    "PagedBatch",
    "adamw_",
    "attention",
    "attention_block",
    "attention_block_backward",
    "attention_lse",
    "cpu_adamw_",
    "cross_entropy",
    "dequantize_nf4",
    "grouped_matmul",
    "layer_norm",
    "moe_ffn",
    "paged_attention",
    "reference",
    "rms_norm",
    "rope",
    "varlen_attention",
]
