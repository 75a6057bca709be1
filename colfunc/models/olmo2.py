"""OLMo 2: the shared decoder (:mod:`colfunc.models.decoder`) with its norms after the attention
and the MLP (``norm_style="post"``: no norm before either) and RMS norms of the queries and keys
over all their heads' width, read from and written to Hugging Face's ``Olmo2ForCausalLM``."""

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
    """OLMo 2 sizes (see :class:`colfunc.models.decoder.Config`): post-norms, q/k norms over the
    whole projection; ``qkv_bias`` and ``o_bias`` together are Hugging Face's
    ``attention_bias``."""

    family_name = "olmo2"
    variations = ("mlp_act", "norm_style", "qk_norm_width")
    norm_style: str = "post"
    qk_norm: bool = True
    qk_norm_width: str = "all"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.norm_style == "post"
            and self.qk_norm
            and self.qk_norm_width == "all"
            and self.qkv_bias == self.o_bias,
            "OLMo 2 has post-norms (norm_style='post'), q/k norms over all heads "
            "(qk_norm_width='all') and biases on all four attention projections or none",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(
    qkv_bias=True, o_bias=True, bias_optional=True, norm_style="post"
)
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    bias = bool(getattr(c, "attention_bias", False))
    return decoder_hf.read_hf_config(c, Config, "OLMo 2", qkv_bias=bias, o_bias=bias)  # type: ignore[return-value]


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {**decoder_hf.write_hf_config(cfg), "attention_bias": cfg.qkv_bias}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    read=_read,
    write=_write,
)
