"""Each op's choice between its Triton kernel and its plain PyTorch reference.

``COLFUNC_KERNELS`` is read at every call, so a script or a test can switch it at any time:

- ``auto`` (the default): the Triton kernel for CUDA tensors it takes, when Triton is installed;
  the C++ decode attention (:mod:`colfunc.ops.cpu_attention`) for the decoding sequences of a
  paged attention on CPU tensors; :mod:`colfunc.ops.cpu_loss`'s cross-entropy for plain tensors
  that need a gradient; the reference for everything else (CPU tensors, a head dim the
  kernel lacks, tensor subclasses such as a ShardedTensor, tensors under a ``torch.func``
  transform).
- ``triton``: the Triton kernel always; CPU tensors only under ``TRITON_INTERPRET=1``. Inputs the
  kernel does not take raise ValueError before anything is launched.
- ``torch``: the reference always.

Kernel modules are imported on first use, never here: importing :mod:`colfunc.ops` costs no
Triton import, and ``TRITON_INTERPRET`` (which Triton reads when a kernel module is imported) can
still be set after it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from colfunc import core
from colfunc.kernels import checks
from colfunc.ops import cpu_attention, cpu_loss, cpu_rows, reference
from colfunc.ops.values import AdamWHyper, PagedBatch

__all__ = [
    "CHOICES",
    "adamw_",
    "attention",
    "attention_block",
    "attention_block_backward",
    "attention_lse",
    "cross_entropy",
    "dequantize_nf4",
    "kernels_choice",
    "layer_norm",
    "paged_attention",
    "rms_norm",
    "rope",
    "varlen_attention",
]

CHOICES = ("auto", "triton", "torch")


def kernels_choice() -> str:
    """The value of ``COLFUNC_KERNELS`` now (``auto`` when unset), checked."""
    value = os.environ.get("COLFUNC_KERNELS", "auto")
    if value not in CHOICES:
        raise ValueError(f"COLFUNC_KERNELS={value!r}; expected one of {', '.join(CHOICES)}")
    return value


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel(name: str) -> ModuleType:
    """The Triton module ``colfunc.kernels.<name>``, imported on first use."""
    return importlib.import_module(f"colfunc.kernels.{name}")


def _use_triton(op: str, check: Callable[[], None], tensors: Sequence[torch.Tensor]) -> bool:
    choice = kernels_choice()
    if choice == "torch":
        return False
    if choice == "auto":
        if not (tensors and all(t.is_cuda for t in tensors) and _triton_installed()):
            return False
        # A case the kernel lacks (or a tensor subclass) goes to the reference, which covers it.
        try:
            check()
            checks.device(op, *tensors)
        except ValueError:
            return False
        return True
    if not _triton_installed():
        raise ValueError(f"{op}: COLFUNC_KERNELS=triton but Triton is not installed")
    check()
    if tensors:
        checks.device(op, *tensors)
    return True


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


def attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention, ``q[B,H,T,D]`` against ``k, v[B,Hkv,S,D]`` (H a multiple of Hkv).

    The causal mask is aligned bottom-right when T != S: query ``i`` sees keys ``j <= i + S - T``.
    ``scale`` defaults to ``1/sqrt(D)``. The Triton kernel is flash attention (head dims 16-128).
    Under a sequence-parallel ``shard`` (Ulysses, ring), a frame on the context stack runs it
    across the ranks of the sequence axis (:class:`colfunc.core.AttentionInterceptor`).
    A sliding ``window`` (an int >= 1, causal only) keeps each query's last ``window`` keys,
    itself included; ``softcap`` (a number > 0) caps the scaled scores at ``softcap *
    tanh(s / softcap)`` before the mask (Gemma 2). Both are refused under the long-sequence
    modes. The Triton kernel takes both (a window's query blocks skip the key blocks before
    it); elsewhere the reference computes them, written out.
    """
    if window is not None or softcap is not None:
        return _windowed(q_BHTD, k_BHSD, v_BHSD, causal, scale, window, softcap)
    for frame in core.attention_frames():
        handled = frame.attention(q_BHTD, k_BHSD, v_BHSD, causal, scale)
        if handled is not None:
            return handled
    return _attention(q_BHTD, k_BHSD, v_BHSD, causal, scale)


