"""Many LoRA adapters served at once over one base (S-LoRA, Punica): each request names its adapter,
and one batch mixes requests of different adapters and of the base.

The engine keeps, beside each adapted weight ``w[in, out]`` of the base, every loaded adapter's
``a`` and ``b`` stacked (``a[L, K, in, R]``, ``b[L, K, R, out]``: ``K`` slots, ``R`` the largest
rank, smaller ranks padded with zeros, each adapter's scale folded into its ``b``; an adapter that
leaves a weight alone has zeros there). In a step, every weight is a :class:`colfunc.nn.LowRanks`:
the plain product for the whole batch, then for each adapter in use its low-rank product over
its own requests' tokens, gathered and added back.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import nn, tree
from colfunc.adapters.lora import (
    AttachLayers,
    LoraConfig,
    _set,
    adapter_paths,
    attach,
    base_of,
    is_adapter,
    outside_blocks,
)
from colfunc.adapters.quant import is_quantized

__all__ = ["AdapterSlots"]

PyTree = Any


class AdapterSlots:
    """The adapters an engine serves, by name, in at most ``max_loras`` slots."""

    def __init__(self, max_loras: int) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
            raise ValueError(f"Engine: max_loras must be an int >= 0, got {max_loras!r}")
        self.max_loras = max_loras
        self.names: list[str] = []
        # name -> {weight path: (a [..., in, r], b * scale [..., r, out])}
        self.weights: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, name: str, config: LoraConfig, adapters: PyTree, params: PyTree) -> None:
        """Load an adapter (a peft folder's, as :func:`colfunc.hf.load_adapter` reads it)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"Engine.add_lora: name must be a non-empty str, got {name!r}")
        if name in self.weights:
            raise ValueError(f"Engine.add_lora: an adapter named {name!r} is already loaded")
        if len(self.names) >= self.max_loras:
            raise ValueError(
                f"Engine.add_lora: the engine holds at most max_loras={self.max_loras} adapters "
                f"({self.names} loaded); build it with a larger max_loras"
            )
        if config.dora:
            raise ValueError(
                f"Engine.add_lora: {name!r} is a DoRA adapter, which is not served beside others; "
                "merge it into the base (colfunc.adapters.merge) and serve that"
            )
        flat = dict(tree.flatten_with_paths(adapters)[0])
        base = dict(tree.flatten_with_paths(params)[0])
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for w in sorted({base_of(p) for p in flat if is_adapter(p)}):
            a, b = flat[adapter_paths(config.leader(w))[0]], flat[adapter_paths(w)[1]]
            have = base.get(w)
            if have is None or is_quantized(have) or tuple(have.shape[:-2]) != tuple(a.shape[:-2]):
                raise ValueError(f"Engine.add_lora: {name!r} adapts {w}, which the model lacks")
            if (a.shape[-2], b.shape[-1]) != (have.shape[-2], have.shape[-1]):
                raise ValueError(
                    f"Engine.add_lora: {name!r}'s adapter of {w} is {list(a.shape)} x "
                    f"{list(b.shape)}; the weight is {list(have.shape)}"
                )
            dtype, device = have.dtype, have.device
            weights[w] = (
                a.to(device=device, dtype=dtype),
                (b * config.scale).to(device=device, dtype=dtype),
            )
        if not weights:
            raise ValueError(f"Engine.add_lora: {name!r} holds no adapter weights")
        self.weights[name] = weights
        self.names.append(name)

    def slot(self, name: str | None) -> int | None:
        """The slot of the adapter ``name`` (None: the base)."""
        if name is None:
            return None
        if name not in self.weights:
            raise ValueError(
                f"Engine: no adapter named {name!r} is loaded; loaded: {self.names or 'none'}"
            )
        return self.names.index(name)

    def stacked(self, params: PyTree) -> PyTree:
        """``params`` with every loaded adapter stacked beside its weight (in ``lora`` dicts)."""
        weights = sorted({w for ws in self.weights.values() for w in ws})
        rank = max(a.shape[-1] for ws in self.weights.values() for a, _ in ws.values())
        flat = dict(tree.flatten_with_paths(params)[0])
        out = params
        for w in weights:
            like = flat[w]
            lead, n_in, n_out = tuple(like.shape[:-2]), like.shape[-2], like.shape[-1]
            K = len(self.names)
            a = torch.zeros((*lead, K, n_in, rank), dtype=like.dtype, device=like.device)
            b = torch.zeros((*lead, K, rank, n_out), dtype=like.dtype, device=like.device)
            for k, name in enumerate(self.names):
                if w in self.weights[name]:
                    ak, bk = self.weights[name][w]
                    r = ak.shape[-1]
                    a[..., k, :, :r] = ak
                    b[..., k, :r, :] = bk
            a_path, b_path = adapter_paths(w)
            out = _set(out, a_path, a)
            out = _set(out, b_path, b)
        return out


def _lowranks(rows: dict[int, torch.Tensor]) -> Any:
    """How a weight with its stacked adapters is attached for the rows of ``rows``."""
    return lambda path, w, ad, group: nn.LowRanks(w, ad["a"], ad["b"], rows, path)


class Rows(AttachLayers):
    """Context frame for one engine step: every scanned layer reads its adapters for the rows
    of ``rows`` (adapter slot -> token indices), the weights outside the layers (the head,
    which a paged forward applies to the sampled rows only) for those of ``sampled``."""

    def __init__(self, rows: dict[int, torch.Tensor], sampled: dict[int, torch.Tensor]) -> None:
        super().__init__(lambda layer: attach(layer, "blocks.", _lowranks(rows)))
        self.sampled = sampled

    def top(self, params: PyTree) -> PyTree:
        return outside_blocks(params, lambda rest: attach(rest, "", _lowranks(self.sampled)))


def rows_of(slots: list[int | None], device: torch.device) -> dict[int, torch.Tensor]:
    """``{slot: the indices of its tokens}`` from each token's slot (None: the base)."""
    out: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s is not None:
            out.setdefault(s, []).append(i)
    return {s: torch.tensor(ix, dtype=torch.long, device=device) for s, ix in out.items()}
