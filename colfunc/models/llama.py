"""LLaMA (Touvron et al. 2023), Llama 2 and Llama 3: the shared decoder
(:mod:`colfunc.models.decoder`) without biases or q/k norms, with LLaMA 3.1's rotary scaling.

``Config``, ``init``, ``apply``, ``loss``, ``paged_forward`` and ``param_shapes`` are the
decoder's, for a ``Config`` that names this family.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes
from colfunc.models.family import require

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
    """LLaMA sizes (see :class:`colfunc.models.decoder.Config`)."""

    family_name = "llama"
    variations = ("mlp_act",)


tp_plans: dict[str, dict[str, P]] = decoder.plans()
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    require("LLaMA", c, "attention_bias", (False,))
    return decoder_hf.read_hf_config(c, Config, "LLaMA")  # type: ignore[return-value]


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="LlamaForCausalLM",
    model_type="llama",
    read=_read,
    write=decoder_hf.write_hf_config,
)