def check_window(window: int | None, what: str = "attention") -> None:
    """``window`` is None or an int >= 1 (a ValueError naming it otherwise)."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"{what}: window must be None or an int >= 1, got {window!r}")


def check_softcap(softcap: float | None, what: str = "attention") -> None:
    """``softcap`` is None or a number > 0 (a ValueError naming it otherwise)."""
    ok = isinstance(softcap, int | float) and not isinstance(softcap, bool) and softcap > 0
    if softcap is not None and not ok:
        raise ValueError(f"{what}: softcap must be None or a number > 0, got {softcap!r}")


def _windowed(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    check_window(window)
    check_softcap(softcap)
    if window is not None and not causal:
        raise ValueError("attention: a sliding window is for causal attention; pass causal=True")
    if core.attention_frames():
        what = "sliding-window" if window is not None else "soft-capped"
        raise ValueError(
            f"attention: {what} attention under a long-sequence shard (ulysses, ring, "
            "zigzag, usp) is not supported; split the sequence with sequence_parallel=True "
            "(Megatron) or not at all"
        )
    qkv = (q_BHTD, k_BHSD, v_BHSD)
    if _use_triton("attention", lambda: checks.attention(*qkv, causal), qkv):
        out: torch.Tensor = _kernel("attention").attention(*qkv, causal, scale, window, softcap)
        return out
    return reference.attention(*qkv, causal, scale, window=window, softcap=softcap)


def _attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    qkv = (q_BHTD, k_BHSD, v_BHSD)
    if _use_triton("attention", lambda: checks.attention(*qkv, causal), qkv):
        out: torch.Tensor = _kernel("attention").attention(*qkv, causal, scale)
        return out
    return reference.attention(*qkv, causal, scale)


def attention_lse(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` and each query's log-sum-exp ``lse[B,H,T]`` (natural log, fp32; fp64
    for fp64), both differentiable: what merges attentions over disjoint key blocks."""
    qkv = (q_BHTD, k_BHSD, v_BHSD)
    if _use_triton("attention", lambda: checks.attention(*qkv, causal), qkv):
        out: tuple[torch.Tensor, torch.Tensor] = _kernel("attention").attention_lse(
            *qkv, causal, scale
        )
        return out
    return reference.attention_lse(*qkv, causal, scale)


