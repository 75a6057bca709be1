"""Attention over a paged KV cache for a packed batch: decode and (chunked) prefill in one kernel.

One program per (packed query token, query head) streams the keys its token sees with an online
softmax (FlashAttention's running max and sum, in base 2): first the sequence's cached tokens,
block by block through its row of the block table (vLLM's PagedAttention, Kwon et al. 2023), then
the new tokens of its own sequence up to itself (under a sliding window, from the first block the
window reaches; scores soft-capped where asked). A decode step is one query token per sequence; a
prefill chunk of ``n`` tokens is ``n`` programs per head over the same blocks, which makes this
also a variable-length (``cu_seqlens``) causal attention when the cache is empty.

Legend: N packed tokens, H query heads, K key/value heads, G = H / K, E head dim, C cache blocks,
B block size (slots), S sequences, M blocks per sequence.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks
from colfunc.ops.values import PagedBatch

__all__ = ["paged_attention"]

INTERPRETED = checks.interpreting()  # how the kernel below was decorated (read once, at import)
LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax(m_i, l_i, acc_D, q_D, k_ND, v_ND, valid, qk_scale, softcap):  # fmt: skip
    """One tile of keys and values (``[N, D]``, ``valid`` rows) folded into the running max
    ``m_i``, sum ``l_i`` and output ``acc_D`` of a query row, in base 2. ``softcap`` > 0: the
    scaled scores capped at ``softcap * tanh(s / softcap)`` first (``qk_scale`` is then the
    plain scale, and log2(e) is applied after the cap)."""
    s_N = tl.sum(k_ND * q_D[None, :], axis=1) * qk_scale
    if softcap > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), stable at both ends
        s_N = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s_N / softcap) + 1.0)) * 1.4426950408889634
    s_N = tl.where(valid, s_N, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_N, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a tile the window masks whole)
    alpha = tl.exp2(m_i - m_safe)
    p_N = tl.exp2(s_N - m_safe)
    l_i = l_i * alpha + tl.sum(p_N, axis=0)
    acc_D = acc_D * alpha + tl.sum(p_N[:, None] * v_ND, axis=0)
    return m_new, l_i, acc_D


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr,  # q, out [N, H, E]; k, v [N, K, E]; caches
    tables_ptr, seq_ptr, ctx_ptr, start_ptr,  # [S, M] int32; per token its sequence; per sequence
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cc, stride_cb, stride_ck, stride_vcc, stride_vcb, stride_vck,
    stride_tm, stride_on, stride_oh,
    qk_scale,  # softmax scale times log2(e) (without a cap; with one, the scale alone)
    softcap,  # > 0: the scores soft-capped
    window,  # > 0: each token sees its last `window` tokens, itself included
    G: tl.constexpr,  # query heads per key/value head
    BLOCK: tl.constexpr,  # cache block size
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # head dim, padded to a power of two
    BLOCK_N: tl.constexpr,  # new tokens per iteration
):  # fmt: skip
    n = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    s = tl.load(seq_ptr + n)
    ctx = tl.load(ctx_ptr + s)
    first = tl.load(start_ptr + s)
    j = n - first  # this token's index among its sequence's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    q_D = tl.load(q_ptr + n * stride_qn + h * stride_qh + offs_d, mask=dmask, other=0.0)
    q_D = q_D.to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc_D = tl.zeros((BLOCK_D,), tl.float32)
    offs_b = tl.arange(0, BLOCK)
    lowest = 0  # the first position this token sees (its window's, or the sequence's start)
    if window > 0:
        lowest = tl.maximum(ctx + j - window + 1, 0)
    # the cached tokens, a block at a time, from the first block the window reaches (the
    # blocks before it may have been given back)
    for start in range((lowest // BLOCK) * BLOCK, ctx, BLOCK):
        block = tl.load(tables_ptr + s * stride_tm + start // BLOCK)
        valid = ((start + offs_b) < ctx) & ((start + offs_b) >= lowest)
        mask = valid[:, None] & dmask[None, :]
        k_BD = tl.load(
            kc_ptr + block * stride_cc + offs_b[:, None] * stride_cb + kh * stride_ck
            + offs_d[None, :], mask=mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        v_BD = tl.load(
            vc_ptr + block * stride_vcc + offs_b[:, None] * stride_vcb + kh * stride_vck
            + offs_d[None, :], mask=mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        m_i, l_i, acc_D = _online_softmax(
            m_i, l_i, acc_D, q_D, k_BD, v_BD, valid, qk_scale, softcap
        )
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, j + 1, BLOCK_N):  # the new tokens of this sequence, up to this one
        t = start + offs_n
        valid = (t <= j) & ((ctx + t) >= lowest)
        mask = valid[:, None] & dmask[None, :]
        rows = first + t
        k_ND = tl.load(
            k_ptr + rows[:, None] * stride_kn + kh * stride_kh + offs_d[None, :],
            mask=mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        v_ND = tl.load(
            v_ptr + rows[:, None] * stride_vn + kh * stride_vh + offs_d[None, :],
            mask=mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        m_i, l_i, acc_D = _online_softmax(
            m_i, l_i, acc_D, q_D, k_ND, v_ND, valid, qk_scale, softcap
        )
    out_D = acc_D / l_i
    tl.store(
        out_ptr + n * stride_on + h * stride_oh + offs_d,
        out_D.to(out_ptr.dtype.element_ty),
        mask=dmask,
    )


def paged_attention(
    q_NHE: torch.Tensor,
    k_NKE: torch.Tensor,
    v_NKE: torch.Tensor,
    k_cache_CBKE: torch.Tensor,
    v_cache_CBKE: torch.Tensor,
    batch: PagedBatch,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The contract of :func:`colfunc.ops.reference.paged_attention` (scale ``1/sqrt(E)``, a
    sliding ``window``, soft-capped scores), on tensors whose last dim is contiguous. Raises
    ValueError for inputs the kernel does not take, before launching. Forward only: inference
    needs no gradient."""
    block_tables_SM, context_lens, query_lens = (
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
    )
    args = (q_NHE, k_NKE, v_NKE, k_cache_CBKE, v_cache_CBKE, block_tables_SM)
    checks.paged_attention(*args[:5], batch)
    checks.device("paged_attention", *args, interpreted=INTERPRETED)
    q, k, v, kc, vc = (t if t.stride(-1) == 1 else t.contiguous() for t in args[:5])
    N, H, E = q.shape
    K, B = k.shape[1], kc.shape[1]
    device = q.device
    lens = torch.tensor(list(query_lens), dtype=torch.int32, device=device)
    seq_N = torch.repeat_interleave(torch.arange(len(query_lens), device=device), lens)
    starts = torch.zeros(len(query_lens), dtype=torch.int32, device=device)
    starts[1:] = torch.cumsum(lens, 0)[:-1]
    ctx = torch.tensor(list(context_lens), dtype=torch.int32, device=device)
    tables = block_tables_SM.contiguous()
    out = torch.empty_like(q)
    _paged_attention_kernel[(N, H)](
        q, k, v, kc, vc, out,
        tables, seq_N.to(torch.int32), ctx, starts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        (1.0 if softcap else LOG2E) / math.sqrt(E), float(softcap or 0.0), int(window or 0),
        G=H // K, BLOCK=B, HEAD_DIM=E, BLOCK_D=triton.next_power_of_2(E), BLOCK_N=16,
    )  # fmt: skip
    return out
