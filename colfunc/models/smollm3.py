"""SmolLM 3: the shared decoder (:mod:`colfunc.models.decoder`) as LLaMA's, with some layers
without rotary positions (``nope_layers``, Hugging Face's ``no_rope_layers`` with 0 for those)
and optionally sliding-window layers named by ``layer_types``, read from and written to Hugging
Face's ``SmolLM3ForCausalLM``."""

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
    """SmolLM 3 sizes (see :class:`colfunc.models.decoder.Config`): LLaMA's, every fourth layer
    without rotary positions by default in Hugging Face's configs (here: ``nope_layers``),
    tied embeddings; ``qkv_bias`` and ``o_bias`` together are ``attention_bias``."""

    family_name = "smollm3"
    variations = ("mlp_act", "nope_layers", "layer_types")
    rope_theta: float = 2_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            not self.qk_norm and self.qkv_bias == self.o_bias,
            "SmolLM 3 has no q/k norms, and biases on all four attention projections or none",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(qkv_bias=True, o_bias=True, bias_optional=True)
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    bias = bool(getattr(c, "attention_bias", False))
    # (layers slide only with use_sliding_window, whatever layer_types says)
    slides = getattr(c, "use_sliding_window", False)
    window, types = decoder_hf.read_layer_types(c) if slides else (None, None)
    uses = list(getattr(c, "no_rope_layers", None) or [1] * c.num_hidden_layers)
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c,
        Config,
        "SmolLM 3",
        sliding_window=window,
        qkv_bias=bias,
        o_bias=bias,
        layer_types=types,
        nope_layers=tuple(i for i, use in enumerate(uses) if not use),
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    windows = decoder_hf.write_layer_types(cfg)
    return {
        **decoder_hf.write_hf_config(cfg),
        **windows,
        "use_sliding_window": cfg.sliding_window is not None,
        "attention_bias": cfg.qkv_bias,
        "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layer)],
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="SmolLM3ForCausalLM",
    model_type="smollm3",
    read=_read,
    write=_write,
)
