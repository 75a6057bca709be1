"""A linear weight with a low-rank adapter beside it (LoRA, Hu et al. 2021).

:class:`LowRank` stands where a model's layer reads a weight ``w[in, out]``; :func:`colfunc.nn.linear`
then computes ``x @ w + (dropout(x) @ a) @ b * scale`` without ever forming ``w + a @ b``, so the
frozen base needs no gradient of its own and no merged copy (``colfunc.lora`` puts it there).

Legend: I input features, O output features, R the adapter's rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LowRank", "LowRanks", "column_norms"]


def column_norms(w: torch.Tensor) -> torch.Tensor:
    """The norm of each output column of ``w[..., in, out]``: ``[..., out]`` (DoRA's). Written
    as a sum of squares, which a tensor-parallel split of ``in`` reduces as any sum."""
    return w.mul(w).sum(dim=-2).sqrt()


def _refused(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Any torch function handed an adapted weight: refused, naming it (the adapter would be
    lost)."""
    owner = next((x for x in (*args, *(kwargs or {}).values()) if isinstance(x, cls)), None)
    path = getattr(owner, "path", "?")
    name = getattr(func, "__name__", repr(func))
    raise ValueError(
        f"lora: the model uses the adapted weight {path} in {name}(), not through "
        "colfunc.nn.linear; a LoRA target must be the weight of a linear map (drop it from "
        "targets)"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class LowRank:
    """The weight ``w_IO`` with the adapter ``a_IR @ b_RO * scale``.

    ``dropout``: the probability with which the adapter's input is dropped (training only, from
    torch's global generator, as ``torch.nn.Dropout``); ``path``: the weight's parameter path,
    for errors. Only :func:`colfunc.nn.linear` reads it: any other use (an embedding lookup, a
    reshape) is refused by name, since the adapter would be lost.
    """

    w: Any
    a: Any
    b: Any
    scale: float
    dropout: float = 0.0
    path: str = "?"
    m: Any = None  # DoRA's magnitude per output, or None

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def device(self) -> torch.device:
        return self.w.device

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, linear: Any) -> torch.Tensor:
        """``x @ w + bias`` plus the adapter's term, each product through ``linear`` (the plain
        :func:`colfunc.nn.linear`, so tensor and sequence parallelism apply to every one)."""
        w = self.w
        # (a weight kept quantized, colfunc.adapters.quant.Dequantized, multiplies itself)
        packed = type(w) is not torch.Tensor and hasattr(w, "linear")
        dora = self.m is not None
        y = (
            w.linear(x, None if dora else bias, linear)
            if packed
            else linear(x, w, None if dora else bias)
        )
        h = F.dropout(x, self.dropout, training=torch.is_grad_enabled()) if self.dropout else x
        lora = linear(linear(h, self.a), self.b)
        if not dora:
            return torch.add(y, lora, alpha=self.scale)
        # DoRA (Liu et al. 2024): each output column of w + a b scale rescaled to the magnitude
        # m; the column norms are taken as constants (no gradient), as the paper and peft do
        with torch.no_grad():
            full = w.dequantized() if packed else w
            merged = full + torch.matmul(self.a, self.b) * self.scale
            norm = column_norms(merged)
        out = torch.add(y, lora, alpha=self.scale) * (self.m / norm)
        return out if bias is None else out + bias

    __torch_function__ = classmethod(_refused)


@dataclasses.dataclass(frozen=True, eq=False)
class LowRanks:
    """The weight ``w_IO`` with several adapters, one chosen per row of the input (a batch of
    requests served with different adapters, S-LoRA / Punica style): ``a_KIR``, ``b_KRO`` (the
    scale folded into ``b``), and ``rows``, for each adapter ``k`` in use, the indices of the
    rows (tokens, flattened) it applies to. Rows not named get the plain weight."""

    w: Any
    a: torch.Tensor
    b: torch.Tensor
    rows: dict[int, torch.Tensor]
    path: str = "?"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, linear: Any) -> torch.Tensor:
        y = linear(x, self.w, bias)
        if not self.rows:
            return y
        x_NI, y_NO = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for k, r in self.rows.items():  # each adapter's rows gathered, multiplied, added back
            y_NO.index_add_(0, r, (x_NI.index_select(0, r) @ self.a[k]) @ self.b[k])
        return y

    __torch_function__ = classmethod(_refused)
