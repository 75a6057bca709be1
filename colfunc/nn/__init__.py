"""Pure functional layers: tensors and parameter dicts in, tensors out.

Weights are stored ``[in, out]`` and applied as ``x @ w``; a layer's parameters are a plain dict
(``{"wq": ..., "bq": ...}``), so a model is a composition of these functions over a pytree. None of
them knows about meshes: run on sharded tensors, or on local shards inside a manual region, they
compute the same thing, because head counts are inferred from the weights' sizes and the head dim.
"""

from colfunc.nn.attention import (
    ROPE_TYPES,
    AttentionOptions,
    Paged,
    PagedBatch,
    RopeScaling,
    attend,
    merge_heads,
    paged_scan,
    paged_self_attention,
    rope_tables,
    self_attention,
    split_heads,
)
from colfunc.nn.dense import embedding, linear, unembed
from colfunc.nn.feedforward import gated, gelu_tanh, mlp, swiglu
from colfunc.nn.lm import (
    batch_field,
    causal_lm_loss,
    check_input_ids,
    nest,
    next_token_loss,
    next_token_targets,
)
from colfunc.nn.lowrank import LowRank, LowRanks, column_norms
from colfunc.nn.moe import Routing, load_balancing_loss, route, sparse_mlp
from colfunc.nn.plans import tensor_plans

__all__ = [
    "ROPE_TYPES",
    "AttentionOptions",
    "LowRank",
    "LowRanks",
    "Paged",
    "PagedBatch",
    "RopeScaling",
    "Routing",
    "attend",
    "batch_field",
    "causal_lm_loss",
    "check_input_ids",
    "column_norms",
    "embedding",
    "gated",
    "gelu_tanh",
    "linear",
    "load_balancing_loss",
    "merge_heads",
    "mlp",
    "nest",
    "next_token_loss",
    "next_token_targets",
    "paged_scan",
    "paged_self_attention",
    "rope_tables",
    "route",
    "self_attention",
    "sparse_mlp",
    "split_heads",
    "swiglu",
    "tensor_plans",
    "unembed",
]
