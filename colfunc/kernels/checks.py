"""What each kernel accepts, checked in Python before anything is launched.

A kernel fed a wrong shape or dtype does not fail: it reads past a buffer or writes garbage. So
every host wrapper, and the dispatcher before it even imports a kernel module, calls the check
here, which raises ValueError naming the value and the fix. This module does not import Triton, so
a check costs nothing on a machine without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from colfunc import torch_private
from colfunc.ops.values import AdamWHyper, PagedBatch

__all__ = [
    "FLOAT_DTYPES",
    "adamw",
    "adamw_hyper",
    "adamw_lists",
    "attention",
    "cross_entropy",
    "dequantize_nf4",
    "device",
    "grouped_matmul",
    "interpreting",
    "layer_norm",
    "paged_attention",
    "rms_norm",
    "rope",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIM_RANGE = (16, 128)
MAX_ROW_BYTES = 65536  # a norm row is held in registers in one block: the tutorial's 64 KB bound


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _functorch_wrapped(t: torch.Tensor) -> bool:
    return bool(torch_private.is_functorch_wrapped_tensor(t))


def device(op: str, *tensors: torch.Tensor, interpreted: bool | None = None) -> None:
    """Plain tensors, all on one device that a Triton kernel can reach: CUDA, or CPU when
    interpreting.

    ``interpreted`` is how the kernel module was actually decorated (it reads ``TRITON_INTERPRET``
    once, at import); None means: not imported yet, judge by the environment now.
    """
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or _functorch_wrapped(t):
            raise ValueError(
                f"{op}: the Triton kernel takes plain tensors; got a {type(t).__name__} (a tensor "
                "subclass or one under a torch.func transform): use COLFUNC_KERNELS=auto or torch"
            )
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: tensors are on different devices {sorted(map(str, devices))}")
    (dev,) = devices
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and interpreting():
        if interpreted is False:
            raise ValueError(
                f"{op}: TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it "
                "before anything imports colfunc.kernels (it is read at @triton.jit time)"
            )
        return
    raise ValueError(
        f"{op}: the Triton kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; "
        f"got device {dev}. Use COLFUNC_KERNELS=auto or COLFUNC_KERNELS=torch for this device"
    )


def _float(op: str, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{op}: {name} has dtype {t.dtype}; the kernel takes fp16, bf16 or fp32"
            )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Shapes ``q[B,H,T,D]``, ``k,v[B,Hkv,S,D]``, one float dtype, a supported head dim."""
    op = "attention"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"{op}: expects q[B,H,T,D] and k, v [B,Hkv,S,D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    _, Hkv, S, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim"
        )
    if H % Hkv:
        raise ValueError(f"{op}: query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if min(B, H, T, S) == 0:
        raise ValueError(f"{op}: empty input q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not HEAD_DIM_RANGE[0] <= D <= HEAD_DIM_RANGE[1]:
        raise ValueError(
            f"{op}: head dim {D} is outside the kernel's range {HEAD_DIM_RANGE}; use "
            "COLFUNC_KERNELS=torch (or auto, which falls back to the reference)"
        )
    if causal and T > S:
        raise ValueError(
            f"{op}: causal attention needs T <= S (bottom-right mask); got T={T}, S={S}"
        )
    _float(op, q=q)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"{op}: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
) -> None:
    """``q[N,H,E]``, ``k, v[N,K,E]``, caches ``[C,B,K,E]`` with a power-of-two block size B, int32
    block tables ``[S,M]`` covering every context, one float dtype, a supported head dim."""
    block_tables, context_lens, query_lens = (
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
    )
    op = "paged_attention"
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4:
        raise ValueError(
            f"{op}: expects q[N,H,E], k, v [N,K,E] and caches [C,B,K,E]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, cache {tuple(k_cache.shape)}"
        )
    N, H, E = q.shape
    B, K = k_cache.shape[1:3]
    if k.shape[0] != N or k.shape[1:] != (K, E) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)} and cache {tuple(k_cache.shape)} "
            "disagree in tokens, heads or head dim"
        )
    if H % K:
        raise ValueError(f"{op}: query heads ({H}) must be a multiple of key/value heads ({K})")
    if B & (B - 1):
        raise ValueError(f"{op}: the kernel needs a power-of-two block size, got {B}")
    if not HEAD_DIM_RANGE[0] <= E <= HEAD_DIM_RANGE[1]:
        raise ValueError(f"{op}: head dim {E} is outside the kernel's range {HEAD_DIM_RANGE}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"{op}: block tables must be int32 [S, M], got {block_tables.dtype}")
    if len(context_lens) != len(query_lens) or len(query_lens) != block_tables.shape[0]:
        raise ValueError(f"{op}: one context and query length per block-table row")
    if sum(query_lens) != N or min(query_lens, default=1) < 1:
        raise ValueError(f"{op}: query lengths {list(query_lens)} must be >= 1 and sum to {N}")
    if max(context_lens, default=0) > block_tables.shape[1] * B:
        raise ValueError(f"{op}: a context is longer than its block table covers")
    _float(op, q=q)
    if not q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"{op}: q, k, v and the caches must share one dtype")


def _row_fits(op: str, x: torch.Tensor) -> None:
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(
            f"{op}: expects a non-empty tensor with a feature dim; got {tuple(x.shape)}"
        )
    max_features = MAX_ROW_BYTES // x.element_size()
    if x.shape[-1] > max_features:
        raise ValueError(
            f"{op}: last dim {x.shape[-1]} exceeds the kernel's {max_features} features for "
            f"{x.dtype}; use COLFUNC_KERNELS=torch"
        )


