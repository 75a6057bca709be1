"""Plain PyTorch references of the ops in :mod:`colfunc.ops`.

These are the oracle that every kernel is tested against, and the implementation used wherever no
kernel applies (CPU tensors, ``COLFUNC_KERNELS=torch``).

Legend: B batch, H query heads, Hkv key/value heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from colfunc import torch_private
from colfunc.ops.values import NF4, NF4_BLOCK, AdamWHyper, PagedBatch

__all__ = [
    "adamw_",
    "attention",
    "attention_block",
    "attention_block_backward",
    "attention_lse",
    "cross_entropy",
    "dequantize_nf4",
    "layer_norm",
    "rms_norm",
    "rope",
]


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q[B,H,T,D], k,v[B,Hkv,S,D]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention: query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"({k.shape[1]})"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")


def _causal_mask(T: int, S: int, device: Any, window: int | None = None) -> torch.Tensor:
    """``[T, S]``: query ``i`` sees key ``j`` where ``j <= i + S - T`` (aligned bottom-right),
    and with a sliding ``window`` only the last ``window`` of those (``j > i + S - T - window``)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i + (S - T)
    return mask if window is None else mask & (j > i + (S - T) - window)


def attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention with grouped-query heads; a causal mask aligned bottom-right when T != S.

    Bottom-right alignment means query ``i`` sees keys ``j <= i + S - T``: the last query is the
    newest token, as in decoding against a KV cache. A sliding ``window`` (causal only) keeps
    the last ``window`` keys of each query, itself included (Mistral's ``sliding_window``).
    ``softcap``: the scaled scores pass through ``softcap * tanh(s / softcap)`` before the mask
    and the softmax (Gemma 2's ``attn_logit_softcapping``).
    """
    _check_attention(q_BHTD, k_BHSD, v_BHSD)
    T, S = q_BHTD.shape[2], k_BHSD.shape[2]
    gqa = q_BHTD.shape[1] != k_BHSD.shape[1]
    if softcap is not None:
        if causal and T > S:
            raise ValueError(
                f"causal attention needs T <= S for bottom-right alignment; got T={T}, S={S}"
            )
        mask = _causal_mask(T, S, q_BHTD.device, window) if causal else None
        return capped_attention(q_BHTD, k_BHSD, v_BHSD, mask, scale, softcap)
    if (not causal or T == S) and window is None:
        if q_BHTD.is_meta and not gqa:
            # a meta tensor stands for a CPU one (cf.memory.predict's dry run): the kernel the CPU
            # runs (flash, saving only the log-sum-exp), not the math path meta would take
            out, _ = torch_private.flash_attention_cpu(
                q_BHTD, k_BHSD, v_BHSD, 0.0, causal, scale=scale
            )
            return out
        return F.scaled_dot_product_attention(
            q_BHTD, k_BHSD, v_BHSD, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if T > S:
        raise ValueError(
            f"causal attention needs T <= S for bottom-right alignment; got T={T}, S={S}"
        )
    mask_TS = _causal_mask(T, S, q_BHTD.device, window)
    return F.scaled_dot_product_attention(
        q_BHTD, k_BHSD, v_BHSD, attn_mask=mask_TS, scale=scale, enable_gqa=gqa
    )


def capped_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """Attention whose scaled scores are soft-capped, ``softcap * tanh(s / softcap)``, then
    masked (``mask`` broadcast to ``[B, H, T, S]``, True where a key is seen) and normalized in
    the accumulation dtype (fp32; fp64 for fp64); query head ``h`` reads key/value head
    ``h // (H / Hkv)``. Written out, since no fused kernel caps the scores."""
    H, Hkv, D = q_BHTD.shape[1], k_BHSD.shape[1], q_BHTD.shape[-1]
    if Hkv != H:
        k_BHSD = k_BHSD.repeat_interleave(H // Hkv, dim=1)
        v_BHSD = v_BHSD.repeat_interleave(H // Hkv, dim=1)
    scale = 1.0 / D**0.5 if scale is None else float(scale)
    s = (q_BHTD @ k_BHSD.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.to(_acc_dtype(q_BHTD)), dim=-1).to(q_BHTD.dtype)
    return p @ v_BHSD


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _grouped_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, float]:
    """Scaled scores ``[B, Hkv, G, T, S]`` (G = H / Hkv query heads per key/value head) in the
    accumulation dtype, masked to ``-inf`` above the bottom-right causal diagonal."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / D**0.5 if scale is None else float(scale)
    acc = _acc_dtype(q)
    q5 = q.to(acc).reshape(B, Hkv, H // Hkv, T, D)
    s = q5 @ k.to(acc)[:, :, None].transpose(-1, -2) * scale
    if causal:
        if T > S:
            raise ValueError(
                f"causal attention needs T <= S for bottom-right alignment; got T={T}, S={S}"
            )
        s = s.masked_fill(~_causal_mask(T, S, q.device), float("-inf"))
    return s, scale


def attention_lse(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` and the log-sum-exp of each query's scaled scores, ``lse[B,H,T]``.

    The log-sum-exp is natural-log, in fp32 (fp64 for fp64 inputs); both outputs are
    differentiable. Two attentions of one query over disjoint key sets merge into the attention
    over their union by their log-sum-exps (ring attention):
    ``lse = logaddexp(lse1, lse2)``, ``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)``.
    """
    _check_attention(q_BHTD, k_BHSD, v_BHSD)
    B, H, T, D = q_BHTD.shape
    s, _ = _grouped_scores(q_BHTD, k_BHSD, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = p @ v_BHSD.to(s.dtype)[:, :, None]
    return out.reshape(B, H, T, D).to(q_BHTD.dtype), lse.reshape(B, H, T)


def _fused_cpu(q: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU flash attention (which returns the log-sum-exp and takes it
    back in its backward) serves: plain fp32/fp64 CPU tensors."""
    return (
        type(q) is torch.Tensor
        and q.device.type == "cpu"
        and q.dtype
        in (
            torch.float32,
            torch.float64,
        )
    )


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """Key/value heads repeated for their groups of query heads: ``[B, Hkv, S, D] -> [B, H, S, D]``."""
    B, Hkv, S, D = x.shape
    if Hkv == H:
        return x
    return x[:, :, None].expand(B, Hkv, H // Hkv, S, D).reshape(B, H, S, D)


@torch.no_grad()
def attention_block(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_lse` without autograd: one block of a blockwise (ring) attention.

    On CPU (fp32, fp64) the fused flash attention, whose memory is linear in the block's length;
    elsewhere the scores are materialised. A causal block must be square (``T == S``)."""
    _check_attention(q_BHTD, k_BHSD, v_BHSD)
    if _fused_cpu(q_BHTD) and (not causal or q_BHTD.shape[2] == k_BHSD.shape[2]):
        H = q_BHTD.shape[1]
        out, lse = torch_private.flash_attention_cpu(
            q_BHTD, _heads(k_BHSD, H), _heads(v_BHSD, H), 0.0, causal, scale=scale
        )
        return out, lse
    return attention_lse(q_BHTD, k_BHSD, v_BHSD, causal, scale)


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
    out_BHTD: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dq, dk, dv)`` of one key/value block's share of an attention.

    ``lse`` is the log-sum-exp of the query's scores over *all* its keys (this block's and the
    others'), ``delta`` is ``(dout * out).sum(-1)`` of the whole attention's output ``out``:
    with them a block's probabilities and its part of the softmax's backward are exact (flash
    attention's backward, block by block). On CPU (fp32, fp64, given ``out``) the fused flash
    backward; elsewhere accumulated in fp32 (fp64 for fp64) over materialised scores.
    """
    B, H, T, D = q_BHTD.shape
    Hkv = k_BHSD.shape[1]
    G = H // Hkv
    square = not causal or k_BHSD.shape[2] == T
    if out_BHTD is not None and _fused_cpu(q_BHTD) and square:
        k, v = _heads(k_BHSD, H), _heads(v_BHSD, H)
        dq, dk, dv = torch_private.flash_attention_cpu_backward(
            dout_BHTD, q_BHTD, k, v, out_BHTD, lse_BHT, 0.0, causal, scale=scale
        )
        if G > 1:
            S = k.shape[2]
            dk = dk.view(B, Hkv, G, S, D).sum(2)
            dv = dv.view(B, Hkv, G, S, D).sum(2)
        return dq, dk, dv
    s, sc = _grouped_scores(q_BHTD, k_BHSD, causal, scale)
    acc = s.dtype
    p = torch.exp(s - lse_BHT.to(acc).reshape(B, Hkv, G, T, 1))
    do = dout_BHTD.to(acc).reshape(B, Hkv, G, T, D)
    v = v_BHSD.to(acc)[:, :, None]
    dv = (p.transpose(-1, -2) @ do).sum(2)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta_BHT.to(acc).reshape(B, Hkv, G, T, 1))
    dq = (ds @ k_BHSD.to(acc)[:, :, None]) * sc
    dk = (ds.transpose(-1, -2) @ q_BHTD.to(acc).reshape(B, Hkv, G, T, D)).sum(2) * sc
    dt = q_BHTD.dtype
    return dq.reshape(B, H, T, D).to(dt), dk.to(dt), dv.to(dt)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as LLaMA does)."""
    x32 = x if x.dtype == torch.float64 else x.float()  # widen half types, never narrow
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y if weight is None else weight * y


def cross_entropy(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not ``ignore_index``, computed in fp32."""
    if logits_NV.dim() != 2 or labels_N.dim() != 1 or logits_NV.shape[0] != labels_N.shape[0]:
        raise ValueError(
            f"cross_entropy expects logits[N,V] and labels[N]; got {tuple(logits_NV.shape)} and "
            f"{tuple(labels_N.shape)}"
        )
    wide = logits_NV if logits_NV.dtype == torch.float64 else logits_NV.float()  # never narrow
    return F.cross_entropy(wide, labels_N, ignore_index=ignore_index)


def rope(x_BHTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (LLaMA/NeoX): K = D/2 frequencies.

    ``out[..., :K] = x1*cos - x2*sin``, ``out[..., K:] = x2*cos + x1*sin``.
    """
    K = x_BHTD.shape[-1] // 2
    if (
        x_BHTD.shape[-1] % 2
        or cos_TK.shape != (x_BHTD.shape[-2], K)
        or sin_TK.shape != cos_TK.shape
    ):
        raise ValueError(
            f"rope expects x[...,T,D] with even D and cos, sin [T, D/2]; got x {tuple(x_BHTD.shape)}, "
            f"cos {tuple(cos_TK.shape)}, sin {tuple(sin_TK.shape)}"
        )
    cos, sin = cos_TK.to(x_BHTD.dtype), sin_TK.to(x_BHTD.dtype)
    if x_BHTD.dim() >= 3 and x_BHTD.transpose(-3, -2).is_contiguous():
        # heads split from a [.., T, H*D] projection: rotated in that layout and handed back in
        # it, so the halves join by rows, not by a transposing copy
        return _rotate_half(x_BHTD.transpose(-3, -2), cos[:, None], sin[:, None]).transpose(-3, -2)
    return _rotate_half(x_BHTD, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    K = x.shape[-1] // 2
    x1, x2 = x[..., :K], x[..., K:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
) -> None:
    """One AdamW update in place, operation for operation as ``torch.optim.AdamW`` does it.

    ``hyper.step`` is the 1-based count of this update (for the bias corrections). The arithmetic
    runs in the moments' dtype (fp32 for the kernels; fp64 moments keep fp64 params exact): a
    bf16 or fp16 param is updated in fp32 and rounded back once.
    """
    lengths = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs)}
    if len(lengths) != 1:
        raise ValueError(f"adamw_: params, grads, exp_avgs, exp_avg_sqs differ in length {lengths}")
    if not isinstance(hyper, AdamWHyper):
        raise TypeError(f"adamw_: hyper must be a colfunc.ops.AdamWHyper, got {hyper!r}")
    step, lr, beta1, beta2 = hyper.step, hyper.lr, hyper.beta1, hyper.beta2
    eps, weight_decay = hyper.eps, hyper.weight_decay
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = (1.0 - beta2**step) ** 0.5
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p_wide, g_wide = p.to(m.dtype), g.to(m.dtype)  # the tensors themselves when equal
        p_wide.mul_(1.0 - lr * weight_decay)
        m.lerp_(g_wide, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g_wide, g_wide, value=1.0 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p_wide.addcdiv_(m, denom, value=-step_size)
        if p_wide is not p:
            p.copy_(p_wide)


def _by_length(seqs: list[int], context_lens: Sequence[int]) -> list[list[int]]:
    """``seqs`` in groups of similar context length (at most twice the shortest, plus a block's
    worth), so that padding every context of a group to its longest wastes little."""
    groups: list[list[int]] = []
    for s in sorted(seqs, key=lambda s: context_lens[s]):
        if groups and context_lens[s] <= 2 * context_lens[groups[-1][0]] + 16:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


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
    """Causal attention of a packed batch of sequences over a paged KV cache.

    Sequence ``s`` has ``query_lens[s]`` new tokens, packed in order in ``q, k, v`` (``[N, H, E]``
    and ``[N, K, E]``), after ``context_lens[s]`` tokens whose keys and values are in the cache
    (``[C blocks, B slots, K, E]``) at the blocks its row of ``block_tables`` lists. Each new token
    sees the cached tokens and the new ones up to itself. A decode step is ``query_lens[s] == 1``;
    a (chunked) prefill has more. Returns ``[N, H, E]``; the scale is ``1/sqrt(E)``. A sliding
    ``window`` keeps each token's last ``window`` keys, itself included; ``softcap`` caps the
    scores as :func:`attention` does.

    Sequences with one new token are computed together, in groups of similar context length:
    a group's blocks are gathered into one padded batch (a block past a context may be any
    block: it is masked out). Each longer one runs alone.
    """
    check_paged_lens(q_NHE, batch)
    out_NHE = torch.empty_like(q_NHE)
    args = (q_NHE, k_NKE, v_NKE, k_cache_CBKE, v_cache_CBKE)
    paged_decode_into(out_NHE, *args, batch, window, softcap)
    paged_prefill_into(out_NHE, *args, batch, window, softcap)
    return out_NHE


def check_paged_lens(q_NHE: torch.Tensor, batch: PagedBatch) -> None:
    """``batch``'s new tokens are the ``N`` packed rows of ``q``."""
    context_lens, query_lens = batch.context_lens, batch.query_lens
    N = q_NHE.shape[0]
    if len(context_lens) != len(query_lens) or sum(query_lens) != N:
        raise ValueError(
            f"paged_attention: query_lens {list(query_lens)} must sum to the {N} packed tokens "
            f"and match context_lens {list(context_lens)} in length"
        )


def _first_block(context_len: int, window: int | None, block_size: int) -> int:
    """The first block a token at position ``context_len`` reads under a sliding ``window`` (it
    sees the keys from ``context_len - window + 1`` on); 0 without one."""
    if window is None:
        return 0
    return max(0, context_len - window + 1) // block_size


def _starts(query_lens: Sequence[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def paged_decode_into(
    out_NHE: torch.Tensor,
    q_NHE: torch.Tensor,
    k_NKE: torch.Tensor,
    v_NKE: torch.Tensor,
    k_cache_CBKE: torch.Tensor,
    v_cache_CBKE: torch.Tensor,
    batch: PagedBatch,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The rows of :func:`paged_attention`'s output for the sequences with one new token."""
    block_tables_SM, context_lens, query_lens = (
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
    )
    H = q_NHE.shape[1]
    B = k_cache_CBKE.shape[1]
    starts = _starts(query_lens)
    for group in _by_length([s for s, n in enumerate(query_lens) if n == 1], context_lens):
        # every decoding sequence of the group's blocks in one gather, [S, M * B, K, E], its new
        # key and value written at its context length, everything after it masked out; under a
        # sliding window each sequence's blocks from the first its window reaches (the blocks
        # before it may have been given back: -1 in the table)
        device = q_NHE.device
        K = k_NKE.shape[1]
        first = [_first_block(context_lens[s], window, B) for s in group]
        M = max(-(-(context_lens[s] + 1) // B) - f for s, f in zip(group, first))
        index = torch.tensor(group, device=device)[:, None]
        cols = torch.tensor(first, device=device)[:, None] + torch.arange(M, device=device)
        cols = cols.clamp(max=block_tables_SM.shape[1] - 1)  # (past a context: masked out)
        picked = block_tables_SM[index, cols].reshape(-1).long().clamp(min=0)
        shape = (len(group), M * B, K, k_cache_CBKE.shape[-1])
        k_SLKE = k_cache_CBKE.flatten(1).index_select(0, picked).view(shape)
        v_SLKE = v_cache_CBKE.flatten(1).index_select(0, picked).view(shape)
        offset = torch.tensor([f * B for f in first], device=device)
        ctx = torch.tensor([context_lens[s] for s in group], device=device) - offset
        rows = torch.tensor([starts[s] for s in group], device=device)
        seq = torch.arange(len(group), device=device)
        k_SLKE[seq, ctx], v_SLKE[seq, ctx] = k_NKE[rows], v_NKE[rows]
        slots_L = torch.arange(M * B, device=device)[None, :]
        mask_SL = slots_L <= ctx[:, None]
        if window is not None:  # the last `window` tokens, the new one included
            mask_SL &= slots_L > ctx[:, None] - window
        qkv = (q_NHE[rows][:, :, None], k_SLKE.transpose(1, 2), v_SLKE.transpose(1, 2))
        if softcap is not None:
            y = capped_attention(*qkv, mask_SL[:, None, None, :], None, softcap)
        else:
            y = F.scaled_dot_product_attention(
                *qkv, attn_mask=mask_SL[:, None, None, :], enable_gqa=H != K
            )
        out_NHE[rows] = y[:, :, 0]


def paged_prefill_into(
    out_NHE: torch.Tensor,
    q_NHE: torch.Tensor,
    k_NKE: torch.Tensor,
    v_NKE: torch.Tensor,
    k_cache_CBKE: torch.Tensor,
    v_cache_CBKE: torch.Tensor,
    batch: PagedBatch,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The rows of :func:`paged_attention`'s output for the sequences with several new tokens."""
    block_tables_SM, context_lens, query_lens = (
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
    )
    B = k_cache_CBKE.shape[1]
    starts = _starts(query_lens)

    def context(s: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` cached keys and values of sequence ``s``, ``[n - d, K, E]``, from the first
        block its window reaches (``d`` tokens before it left out: its first new token's window
        starts after them, and the bottom-right mask is the same without them)."""
        f = _first_block(n, window, B)
        blocks = block_tables_SM[s, f : -(-n // B)]
        k = k_cache_CBKE[blocks].flatten(0, 1)[: n - f * B]
        return k, v_cache_CBKE[blocks].flatten(0, 1)[: n - f * B]

    for s, n in enumerate(query_lens):
        if n == 1:
            continue
        lo, hi = starts[s], starts[s] + n
        k_TKE, v_TKE = k_NKE[lo:hi], v_NKE[lo:hi]
        if context_lens[s]:
            k_ctx, v_ctx = context(s, context_lens[s])
            k_TKE, v_TKE = torch.cat([k_ctx, k_TKE]), torch.cat([v_ctx, v_TKE])
        y = attention(
            q_NHE[lo:hi].transpose(0, 1)[None],
            k_TKE.transpose(0, 1)[None],
            v_TKE.transpose(0, 1)[None],
            causal=True,
            window=window,
            softcap=softcap,
        )
        out_NHE[lo:hi] = y[0].transpose(0, 1)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of NF4 codes ``packed[..., n / 2]`` (two a byte, the high nibble first) with one
    ``absmax[..., n / 64]`` per block of 64, as ``[..., n]`` in ``dtype``: one fp32 tensor of the
    result's size is made and scaled in place (the temporaries: the codes as bytes and as int32
    indices)."""
    table = torch.tensor(NF4, dtype=torch.float32, device=packed.device)
    idx = torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)
    shape = idx.shape
    codes = table.index_select(0, idx.flatten().int()).view(shape)
    codes.unflatten(-1, (-1, NF4_BLOCK)).mul_(absmax.unsqueeze(-1))
    return codes.to(dtype)
