"""Scaled dot-product attention (the fused kernels F.scaled_dot_product_attention picks, and
their backward), split over the batch or over heads.

Every 4-D (``[B, H, T, E]``, masks) and 3-D (``[B, H, T]``, the saved log-sum-exp) tensor is
split alike on dim 0 (batch) or dim 1 (heads), broadcast dims of size 1 replicated; other
arguments and outputs (RNG state, sequence offsets) are replicated. A head split needs whole
key/value groups per rank under grouped-query attention: the chunks of the ``H`` query heads must
be those of the ``K`` key/value heads times ``H / K``, which holds when ``K`` is divisible by the
axis size.
"""

from __future__ import annotations

from typing import Any

import torch

import colfunc.ops.dispatch  # noqa: F401  (registers torch.ops.colfunc.paged_attention)
from colfunc.sharding.placement import Placement, Shard, dim_chunks
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule
from colfunc.torch_private import pytree_module as pytree

aten = torch.ops.aten


def _split(s: Spec, dim: int) -> Placement:
    return Shard(dim) if s.ndim in (3, 4) and s.shape[dim] > 1 else R


def _heads_align(q: Spec, kv: Spec, k: int) -> bool:
    H, K = q.shape[1], kv.shape[1]
    return [(o * (H // K), s * (H // K)) for o, s in dim_chunks(K, [k])] == dim_chunks(H, [k])


def _attention_rule(
    n_out: int, n_split: int, q_at: int = 0, grad_bias_at: int | None = None
) -> Any:
    """A rule for an op whose first ``n_split`` of ``n_out`` outputs are split like the inputs;
    the query and key are the tensor arguments at ``q_at`` and ``q_at + 1``. Where the op also
    returns the gradient of a bias (positional argument ``grad_bias_at``), it runs replicated: a
    broadcast bias's gradient would need a sum over the split."""

    def attention(*args: Any, **kwargs: Any) -> OpSharding:
        specs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Spec)]
        q, k = specs[q_at], specs[q_at + 1]
        mesh = q.mesh
        outs = lambda p: (p,) * n_split + (R,) * (n_out - n_split)  # noqa: E731
        opts: list[Option] = [(outs(R), [R] * len(specs))]
        if grad_bias_at is None or not isinstance(args[grad_bias_at], Spec):
            opts.append((outs(Shard(0)), [_split(s, 0) for s in specs]))
            sizes = {mesh.axis_size(a) for a in mesh.axis_names}
            if all(_heads_align(q, k, n) for n in sizes):
                opts.append((outs(Shard(1)), [_split(s, 1) for s in specs]))
        return pick(specs, opts)

    return attention


# CPU
rule(aten._scaled_dot_product_flash_attention_for_cpu)(_attention_rule(2, 2))
rule(aten._scaled_dot_product_flash_attention_for_cpu_backward)(_attention_rule(3, 3, q_at=1))
# CUDA: flash, memory-efficient and cuDNN kernels (outputs after the first two: RNG state,
# sequence offsets)
rule(aten._scaled_dot_product_flash_attention)(_attention_rule(9, 2))
rule(aten._scaled_dot_product_flash_attention_backward)(_attention_rule(3, 3, q_at=1))
rule(aten._scaled_dot_product_efficient_attention)(_attention_rule(4, 2))
rule(aten._scaled_dot_product_efficient_attention_backward)(
    _attention_rule(4, 3, q_at=1, grad_bias_at=4)
)
rule(aten._scaled_dot_product_cudnn_attention)(_attention_rule(9, 2))
rule(aten._scaled_dot_product_cudnn_attention_backward)(_attention_rule(3, 3, q_at=1))


@rule(torch.ops.colfunc.paged_attention.default)
def paged_attention(
    q: Spec, k: Spec, v: Spec, k_cache: Spec, v_cache: Spec, tables: Spec, *lens: Any
) -> OpSharding:
    """Heads split alike: the queries ``[N, H, E]``, the new keys and values ``[N, K, E]`` and the
    caches ``[C, B, K, E]`` on their head dims, the block tables whole; else all whole."""
    per_axis: list[Option] = [(R, (R, R, R, R, R, R))]
    mesh_k = [q.mesh.axis_size(a) for a in q.mesh.axis_names]
    if all(_heads_align_3d(q, k, n) for n in mesh_k):
        heads = (Shard(1), Shard(1), Shard(1), Shard(2), Shard(2), R)
        per_axis.insert(0, (Shard(1), heads))
    return pick([q, k, v, k_cache, v_cache, tables], per_axis)


def _heads_align_3d(q: Spec, kv: Spec, n: int) -> bool:
    H, K = q.shape[1], kv.shape[1]
    if K % n:
        return False
    return [(o * (H // K), s * (H // K)) for o, s in dim_chunks(K, [n])] == dim_chunks(H, [n])