def _per_feature(op: str, x: torch.Tensor, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and tuple(t.shape) != (x.shape[-1],):
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}; expected ({x.shape[-1]},) for x "
                f"{tuple(x.shape)}"
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    """``x[..., C]`` with ``weight[C]`` (or None), float dtypes, a row that fits one block."""
    _float("rms_norm", x=x, weight=weight)
    _row_fits("rms_norm", x)
    _per_feature("rms_norm", x, weight=weight)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """``x[..., C]`` with ``weight[C]``, ``bias[C]`` (either may be None)."""
    _float("layer_norm", x=x, weight=weight, bias=bias)
    _row_fits("layer_norm", x)
    _per_feature("layer_norm", x, weight=weight, bias=bias)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """``logits[N,V]`` float, ``labels[N]`` integer, N >= 1."""
    op = "cross_entropy"
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{op}: expects logits[N,V] and labels[N]; got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"{op}: empty logits {tuple(logits.shape)}")
    _float(op, logits=logits)
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: labels have dtype {labels.dtype}; expected int64 or int32")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x[..., T, D]`` with even D and ``cos, sin [T, D/2]`` that need no gradient."""
    op = "rope"
    if x.dim() < 2 or x.shape[-1] % 2 or x.numel() == 0:
        raise ValueError(f"{op}: expects non-empty x[..., T, D] with even D; got {tuple(x.shape)}")
    T, K = x.shape[-2], x.shape[-1] // 2
    if tuple(cos.shape) != (T, K) or sin.shape != cos.shape:
        raise ValueError(
            f"{op}: cos and sin must be [T, D/2] = {(T, K)} for x {tuple(x.shape)}; got cos "
            f"{tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    _float(op, x=x, cos=cos, sin=sin)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            f"{op}: the kernel computes no gradient for cos and sin; pass them detached or use "
            "COLFUNC_KERNELS=torch"
        )


def adamw_lists(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    param_dtypes: Sequence[torch.dtype],
    grad_dtypes: Sequence[torch.dtype],
) -> None:
    """Four lists of equal length; per index equal shapes, contiguous, fp32 moments."""
    lengths = (len(params), len(grads), len(exp_avgs), len(exp_avg_sqs))
    if len(set(lengths)) != 1:
        raise ValueError(
            f"{op}: params, grads, exp_avgs, exp_avg_sqs have lengths {lengths}; they must match"
        )
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not p.shape == g.shape == m.shape == v.shape:
            raise ValueError(
                f"{op}: tensor {i}: shapes differ: param {tuple(p.shape)}, grad {tuple(g.shape)}, "
                f"exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}"
            )
        if p.dtype not in param_dtypes:
            raise ValueError(f"{op}: param {i} has dtype {p.dtype}; expected one of {param_dtypes}")
        if g.dtype not in grad_dtypes:
            raise ValueError(f"{op}: grad {i} has dtype {g.dtype}; expected one of {grad_dtypes}")
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(
                f"{op}: tensor {i}: optimizer states must be fp32; got {m.dtype}, {v.dtype}"
            )
        for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} {i} is not contiguous; call .contiguous() first")


def adamw_hyper(op: str, hyper: Any) -> None:
    """An :class:`~colfunc.ops.AdamWHyper` (which checks its values when built)."""
    if not isinstance(hyper, AdamWHyper):
        raise TypeError(
            f"{op}: expected the update's hyperparameters as a colfunc.ops.AdamWHyper(step=, lr=, "
            f"...), got {type(hyper).__name__}"
        )


def adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
) -> None:
    """The fused AdamW's lists (float params and grads, fp32 moments) and hyperparameters."""
    adamw_lists(
        "adamw_",
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_dtypes=FLOAT_DTYPES,
        grad_dtypes=FLOAT_DTYPES,
    )
    adamw_hyper("adamw_", hyper)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> None:
    """NF4 codes: contiguous uint8 ``[..., n / 2]``, contiguous fp32 absmax ``[..., n / 64]``
    (one per 64 values, on the same device), a floating output dtype."""
    if packed.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(
            f"dequantize_nf4: codes must be uint8 and absmax float32, got {packed.dtype} and "
            f"{absmax.dtype}"
        )
    if not (packed.is_contiguous() and absmax.is_contiguous()):
        raise ValueError("dequantize_nf4: codes and absmax must be contiguous")
    if packed.shape[:-1] != absmax.shape[:-1] or packed.shape[-1] != 32 * absmax.shape[-1]:
        raise ValueError(
            f"dequantize_nf4: codes {list(packed.shape)} and absmax {list(absmax.shape)} do not "
            "match (32 bytes, 64 values, per absmax)"
        )
    if dtype not in FLOAT_DTYPES and dtype != torch.float64:
        raise ValueError(f"dequantize_nf4: the output dtype must be floating, got {dtype}")


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> None:
    """Rows ``x[N, I]`` and expert weights ``w[E, I, O]`` of one floating dtype the kernel
    takes, on one device; ``sizes``: E counts summing to N."""
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"grouped_matmul: x and w must share a dtype of {list(FLOAT_DTYPES)}, got {x.dtype} "
            f"and {w.dtype}"
        )
    if x.device != w.device:
        raise ValueError(f"grouped_matmul: x is on {x.device}, w on {w.device}")
    if len(sizes) != w.shape[0] or sum(sizes) != x.shape[0]:
        raise ValueError(
            f"grouped_matmul: {len(sizes)} counts summing to {sum(sizes)} for {w.shape[0]} "
            f"experts and {x.shape[0]} rows"
        )
