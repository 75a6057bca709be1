"""Mistral: the shared decoder (:mod:`colfunc.models.decoder`) as LLaMA's, read from and written
to Hugging Face's ``MistralForCausalLM``.

Mistral 7B v0.1's sliding window (4096) is the decoder's ``sliding_window``: each token attends
to its last ``sliding_window`` tokens, in training and in the engine. ``sliding_window=None``
(v0.2 on), or a window no shorter than ``max_position_embeddings``, attends to everything.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes

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
    """Mistral sizes (see :class:`colfunc.models.decoder.Config`): no biases, rotary base 10^6
    (v0.2 on), RMS norm epsilon 1e-5."""

    family_name = "mistral"
    variations = ("mlp_act",)
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        none = not (self.qkv_bias or self.o_bias or self.qk_norm)
        self.require_variations(none, "Mistral has no attention biases and no q/k norms")


tp_plans: dict[str, dict[str, P]] = decoder.plans()
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    window = getattr(c, "sliding_window", None)
    return decoder_hf.read_hf_config(c, Config, "Mistral", sliding_window=window)  # type: ignore[return-value]


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {**decoder_hf.write_hf_config(cfg), "sliding_window": cfg.sliding_window}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="MistralForCausalLM",
    model_type="mistral",
    read=_read,
    write=_write,
)
