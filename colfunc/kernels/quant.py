"""NF4 dequantization (QLoRA's frozen base): one program per block of bytes, each byte two codes
looked up in the 16-value table and scaled by their block's absmax, written in the output dtype.

Legend: n values (all dims flattened), n / 2 bytes, n / 64 blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from colfunc.kernels import checks
from colfunc.ops.values import NF4

__all__ = ["dequantize_nf4"]

INTERPRETED = checks.interpreting()  # how the kernel below was decorated (read once, at import)
BYTES = 1024  # bytes per program


@triton.jit
def _nf4_kernel(
    packed_ptr,  # [n / 2] uint8, two codes a byte, the high nibble first
    absmax_ptr,  # [n / 64] fp32
    table_ptr,  # [16] fp32
    out_ptr,  # [n]
    n_bytes,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + offs // 32, mask=mask, other=0.0)  # (64 values: 32 bytes)
    hi = tl.load(table_ptr + (byte >> 4), mask=mask, other=0.0) * scale
    lo = tl.load(table_ptr + (byte & 15), mask=mask, other=0.0) * scale
    tl.store(out_ptr + 2 * offs, hi.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + 2 * offs + 1, lo.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`colfunc.ops.reference.dequantize_nf4` on the device, in one pass."""
    checks.dequantize_nf4(packed, absmax, dtype)
    out = torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    if n_bytes:
        table = torch.tensor(NF4, dtype=torch.float32, device=packed.device)
        grid = (triton.cdiv(n_bytes, BYTES),)
        _nf4_kernel[grid](packed, absmax, table, out, n_bytes, BLOCK=BYTES)
    return out
