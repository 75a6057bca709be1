"""A decoding step of the shared decoder's layers on the CPU as direct calls of the compiled
kernels (:func:`layers`), for :func:`colfunc.models.decoder.paged_forward`.

A step of a few tokens spends little in arithmetic: each layer's weights are read once, and
the rest is the cost of reaching the kernels, operator by operator, through the generic
layer (each :func:`colfunc.nn.linear`, :func:`colfunc.ops.rms_norm` and
:func:`colfunc.ops.paged_attention` checks its tensors, the scan slices every parameter). Here
the layers' tensors are checked once per step, and each layer is the same kernels in the same
order on the same operands (RMSNorm, the q/k/v products, the rotation, the paged attention,
the output product, the residual, the MLP), so the result is the generic layer's, bit for bit.
A step where every sequence brings one token (decoding) calls the decode attention kernel
directly; a step with prompts in it calls :func:`colfunc.ops.paged_attention`, as the generic
layer does.

It runs where the model is the plain pre-norm decoder on plain fp32 CPU tensors with no frame on the stack (no LoRA, no tensor
parallelism, no transform): RMSNorm (any offset), grouped-query attention with full rotary
embeddings and optional biases, no q/k norms, windows, soft caps or custom scale, a dense MLP
(gated or not, any activation), the same kind of layer throughout. Anything else returns None
and the caller runs the generic layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from colfunc import core, nn, ops, torch_private
from colfunc.ops import cpu_attention, cpu_rows
from colfunc.ops.dispatch import kernels_choice
from colfunc.ops.values import PagedBatch

__all__ = ["layers", "takes"]

Params = dict[str, Any]


def takes(cfg: Any) -> bool:
    """Whether the configuration is the plain decoder this path computes."""
    return (
        cfg.norm_type == "rms"
        and cfg.norm_style == "pre"
        and not cfg.parallel_residual
        and not cfg.n_experts
        and not cfg.qk_norm
        and cfg.sliding_window is None
        and cfg.attn_softcap is None
        and cfg.attn_scale_dim is None
        and not cfg.per_layer
        and cfg.rotary_dim == cfg.head_dim
    )


def _plain(blocks: Params) -> list[tuple[str, str, torch.Tensor]] | None:
    """Every stacked layer parameter, where each is a plain contiguous fp32 CPU tensor that
    wants no gradient; else None."""
    grad = torch.is_grad_enabled()
    leaves = []
    for part, group in blocks.items():
        if not isinstance(group, dict):
            return None
        for name, t in group.items():
            if type(t) is not torch.Tensor or t.dtype != torch.float32 or t.device.type != "cpu":
                return None
            if not t.is_contiguous() or (grad and t.requires_grad):
                return None
            leaves.append((part, name, t))
    return leaves


def layers(
    blocks: Params,
    x_1ND: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    batch: PagedBatch,
    cache: dict[str, torch.Tensor],
    cfg: Any,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """The hidden state after every layer and the new keys and values (``[L, N, K, E]``), as
    the generic scan of ``_block_kv`` computes them; None where this path does not apply."""
    N, D = x_1ND.shape[1], x_1ND.shape[2]
    if N == 0 or not (takes(cfg) and kernels_choice() == "auto"):
        return None
    if type(x_1ND) is not torch.Tensor or x_1ND.dtype != torch.float32 or core.frames():
        return None
    if torch_private.are_functorch_transforms_active() or set(cache) != {"k", "v"}:
        return None
    leaves = _plain(blocks)
    ext = cpu_rows._linear_extension()
    k_cache, v_cache = cache["k"], cache["v"]
    cos, sin = (t.to(torch.float32).contiguous() for t in rope)
    tables = batch.block_tables
    if leaves is None or ext is None or not cpu_attention.supports(x_1ND, x_1ND, x_1ND,
                                                                 k_cache[0], v_cache[0], tables):  # fmt: skip
        return None
    if cos.shape != (N, cfg.head_dim // 2) or not x_1ND.is_contiguous():
        return None
    L, C, B, K, E = k_cache.shape
    H, M = cfg.n_head, tables.shape[1]
    contexts = list(batch.context_lens)
    tables = cpu_attention.checked_tables(tables, contexts, C, B)  # (once for every layer)
    per_layer = {(part, name): t.unbind(0) for part, name, t in leaves}
    threads = torch.get_num_threads()
    few = N <= cpu_rows.MAX_ROWS
    decoding = set(batch.query_lens) == {1}  # (every sequence one token: row s is sequence s)
    seqs = list(range(N))
    gated = "w_gate" in blocks["mlp"]  # (nn.gated takes no biases)

    def linear(
        x: torch.Tensor, part: str, name: str, i: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = per_layer[(part, name)][i]
        b = per_layer.get((part, "b" + name[1:])) if not gated or part != "mlp" else None
        b_i = b[i] if b is not None else None
        if not few:  # (what nn.linear runs for as many rows)
            y = nn.linear(x, w, b_i)
            return y if out is None else out.copy_(y)
        y = out if out is not None else x.new_empty(N, w.shape[1])
        ext.linear(y.data_ptr(), x.data_ptr(), w.data_ptr(), 0 if b_i is None else b_i.data_ptr(),  # type: ignore[attr-defined]
                   N, w.shape[0], w.shape[1], False, threads)  # fmt: skip
        return y

    def norm(x: torch.Tensor, part: str, i: int) -> torch.Tensor:
        w = per_layer[(part, "weight")][i]
        if cfg.norm_offset:
            w = w + cfg.norm_offset
        out = torch.empty_like(x)
        ext.rms_norm(out.data_ptr(), x.data_ptr(), w.data_ptr(), N, D, float(cfg.norm_eps),  # type: ignore[attr-defined]
                     False, threads)  # fmt: skip
        return out

    def rotate(x: torch.Tensor, heads: int, out: torch.Tensor) -> torch.Tensor:
        ext.rope(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), N * heads, heads,  # type: ignore[attr-defined]
                 N, E, False, threads)  # fmt: skip
        return out

    ys = {"k": x_1ND.new_empty(L, N, K, E), "v": x_1ND.new_empty(L, N, K, E)}
    x = x_1ND[0]
    for i in range(L):
        h = norm(x, "ln1", i)
        q = rotate(linear(h, "attn", "wq", i), H, x.new_empty(N, H, E))
        k = rotate(linear(h, "attn", "wk", i), K, ys["k"][i])
        v = linear(h, "attn", "wv", i, ys["v"][i].view(N, K * E)).view(N, K, E)
        if decoding:
            y = torch.empty(N, H, E)
            ext.paged_decode(y.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),  # type: ignore[attr-defined]
                             k_cache[i].data_ptr(), v_cache[i].data_ptr(), tables.data_ptr(),
                             seqs, seqs, contexts, H, K, E, B, M, False, E**-0.5, 0, 0.0,
                             threads)  # fmt: skip
        else:  # (prompts too: the op, which runs the decoding ones by the same kernel)
            y = ops.paged_attention(q, k, v, k_cache[i], v_cache[i], batch)
        x = x + linear(y.view(N, H * E), "attn", "wo", i)
        h = norm(x, "ln2", i)
        if gated:
            m = activation(linear(h, "mlp", "w_gate", i)) * linear(h, "mlp", "w_up", i)
            x = x + linear(m, "mlp", "w_down", i)
        else:
            x = x + linear(activation(linear(h, "mlp", "w_in", i)), "mlp", "w_out", i)
    return x[None], ys
