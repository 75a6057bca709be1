"""Adapters and the weights they adapt: merged into them, or put beside them."""

from __future__ import annotations

from typing import Any

import torch

from colfunc import tree
from colfunc.adapters import quant
from colfunc.adapters.lora import (
    LoraConfig,
    _get,
    _set,
    adapter_paths,
    base_of,
    is_adapter,
    magnitude_path,
)
from colfunc.nn.lowrank import column_norms

__all__ = ["combine", "merge"]

PyTree = Any


def merge(params: PyTree, config: LoraConfig) -> PyTree:
    """``params`` without adapters, each adapted weight replaced by ``w + a @ b * scale`` (DoRA's
    columns rescaled to their magnitudes; its
    dtype kept; a quantized base dequantized, in the adapters' dtype): the model the adapters
    make, for export or serving without them."""
    flat = dict(tree.flatten_with_paths(params)[0])
    out = tree.subset(params, lambda p: not is_adapter(p))
    for w in sorted({base_of(p) for p in flat if is_adapter(p)}):
        a, b = flat[adapter_paths(config.leader(w))[0]], flat[adapter_paths(w)[1]]
        base = _get(params, w)
        if quant.is_quantized(base):
            base = quant.dequantize(base, a.dtype)
        delta = torch.matmul(a.to(torch.float64), b.to(torch.float64)) * config.scale
        merged = base.to(torch.float64) + delta
        m = flat.get(magnitude_path(w))
        if m is not None:  # DoRA: each output column rescaled to its magnitude
            merged = merged * (m.to(torch.float64) / column_norms(merged)).unsqueeze(-2)
        out = _set(out, w, merged.to(base.dtype))
    return out


def combine(params: PyTree, adapters: PyTree) -> PyTree:
    """``params`` with the adapter leaves of ``adapters`` (from :func:`colfunc.hf.load_adapter`
    or a saved run) put in place; a path both hold, or a leaf of ``adapters`` that is not an
    adapter, is an error."""
    flat = dict(tree.flatten_with_paths(params)[0])
    out = params
    for path, x in tree.flatten_with_paths(adapters)[0]:
        if not is_adapter(path):
            raise ValueError(f"combine: {path} is not an adapter path (…lora.<weight>.a or .b)")
        if path in flat:
            raise ValueError(f"combine: params already hold {path}")
        if base_of(path) not in flat:
            raise ValueError(f"combine: {path} adapts {base_of(path)}, which params lack")
        out = _set(out, path, x)
    return out
