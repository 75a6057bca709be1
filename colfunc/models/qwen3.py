"""Qwen 3 (dense): the shared decoder (:mod:`colfunc.models.decoder`) with an RMS norm over each
query and key head before the rotation, a head dim of its own, and biases on all four attention
projections when ``attention_bias``.

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
    """Qwen 3 sizes (see :class:`colfunc.models.decoder.Config`): q/k norms, rotary base 10^6,
    RMS norm epsilon 1e-6; ``qkv_bias`` and ``o_bias`` together are Hugging Face's
    ``attention_bias``."""

    family_name = "qwen3"
    variations = ("mlp_act", "layer_types")
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.qk_norm and self.qkv_bias == self.o_bias,
            "Qwen 3 has q/k norms (qk_norm=True) and biases on all four attention projections "
            "or none",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(qkv_bias=True, o_bias=True, bias_optional=True)
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    window, types = _window(c, "Qwen3")
    bias = bool(getattr(c, "attention_bias", False))
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Qwen3", qkv_bias=bias, o_bias=bias, sliding_window=window, layer_types=types
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {
        **decoder_hf.write_hf_config(cfg),
        "attention_bias": cfg.qkv_bias,
        **_write_window(cfg),
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    read=_read,
    write=_write,
)
