"""RMSNorm, the rotary embedding and the product of a few rows with a weight, on plain CPU
tensors whose gradient is not wanted (a decoding step, generation, evaluation), by the compiled
kernels beside the decode attention (:mod:`colfunc.kernels.cpu_attention`).

In a step of a few tokens each of these is several eager operators on a tensor of a few hundred
elements (RMSNorm six, the rotation nine), where each operator's dispatch costs more than its
arithmetic; here each is one call. They compute what :func:`colfunc.ops.reference.rms_norm` and
:func:`colfunc.ops.reference.rope` compute, in the same precision (fp32, or fp64), up to the
order of the sum of squares; :func:`linear` what ``x @ w + b`` computes, up to the order of
each sum (a few rows: a decoding step's tokens; a general matmul repacks the weight for every
call, which for so few rows costs more than its arithmetic, while the kernel streams the weight
once where it lies, in either stored layout). Anything else (a gradient wanted, a ``torch.func`` transform, a
tensor subclass such as a ShardedTensor, another dtype or layout, a machine that cannot build the
kernels) returns None, and the caller runs the reference.
"""

from __future__ import annotations

import functools

import torch

from colfunc import torch_private

__all__ = ["MAX_ROWS", "linear", "rms_norm", "rope"]

DTYPES = (torch.float32, torch.float64)
MAX_ROWS = 16  # the most rows :func:`linear` takes (past it a general matmul does as well)


def _takes(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors of one of :data:`DTYPES`, alike, without a gradient wanted."""
    first = tensors[0]
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype != first.dtype:
            return False
    if first.dtype not in DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not torch_private.are_functorch_transforms_active()


def _extension() -> object | None:
    from colfunc.kernels import cpu_attention

    return cpu_attention.extension()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of a contiguous ``x`` (times ``weight`` where given), or None
    where the kernel does not take these."""
    present = (x,) if weight is None else (x, weight)
    if not _takes(*present) or x.dim() == 0 or not x.is_contiguous():
        return None
    D = x.shape[-1]
    if weight is not None and (weight.shape != (D,) or not weight.is_contiguous()):
        return None
    ext = _extension()
    if ext is None or D == 0:
        return None
    out = torch.empty_like(x)
    w = weight.data_ptr() if weight is not None else 0
    fp64, threads = x.dtype == torch.float64, torch.get_num_threads()
    ext.rms_norm(out.data_ptr(), x.data_ptr(), w, x.numel() // D, D, float(eps), fp64, threads)  # type: ignore[attr-defined]
    return out


def rope(x_BHTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor | None:
    """The rotate-half rotary embedding of ``x`` whose heads are split from a projection
    (``x.transpose(-3, -2)`` contiguous: ``[..., T, H, D]`` in memory, as the attention makes
    them), handed back in that layout; None where the kernel does not take these."""
    if x_BHTD.dim() < 3 or not _takes(x_BHTD) or not _takes(cos_TK, sin_TK):
        return None
    D = x_BHTD.shape[-1]
    T, K = x_BHTD.shape[-2], D // 2
    if D % 2 or cos_TK.shape != (T, K) or sin_TK.shape != (T, K) or D == 0:
        return None
    x_THD = x_BHTD.transpose(-3, -2)
    if not x_THD.is_contiguous():
        return None
    ext = _extension()
    if ext is None:
        return None
    cos, sin = (t.to(x_BHTD.dtype).contiguous() for t in (cos_TK, sin_TK))
    out = torch.empty_like(x_THD)
    H, fp64 = x_THD.shape[-2], x_BHTD.dtype == torch.float64
    rows = x_THD.numel() // D
    ext.rope(out.data_ptr(), x_THD.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, H, T, D, fp64,  # type: ignore[attr-defined]
             torch.get_num_threads())  # fmt: skip
    return out.transpose(-3, -2)


@functools.cache
def _linear_extension() -> object | None:
    """The extension where this CPU has a vector unit the product is written for (AVX-512, or
    AVX2 with FMA), else None."""
    ext = _extension()
    return ext if ext is not None and ext.linear_isa() > 0 else None  # type: ignore[attr-defined]


def linear(x: torch.Tensor, w_IO: torch.Tensor, b_O: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ w + b`` for at most :data:`MAX_ROWS` rows of fp32 ``x`` (``[..., in]``
    contiguous) and a ``w`` stored ``[in, out]`` or ``[out, in]`` (``w.t()`` contiguous: a
    Hugging Face projection, a tied embedding table as the head); None where the kernel does not
    take these."""
    present = (x, w_IO) if b_O is None else (x, w_IO, b_O)
    if not _takes(*present) or x.dtype != torch.float32 or w_IO.dim() != 2 or x.dim() == 0:
        return None
    K, N = w_IO.shape
    if x.shape[-1] != K or K == 0 or N == 0 or not (0 < x.numel() <= MAX_ROWS * K):
        return None
    transposed = not w_IO.is_contiguous()
    if not x.is_contiguous() or (transposed and not w_IO.t().is_contiguous()):
        return None
    if b_O is not None and (b_O.shape != (N,) or not b_O.is_contiguous()):
        return None
    ext = _linear_extension()
    if ext is None:
        return None
    out = x.new_empty(*x.shape[:-1], N)
    bias = b_O.data_ptr() if b_O is not None else 0
    ext.linear(out.data_ptr(), x.data_ptr(), w_IO.data_ptr(), bias, x.numel() // K, K, N,  # type: ignore[attr-defined]
               transposed, torch.get_num_threads())  # fmt: skip
    return out
