"""The Qwen configs' sliding window (``use_sliding_window``, ``sliding_window``,
``max_window_layers``, ``layer_types``), read and written for :mod:`colfunc.models.qwen2` and
:mod:`colfunc.models.qwen3`."""

from __future__ import annotations

from typing import Any

__all__ = ["read_window", "write_window"]


def read_window(c: Any, label: str) -> int | None:
    """The window every layer of the Hugging Face config ``c`` slides by (None: no layer
    slides); a ValueError naming the fields where some layers slide and others do not."""
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", False) else None
    types = getattr(c, "layer_types", None)
    if types is None:  # transformers 4.x: the layers from max_window_layers on slide
        start = getattr(c, "max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(n)]  # fmt: skip
    sliding = [t == "sliding_attention" for t in types]
    if window is None or not any(sliding):
        return None  # (one no shorter than the context: None too, in read_hf_config)
    if not all(sliding):
        raise ValueError(
            f"from_hf: {label} with use_sliding_window=True and layer_types {list(types)} "
            f"(max_window_layers={getattr(c, 'max_window_layers', None)}) is not supported: "
            "colfunc's model slides every layer or none (max_window_layers=0, or "
            "use_sliding_window=False)"
        )
    return int(window)


def write_window(cfg: Any) -> dict[str, Any]:
    """The config fields of ``cfg.sliding_window``: every layer slides, or none."""
    if cfg.sliding_window is None:
        return {"use_sliding_window": False}
    return {
        "use_sliding_window": True,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": 0,
    }
