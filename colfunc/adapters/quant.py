"""Frozen base weights stored in 4 or 8 bits (QLoRA, Dettmers et al. 2023), dequantized one layer
at a time just before their matmul.

``"nf4"``: 4-bit NormalFloat, the 16 values of :data:`NF4` (quantiles of a standard normal,
rescaled to [-1, 1], with an exact zero), two codes a byte, and one fp32 absmax per block of 64
consecutive values along the output dim. ``"int8"``: symmetric 8-bit integers, one fp32 absmax
per block of 64 likewise. A quantized weight ``w[..., in, out]`` is a dict in the parameter tree:

- ``{"nf4": uint8[..., in, out / 2], "absmax": float32[..., in, out / 64]}``
- ``{"int8": int8[..., in, out], "absmax": float32[..., in, out / 64]}``

so every transform lays it out as it lays out ``w`` (a tensor-parallel split of ``out`` splits
the codes and the scales alike, ZeRO cuts and offload streams the packed bytes: a quarter of a
bf16 base, an eighth of an fp32 one, plus the scales).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from colfunc import ops
from colfunc.ops.values import NF4, NF4_BLOCK

__all__ = [
    "BLOCK",
    "FORMATS",
    "NF4",
    "Dequantized",
    "dequantize",
    "is_quantized",
    "meta_quantized",
    "packed_bytes",
    "quantize",
    "unpacked_shape",
]

BLOCK = NF4_BLOCK  # values per absmax (int8's too)
FORMATS = ("nf4", "int8")

_NF4_MIDS = tuple((a + b) / 2 for a, b in itertools.pairwise(NF4))  # decision boundaries


def unpacked_shape(q: dict[str, Any]) -> tuple[int, ...]:
    """The shape of the weight the quantized dict ``q`` stands for."""
    codes = q["nf4"] if "nf4" in q else q["int8"]
    return (*codes.shape[:-1], codes.shape[-1] * (2 if "nf4" in q else 1))


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a quantized weight's dict."""
    return type(x) is dict and "absmax" in x and len(x) == 2 and any(f in x for f in FORMATS)


def _check(w: torch.Tensor, fmt: str, path: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"lora: base_dtype must be None or one of {FORMATS}, got {fmt!r}")
    if w.shape[-1] % BLOCK:
        raise ValueError(
            f"lora: {path} has {w.shape[-1]} outputs, not a multiple of the quantization block "
            f"({BLOCK}); leave it out of targets or use base_dtype=None"
        )


def quantize(w: torch.Tensor, fmt: str, path: str = "?") -> dict[str, torch.Tensor]:
    """The quantized dict of ``w[..., in, out]`` in format ``fmt`` (see the module docstring)."""
    _check(w, fmt, path)
    blocks = w.detach().float().unflatten(-1, (-1, BLOCK))  # [..., in, out/64, 64]
    absmax = blocks.abs().amax(-1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = blocks / safe.unsqueeze(-1)
    if fmt == "int8":
        codes = (scaled * 127).round_().clamp_(-127, 127).to(torch.int8)
        return {"int8": codes.flatten(-2).contiguous(), "absmax": absmax.contiguous()}
    mids = torch.tensor(_NF4_MIDS, dtype=torch.float32, device=w.device)
    idx = torch.bucketize(scaled, mids).to(torch.uint8).flatten(-2)  # 0..15, nearest code
    packed = (idx[..., 0::2] << 4) | idx[..., 1::2]
    return {"nf4": packed.contiguous(), "absmax": absmax.contiguous()}


def dequantize(q: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The weight ``q`` stands for, in ``dtype``: codes looked up (or scaled), times their
    block's absmax. Works on a layer's slice as on the whole stack, and on the pieces of a
    tensor-parallel split (blocks never straddle one: each rank dequantizes its own)."""
    codes = q["nf4"] if "nf4" in q else q["int8"]
    if type(codes) is not torch.Tensor and hasattr(codes, "_local"):
        sharded: Any = codes
        local = _dequantize({k: v._local for k, v in q.items()}, dtype)
        return type(codes)(local, sharded.mesh, sharded.placements, unpacked_shape(q))
    return _dequantize(q, dtype)


def _dequantize(q: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    if "nf4" in q:  # (a Triton kernel on the GPU, the vectorized reference elsewhere)
        return ops.dequantize_nf4(q["nf4"].contiguous(), q["absmax"].contiguous(), dtype)
    codes = q["int8"].to(torch.float32).div_(127.0)
    codes.unflatten(-1, (-1, BLOCK)).mul_(q["absmax"].unsqueeze(-1))
    return codes.to(dtype)


def packed_bytes(numel: int, fmt: str) -> int:
    """Bytes of a quantized weight of ``numel`` values: its codes and its scales."""
    codes = numel // 2 if fmt == "nf4" else numel
    return codes + 4 * (numel // BLOCK)


class _Matmul(torch.autograd.Function):
    """``x @ dequantize(q)`` that keeps the packed codes for the backward pass, not the weight:
    the backward dequantizes again (as bitsandbytes' 4-bit matmul), so a layer's full-width
    weight lives only while its product is computed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: str, dtype: torch.dtype, fn: Any, *qs: Any) -> Any:
        codes, absmax = qs
        ctx.fmt, ctx.dtype, ctx.fn = fmt, dtype, fn
        ctx.save_for_backward(codes, absmax)
        return fn(x, dequantize({fmt: codes, "absmax": absmax}, dtype))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        codes, absmax = ctx.saved_tensors
        w = dequantize({ctx.fmt: codes, "absmax": absmax}, ctx.dtype)
        return ctx.fn(dy, w.t()), None, None, None, None, None


class Dequantized:
    """A quantized weight where a model reads one: :class:`colfunc.nn.LowRank` multiplies by
    it through :meth:`linear`, dequantizing it there (and again in the backward pass)."""

    def __init__(self, q: dict[str, Any], dtype: torch.dtype) -> None:
        self.q, self.dtype = q, dtype
        self.fmt = "nf4" if "nf4" in q else "int8"
        self.shape = torch.Size(unpacked_shape(q))
        self.device = q[self.fmt].device

    def dequantized(self) -> torch.Tensor:
        """The whole weight (DoRA's column norms read it)."""
        return dequantize(self.q, self.dtype)

    def linear(self, x: torch.Tensor, bias: Any, fn: Any) -> torch.Tensor:
        y = _Matmul.apply(x, self.fmt, self.dtype, fn, self.q[self.fmt], self.q["absmax"])
        return y if bias is None else y + bias


def meta_quantized(w: torch.Tensor, fmt: str, path: str) -> dict[str, torch.Tensor]:
    """A dry run's quantized weight: its codes and scales on the meta device."""
    _check(w, fmt, path)
    *lead, n_in, n_out = w.shape
    codes = (*lead, n_in, n_out // 2 if fmt == "nf4" else n_out)
    dtype = torch.uint8 if fmt == "nf4" else torch.int8
    return {
        fmt: torch.empty(codes, dtype=dtype, device="meta"),
        "absmax": torch.empty((*lead, n_in, n_out // BLOCK), device="meta"),
    }
