"""Qwen 2 and Qwen 2.5: the shared decoder (:mod:`colfunc.models.decoder`) with biases on the
q, k and v projections.

Sliding-window attention (``use_sliding_window=True`` in a Hugging Face config) is the decoder's
``sliding_window`` on the layers that slide: every one (``max_window_layers=0``), or some, by
``layer_types`` (in transformers 4.x the layers from ``max_window_layers`` on).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes
from colfunc.models.decoder_hf import read_window as _window
from colfunc.models.decoder_hf import write_window as _write_window

__all__ = [
    "Config",
    "apply",
    "family",
    "init",
    "loss",
    "paged_forward",
    "param_shapes",
    "tp_plan",
    "tp_plans",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(decoder.Config):
    """Qwen 2 sizes (see :class:`colfunc.models.decoder.Config`): q/k/v biases, rotary base
    10^6, RMS norm epsilon 1e-6."""

    family_name = "qwen2"
    variations = ("mlp_act", "layer_types")
    qkv_bias: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.qkv_bias and not (self.o_bias or self.qk_norm),
            "Qwen 2 has q/k/v biases (qkv_bias=True), no output-projection bias and no q/k norms",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(qkv_bias=True)
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    window, types = _window(c, "Qwen2")
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Qwen2", sliding_window=window, layer_types=types
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {**decoder_hf.write_hf_config(cfg), **_write_window(cfg)}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    read=_read,
    write=_write,
)