def attention_block(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    causal: bool,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a blockwise attention, ``(out, lse)``, without autograd (ring attention's
    forward step)."""
    qkv = (q_BHTD, k_BHSD, v_BHSD)
    if _use_triton("attention", lambda: checks.attention(*qkv, causal), qkv):
        out: tuple[torch.Tensor, torch.Tensor] = _kernel("attention").attention_block(
            *qkv, causal, scale
        )
        return out
    return reference.attention_block(*qkv, causal, scale)


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
    """One key/value block's gradients ``(dq, dk, dv)`` given the whole attention's ``lse``,
    ``delta = (dout * out).sum(-1)`` and (optionally) ``out`` itself (ring attention's backward
    step)."""
    qkv = (q_BHTD, k_BHSD, v_BHSD)
    if _use_triton("attention", lambda: checks.attention(*qkv, causal), qkv):
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _kernel(
            "attention"
        ).attention_block_backward(*qkv, dout_BHTD, lse_BHT, delta_BHT, causal, scale)
        return out
    return reference.attention_block_backward(
        *qkv, dout_BHTD, lse_BHT, delta_BHT, causal, scale, out_BHTD
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32 (``weight`` may be None)."""
    if _use_triton("rms_norm", lambda: checks.rms_norm(x, weight), _present(x, weight)):
        out: torch.Tensor = _kernel("norms").rms_norm(x, weight, eps)
        return out
    if kernels_choice() == "auto" and (fast := cpu_rows.rms_norm(x, weight, eps)) is not None:
        return fast  # (no gradient wanted, on the CPU: one call, not six operators)
    return reference.rms_norm(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim, statistics in fp32 (``weight``, ``bias`` may be None)."""
    check = lambda: checks.layer_norm(x, weight, bias)  # noqa: E731
    if _use_triton("layer_norm", check, _present(x, weight, bias)):
        out: torch.Tensor = _kernel("norms").layer_norm(x, weight, bias, eps)
        return out
    return reference.layer_norm(x, weight, bias, eps)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NF4 codes (two a byte) with one fp32 absmax per 64 values, as values in ``dtype``
    (QLoRA's frozen base, dequantized before its matmul)."""
    check = lambda: checks.dequantize_nf4(packed, absmax, dtype)  # noqa: E731
    if _use_triton("dequantize_nf4", check, (packed, absmax)):
        out: torch.Tensor = _kernel("quant").dequantize_nf4(packed, absmax, dtype)
        return out
    return reference.dequantize_nf4(packed, absmax, dtype)


def cross_entropy(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not ``ignore_index``, as an fp32 scalar."""
    check = lambda: checks.cross_entropy(logits_NV, labels_N)  # noqa: E731
    if _use_triton("cross_entropy", check, (logits_NV, labels_N)):
        out: torch.Tensor = _kernel("cross_entropy").cross_entropy(
            logits_NV, labels_N, ignore_index
        )
        return out
    if kernels_choice() == "auto" and cpu_loss.applies(logits_NV, labels_N):
        return cpu_loss.cross_entropy(logits_NV, labels_N, ignore_index)
    return reference.cross_entropy(logits_NV, labels_N, ignore_index)


def rope(x_BHTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: ``cos, sin [T, D/2]``."""
    check = lambda: checks.rope(x_BHTD, cos_TK, sin_TK)  # noqa: E731
    if _use_triton("rope", check, (x_BHTD, cos_TK, sin_TK)):
        out: torch.Tensor = _kernel("rope").rope(x_BHTD, cos_TK, sin_TK)
        return out
    if kernels_choice() == "auto" and (fast := cpu_rows.rope(x_BHTD, cos_TK, sin_TK)) is not None:
        return fast
    return reference.rope(x_BHTD, cos_TK, sin_TK)


def adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
) -> None:
    """One AdamW update in place over lists of tensors (``torch.optim.AdamW`` semantics).

    ``hyper.step`` is this update's 1-based count. Moments are fp32; params and grads fp32, bf16
    or fp16. The Triton kernel updates every tensor of a dtype in one launch.

    >>> adamw_(params, grads, exp_avgs, exp_avg_sqs, AdamWHyper(step=1, lr=1e-3, weight_decay=0.01))
    ... # doctest: +SKIP
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    check = lambda: checks.adamw(*lists, hyper)  # noqa: E731
    if _use_triton("adamw_", check, [t for ts in lists for t in ts]):
        _kernel("adamw").adamw_(*lists, hyper)
        return
    reference.adamw_(*lists, hyper)


def _paged_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    query_lens: list[int],
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    # an operator of its own, so that a ShardedTensor sees one op with one sharding rule (heads
    # split alike in the queries, keys, values and the cache) rather than its insides; inside,
    # the tensors are plain (a rank's local heads)
    batch = PagedBatch(block_tables, tuple(context_lens), tuple(query_lens))
    args = (q, k, v, k_cache, v_cache, batch)
    tensors = (q, k, v, k_cache, v_cache, block_tables)
    w, cap = window or None, softcap or None
    if _use_triton("paged_attention", lambda: checks.paged_attention(*args), tensors):
        out: torch.Tensor = _kernel("paged_attention").paged_attention(*args, w, cap)
        return out
    if (
        kernels_choice() == "auto" and 1 in query_lens and cpu_attention.supports(*tensors)
    ):  # decoding on the CPU: the C++ kernel reads each block where it lies
        reference.check_paged_lens(q, batch)
        out = torch.empty(q.shape, dtype=q.dtype)
        cpu_attention.paged_decode_into(out, *args, window=w, softcap=cap)
        reference.paged_prefill_into(out, *args, window=w, softcap=cap)
        return out
    return reference.paged_attention(*args, w, cap)


# (the body stays callable as itself: see paged_attention)
_paged_attention_op = torch.library.custom_op(
    "colfunc::paged_attention", _paged_attention_impl, mutates_args=()
)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(q)


def _plain(*tensors: torch.Tensor) -> bool:
    """Every tensor a plain ``torch.Tensor`` (not a ShardedTensor, not a fake one)."""
    return all(type(t) is torch.Tensor for t in tensors)


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
    """Causal attention of packed sequences (``batch.query_lens`` new tokens each) over a paged KV
    cache holding their first ``batch.context_lens`` tokens (at the blocks of
    ``batch.block_tables``); decode and (chunked) prefill in one call,
    the default scale ``1/sqrt(E)``. See :func:`colfunc.ops.reference.paged_attention`; on
    ShardedTensors, heads split over an axis stay split (``torch.ops.colfunc.paged_attention``
    has its own rule). The Triton kernel (power-of-two block sizes, head dims 16-128) is one
    program per query token and head, streaming its blocks with an online softmax. A sliding
    ``window`` keeps each token's last ``window`` keys, and ``softcap`` caps the scores as
    :func:`attention` does (in the Triton kernel, the C++ CPU decode and the reference alike)."""
    check_window(window, "paged_attention")
    check_softcap(softcap, "paged_attention")
    tensors = (q_NHE, k_NKE, v_NKE, k_cache_CBKE, v_cache_CBKE)
    # plain tensors go to the op's body directly: the operator's own dispatch
    # (which a ShardedTensor, a fake tensor or a mode needs) costs more than a decode step's
    # attention of a layer
    op = _paged_attention_impl if _plain(*tensors) else torch.ops.colfunc.paged_attention
    out: torch.Tensor = op(
        q_NHE,
        k_NKE,
        v_NKE,
        k_cache_CBKE,
        v_cache_CBKE,
        batch.block_tables,
        list(batch.context_lens),
        list(batch.query_lens),
        window or 0,
        float(softcap or 0.0),
    )
    return out


def varlen_attention(
    q_NHE: torch.Tensor, k_NKE: torch.Tensor, v_NKE: torch.Tensor, cu_seqlens: Sequence[int]
) -> torch.Tensor:
    """Causal attention of sequences packed end to end (``cu_seqlens``: ``[0, end_1, ..., N]``,
    as FlashAttention's varlen API), each token seeing the earlier tokens of its own sequence.
    :func:`paged_attention` with nothing cached, on the same kernel."""
    bounds = list(cu_seqlens)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != q_NHE.shape[0]:
        raise ValueError(
            f"varlen_attention: cu_seqlens must run from 0 to the {q_NHE.shape[0]} packed tokens, "
            f"got {bounds}"
        )
    lens = [b - a for a, b in itertools.pairwise(bounds)]
    if min(lens) < 1:
        raise ValueError(f"varlen_attention: cu_seqlens {bounds} has an empty sequence")
    K, E = k_NKE.shape[1:]
    empty = k_NKE.new_zeros(1, 16, K, E)  # one unused block: no context to read
    tables = torch.zeros(len(lens), 1, dtype=torch.int32, device=q_NHE.device)
    batch = PagedBatch(tables, (0,) * len(lens), tuple(lens))
    return paged_attention(q_NHE, k_NKE, v_NKE, empty, empty, batch)
