"""Flash attention, forward and backward, with grouped-query heads and a bottom-right causal mask.

FlashAttention-2 (Dao, 2023): each program owns a block of query rows and streams the keys past
it, keeping a running max and sum of the softmax (the "online softmax"), so the T×S score matrix
never exists in memory. The forward saves one log-sum-exp per query row; the backward recomputes
the probabilities from it, one program per key block for dK, dV (looping over the query heads that
share that key/value head, so grouped-query attention needs no atomics) and one per query block
for dQ. The softmax runs in base 2: ``exp2`` is one instruction, and the scale absorbs ``log2(e)``.

Legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per key/value head,
T query length, S key length, D head dim; M rows of a query block, N rows of a key block.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks

__all__ = ["attention", "attention_block", "attention_block_backward", "attention_lse"]

INTERPRETED = checks.interpreting()  # how the kernels below were decorated (read once, at import)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _autotune(gpu_configs: list[triton.Config], key: list[str]) -> Any:
    """Autotune over ``gpu_configs`` on a GPU; one small config in the interpreter, which cannot
    time several (and runs fastest on small blocks)."""
    if INTERPRETED or not torch.cuda.is_available():
        return triton.autotune(configs=[triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})], key=key)
    return triton.autotune(configs=gpu_configs, key=key)


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


@triton.jit
def _cap(s, softcap, CAPPED: tl.constexpr):
    """Scores in log2 units: ``s`` (already times log2(e)), or with ``CAPPED`` the plain scaled
    ``s`` capped at ``softcap * tanh(s / softcap)`` then times log2(e); and the cap's
    derivative ``1 - tanh^2`` (1 without one), which the backward passes multiply by."""
    if CAPPED:  # tanh(x) = 1 - 2 / (exp(2x) + 1), stable at both ends
        t = 1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)
        return softcap * t * 1.4426950408889634, 1.0 - t * t
    return s, 1.0


@triton.jit
def _seen(rows, cols, S, shift, window, WINDOWED: tl.constexpr):
    """Which keys ``cols`` the query ``rows`` see: within S, at most ``row + shift`` and, under
    a sliding window, more than ``row + shift - window``."""
    visible = (cols < S) & (cols <= rows + shift)
    if WINDOWED:
        visible = visible & (cols > rows + shift - window)
    return visible


@triton.jit
def _fwd_inner(
    acc_MD, l_M, m_M,  # running output, softmax sum and max of this query block
    q_MD, k_base, v_base, stride_ks, stride_vs,
    offs_m, offs_d, S, shift, qk_scale,
    lo, hi,  # key range [lo, hi) to stream, in whole key blocks
    window, softcap,
    MASKED: tl.constexpr,  # apply the bounds and causal mask (only blocks on the diagonal or edge)
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
        k_ND = tl.load(
            k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
        )
        qk_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=PRECISION) * qk_scale
        qk_MN, _ = _cap(qk_MN, softcap, CAPPED)
        if MASKED:
            visible = _seen(offs_m[:, None], cols[None, :], S, shift, window, WINDOWED)
            qk_MN = tl.where(visible, qk_MN, float("-inf"))
        m_new = tl.maximum(m_M, tl.max(qk_MN, 1))
        if WINDOWED:  # a row whose window misses this whole tile (and every one before it)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_MN = tl.math.exp2(qk_MN - m_new[:, None])
        alpha = tl.math.exp2(m_M - m_new)  # rescales what was summed under the old max
        l_M = l_M * alpha + tl.sum(p_MN, 1)
        v_ND = tl.load(
            v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc_MD = acc_MD * alpha[:, None]
        acc_MD += tl.dot(p_MN.to(v_ND.dtype), v_ND, input_precision=PRECISION)
        m_M = m_new
    return acc_MD, l_M, m_M


@_autotune(_configs([(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]),
           key=["T", "S", "HEAD_DIM", "CAUSAL", "PRECISION", "WINDOWED", "CAPPED"])  # fmt: skip
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # q[B,H,T,D], k,v[B,Hkv,S,D]; the last dim contiguous
    o_ptr,  # out[B,H,T,D], contiguous
    lse_ptr,  # [B,H,T] fp32: log2-sum-exp2 of each query row's scaled scores, for the backward
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, G, T, S,
    qk_scale,  # softmax scale * log2(e) (with CAPPED, the scale alone: see _cap)
    window, softcap,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hkv = h // G
    # Query i sees key j when j <= i + shift: bottom-right alignment; without a mask, shift = S
    # makes the condition always true and leaves only the bounds.
    if CAUSAL:
        shift = S - T
    else:
        shift = S
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    q_base = q_ptr + b * stride_qb + h * stride_qh
    q_MD = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh

    m_M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_M = tl.zeros([BLOCK_M], tl.float32)
    acc_MD = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys every row of the block sees come first, unmasked; the rest (the diagonal, the ragged
    # end of S) are masked. Key 0 is always visible (shift >= 0), so the max is finite after the
    # first block.
    hi = tl.minimum(S, start_m + BLOCK_M + shift)
    if WINDOWED:  # from the first key block the block's first row's window reaches, all masked
        lo = tl.maximum(start_m + shift - window + 1, 0) // BLOCK_N * BLOCK_N
        acc_MD, l_M, m_M = _fwd_inner(acc_MD, l_M, m_M, q_MD, k_base, v_base, stride_ks,
                                      stride_vs, offs_m, offs_d, S, shift, qk_scale, lo, hi,
                                      window, softcap, True, HEAD_DIM, BLOCK_N, PRECISION,
                                      WINDOWED, CAPPED)  # fmt: skip
    else:
        full_hi = tl.minimum(S, start_m + shift + 1) // BLOCK_N * BLOCK_N
        acc_MD, l_M, m_M = _fwd_inner(acc_MD, l_M, m_M, q_MD, k_base, v_base, stride_ks,
                                      stride_vs, offs_m, offs_d, S, shift, qk_scale, 0, full_hi,
                                      window, softcap, False, HEAD_DIM, BLOCK_N, PRECISION,
                                      WINDOWED, CAPPED)  # fmt: skip
        acc_MD, l_M, m_M = _fwd_inner(acc_MD, l_M, m_M, q_MD, k_base, v_base, stride_ks,
                                      stride_vs, offs_m, offs_d, S, shift, qk_scale, full_hi, hi,
                                      window, softcap, True, HEAD_DIM, BLOCK_N, PRECISION,
                                      WINDOWED, CAPPED)  # fmt: skip

    o_MD = acc_MD / l_M[:, None]
    row = bh.to(tl.int64) * T
    o_base = o_ptr + row * HEAD_DIM
    tl.store(o_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o_MD.to(o_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip
    tl.store(lse_ptr + row + offs_m, m_M + tl.math.log2(l_M), mask=offs_m < T)


@triton.jit
def _attn_bwd_delta_kernel(
    o_ptr, do_ptr,  # out and its gradient [B,H,T,D], contiguous
    delta_ptr,  # [B,H,T] fp32: rowsum(o * do), the softmax backward's correction term
    T,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.program_id(1).to(tl.int64) * T
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    offs = (row + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + row + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def _dkdv_inner(
    dk_ND, dv_ND, k_ND, v_ND,
    q_base, do_base, lse_base, delta_base, stride_qt,
    offs_n, offs_d, T, S, shift, qk_scale,
    lo, hi,  # query range [lo, hi) to stream
    window, softcap,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
        q_MD = tl.load(
            q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0
        )
        do_MD = tl.load(
            do_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0
        )
        # Rows past T get lse = +inf, hence p = 0, without an overflow on the way.
        lse_M = tl.load(lse_base + offs_m, mask=offs_m < T, other=float("inf"))
        delta_M = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
        qkT_NM = tl.dot(k_ND, tl.trans(q_MD), input_precision=PRECISION) * qk_scale
        qkT_NM, slope_NM = _cap(qkT_NM, softcap, CAPPED)
        pT_NM = tl.math.exp2(qkT_NM - lse_M[None, :])
        if MASKED:
            visible = _seen(offs_m[None, :], offs_n[:, None], S, shift, window, WINDOWED)
            pT_NM = tl.where(visible, pT_NM, 0.0)
        dv_ND += tl.dot(pT_NM.to(do_MD.dtype), do_MD, input_precision=PRECISION)
        dpT_NM = tl.dot(v_ND, tl.trans(do_MD), input_precision=PRECISION)
        dsT_NM = pT_NM * (dpT_NM - delta_M[None, :]) * slope_NM
        dk_ND += tl.dot(dsT_NM.to(q_MD.dtype), q_MD, input_precision=PRECISION)
    return dk_ND, dv_ND


@_autotune(_configs([(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 32, 4, 2)]),
           key=["T", "S", "HEAD_DIM", "CAUSAL", "PRECISION", "WINDOWED", "CAPPED"])  # fmt: skip
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr,  # as in the forward
    do_ptr, lse_ptr, delta_ptr,  # do[B,H,T,D] contiguous; lse, delta [B,H,T] fp32
    dk_ptr, dv_ptr,  # [B,Hkv,S,D], contiguous
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, G, T, S,
    qk_scale, sm_scale,  # sm_scale: the softmax scale itself, which dK carries
    window, softcap,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)  # over B * Hkv
    Hkv = H // G
    b = (bh // Hkv).to(tl.int64)
    hkv = (bh % Hkv).to(tl.int64)
    if CAUSAL:
        shift = S - T
    else:
        shift = S
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    k_ND = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v_ND = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    dk_ND = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_ND = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Query rows that see any key of this block start at start_n - shift; from full_lo on they see
    # all of it, up to the last whole query block; the block's ragged end of S masks everything.
    lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
    whole_m = T // BLOCK_M * BLOCK_M
    full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), whole_m)
    full_lo = tl.where(start_n + BLOCK_N <= S, full_lo, whole_m)
    tail_lo = tl.maximum(whole_m, lo)
    # under a sliding window, the rows that see this block end where the last key's window
    # does: all of them masked
    win_hi = tl.minimum(T, start_n + BLOCK_N - 1 - shift + window)
    for g in range(0, G):
        h = hkv * G + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        row = (b * H + h) * T
        do_base = do_ptr + row * HEAD_DIM
        if WINDOWED:
            dk_ND, dv_ND = _dkdv_inner(dk_ND, dv_ND, k_ND, v_ND, q_base, do_base, lse_ptr + row,
                                       delta_ptr + row, stride_qt, offs_n, offs_d, T, S, shift,
                                       qk_scale, lo, win_hi, window, softcap, True, HEAD_DIM,
                                       BLOCK_M, PRECISION, WINDOWED, CAPPED)  # fmt: skip
        else:
            dk_ND, dv_ND = _dkdv_inner(dk_ND, dv_ND, k_ND, v_ND, q_base, do_base, lse_ptr + row,
                                       delta_ptr + row, stride_qt, offs_n, offs_d, T, S, shift,
                                       qk_scale, lo, full_lo, window, softcap, True, HEAD_DIM,
                                       BLOCK_M, PRECISION, WINDOWED, CAPPED)  # fmt: skip
            dk_ND, dv_ND = _dkdv_inner(dk_ND, dv_ND, k_ND, v_ND, q_base, do_base, lse_ptr + row,
                                       delta_ptr + row, stride_qt, offs_n, offs_d, T, S, shift,
                                       qk_scale, full_lo, whole_m, window, softcap, False,
                                       HEAD_DIM, BLOCK_M, PRECISION, WINDOWED, CAPPED)  # fmt: skip
            dk_ND, dv_ND = _dkdv_inner(dk_ND, dv_ND, k_ND, v_ND, q_base, do_base, lse_ptr + row,
                                       delta_ptr + row, stride_qt, offs_n, offs_d, T, S, shift,
                                       qk_scale, tail_lo, T, window, softcap, True, HEAD_DIM,
                                       BLOCK_M, PRECISION, WINDOWED, CAPPED)  # fmt: skip

    out = bh.to(tl.int64) * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out, (dk_ND * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv_ND.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq_MD, q_MD, do_MD, lse_M, delta_M,
    k_base, v_base, stride_ks, stride_vs,
    offs_m, offs_d, S, shift, qk_scale,
    lo, hi,
    window, softcap,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
        k_ND = tl.load(
            k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v_ND = tl.load(
            v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
        )
        qk_MN = tl.dot(q_MD, tl.trans(k_ND), input_precision=PRECISION) * qk_scale
        qk_MN, slope_MN = _cap(qk_MN, softcap, CAPPED)
        p_MN = tl.math.exp2(qk_MN - lse_M[:, None])
        if MASKED:
            visible = _seen(offs_m[:, None], cols[None, :], S, shift, window, WINDOWED)
            p_MN = tl.where(visible, p_MN, 0.0)
        dp_MN = tl.dot(do_MD, tl.trans(v_ND), input_precision=PRECISION)
        ds_MN = p_MN * (dp_MN - delta_M[:, None]) * slope_MN
        dq_MD += tl.dot(ds_MN.to(k_ND.dtype), k_ND, input_precision=PRECISION)
    return dq_MD


@_autotune(_configs([(64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (32, 32, 4, 2)]),
           key=["T", "S", "HEAD_DIM", "CAUSAL", "PRECISION", "WINDOWED", "CAPPED"])  # fmt: skip
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr,  # as in the forward
    do_ptr, lse_ptr, delta_ptr,  # as in the dK, dV kernel
    dq_ptr,  # [B,H,T,D], contiguous
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    H, G, T, S,
    qk_scale, sm_scale,
    window, softcap,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hkv = h // G
    if CAUSAL:
        shift = S - T
    else:
        shift = S
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    q_base = q_ptr + b * stride_qb + h * stride_qh
    q_MD = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
    row = bh.to(tl.int64) * T
    offs_o = (row + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    do_MD = tl.load(do_ptr + offs_o, mask=q_mask, other=0.0)
    lse_M = tl.load(lse_ptr + row + offs_m, mask=offs_m < T, other=float("inf"))
    delta_M = tl.load(delta_ptr + row + offs_m, mask=offs_m < T, other=0.0)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh

    dq_MD = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(S, start_m + BLOCK_M + shift)
    if WINDOWED:
        lo = tl.maximum(start_m + shift - window + 1, 0) // BLOCK_N * BLOCK_N
        dq_MD = _dq_inner(dq_MD, q_MD, do_MD, lse_M, delta_M, k_base, v_base, stride_ks,
                          stride_vs, offs_m, offs_d, S, shift, qk_scale, lo, hi, window, softcap,
                          True, HEAD_DIM, BLOCK_N, PRECISION, WINDOWED, CAPPED)  # fmt: skip
    else:
        full_hi = tl.minimum(S, start_m + shift + 1) // BLOCK_N * BLOCK_N
        dq_MD = _dq_inner(dq_MD, q_MD, do_MD, lse_M, delta_M, k_base, v_base, stride_ks,
                          stride_vs, offs_m, offs_d, S, shift, qk_scale, 0, full_hi, window,
                          softcap, False, HEAD_DIM, BLOCK_N, PRECISION, WINDOWED, CAPPED)  # fmt: skip
        dq_MD = _dq_inner(dq_MD, q_MD, do_MD, lse_M, delta_M, k_base, v_base, stride_ks,
                          stride_vs, offs_m, offs_d, S, shift, qk_scale, full_hi, hi, window,
                          softcap, True, HEAD_DIM, BLOCK_N, PRECISION, WINDOWED, CAPPED)  # fmt: skip
    tl.store(dq_ptr + offs_o, (dq_MD * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _meta(q: torch.Tensor, causal: bool, window: int = 0, softcap: float = 0.0) -> dict[str, Any]:
    """The constexprs every attention kernel takes. fp32 inputs get exact fp32 products: TF32
    would miss the fp32 tolerance by two orders of magnitude."""
    D = q.shape[-1]
    return {
        "WINDOWED": window > 0,
        "CAPPED": softcap > 0,
        "CAUSAL": causal,
        "HEAD_DIM": D,
        "BLOCK_D": max(16, triton.next_power_of_2(D)),
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float, window: int = 0,
             softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(o, lse2)``: the output and each row's log2-sum-exp2 of its scores times LOG2E."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)  # noqa: E731
    _attn_fwd_kernel[grid](q, k, v, o, lse, *_strides(q, k, v), H, H // Hkv, T, S,
                           scale if softcap else scale * LOG2E, window, softcap,
                           **_meta(q, causal, window, softcap))  # fmt: skip
    return o, lse


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``(o * do).sum(-1)`` in fp32, the softmax backward's row term."""
    B, H, T, D = o.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=o.device)
    block_m = 16 if INTERPRETED else 64
    _attn_bwd_delta_kernel[(triton.cdiv(T, block_m), B * H)](
        o, do, delta, T, HEAD_DIM=D, BLOCK_D=_meta(o, False)["BLOCK_D"], BLOCK_M=block_m
    )
    return delta


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
              lse: torch.Tensor, delta: torch.Tensor, causal: bool, scale: float,
              window: int = 0,
              softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` from the row statistics ``lse`` (log2 units) and ``delta``."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    meta = _meta(q, causal, window, softcap)
    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)  # laid out as o, contiguous
    dk = torch.empty((B, Hkv, S, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, Hkv, S, D), dtype=v.dtype, device=v.device)
    qk_scale = scale if softcap else scale * LOG2E
    args = (*_strides(q, k, v), H, H // Hkv, T, S, qk_scale, scale, window, softcap)
    grid_kv = lambda m: (triton.cdiv(S, m["BLOCK_N"]), B * Hkv)  # noqa: E731
    _attn_bwd_dkdv_kernel[grid_kv](q, k, v, do, lse, delta, dk, dv, *args, **meta)
    grid_q = lambda m: (triton.cdiv(T, m["BLOCK_M"]), B * H)  # noqa: E731
    _attn_bwd_dq_kernel[grid_q](q, k, v, do, lse, delta, dq, *args, **meta)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:  # fmt: skip
        o, lse = _forward(q, k, v, causal, scale, window, softcap)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, window, softcap
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        dq, dk, dv = _backward(q, k, v, do, lse, _delta(o, do), ctx.causal, ctx.scale,
                               ctx.window, ctx.softcap)  # fmt: skip
        return dq, dk, dv, None, None, None, None


class _AttentionLSE(torch.autograd.Function):
    """Attention and its natural-log log-sum-exp, both differentiable: the log-sum-exp's
    gradient enters the softmax backward as ``delta - dlse`` (its derivative in the scores is
    the probabilities), so the same kernels serve."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        o, lse2 = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.causal, ctx.scale = causal, scale
        return o, lse2 * LN2

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, o, lse2 = ctx.saved_tensors
        do = do.contiguous()
        delta = _delta(o, do)
        if dlse is not None:
            delta = delta - dlse.float()
        dq, dk, dv = _backward(q, k, v, do, lse2, delta.contiguous(), ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Flash attention with the contract of :func:`colfunc.ops.reference.attention`, a
    sliding ``window`` (causal: each query's key blocks from the first its window reaches) and
    soft-capped scores included.

    Head dims 16 to 128; fp16, bf16 or fp32; any strides with a contiguous last dim (others are
    copied). Raises ValueError for inputs the kernel does not take, before launching.
    """
    q, k, v, scale = _prepare(q_BHTD, k_BHSD, v_BHSD, causal, scale)
    if window and not causal:
        raise ValueError("attention: a sliding window is for causal attention; pass causal=True")
    out: torch.Tensor = _Attention.apply(
        q, k, v, bool(causal), scale, int(window or 0), float(softcap or 0.0)
    )
    return out


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:  # fmt: skip
    """The checks every attention entry point makes, inputs with a contiguous last dim, and the
    scale (``1/sqrt(D)`` by default)."""
    checks.attention(q, k, v, causal)
    checks.device("attention", q, k, v, interpreted=INTERPRETED)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attention_lse(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention and its log-sum-exp (fp32), the contract of
    :func:`colfunc.ops.reference.attention_lse`."""
    q, k, v, scale = _prepare(q_BHTD, k_BHSD, v_BHSD, causal, scale)
    out: tuple[torch.Tensor, torch.Tensor] = _AttentionLSE.apply(q, k, v, bool(causal), scale)
    return out


@torch.no_grad()
def attention_block(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a blockwise attention: ``(out, lse)``, no autograd."""
    q, k, v, scale = _prepare(q_BHTD, k_BHSD, v_BHSD, causal, scale)
    o, lse2 = _forward(q, k, v, bool(causal), scale)
    return o, lse2 * LN2


@torch.no_grad()
def attention_block_backward(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    dout_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    delta_BHT: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key/value block's ``(dq, dk, dv)`` from the whole attention's ``lse`` and ``delta``;
    see :func:`colfunc.ops.reference.attention_block_backward`."""
    q, k, v, scale = _prepare(q_BHTD, k_BHSD, v_BHSD, causal, scale)
    lse2 = (lse_BHT.float() * LOG2E).contiguous()
    delta = delta_BHT.float().contiguous()
    return _backward(q, k, v, dout_BHTD.contiguous(), lse2, delta, bool(causal), scale)
