"""Phi-3 (and Phi-3.5) mini: the shared decoder (:mod:`colfunc.models.decoder`) as LLaMA's, with
its sliding window, read from and written to Hugging Face's ``Phi3ForCausalLM``.

The checkpoint fuses q, k and v into one ``qkv_proj`` and the MLP's gate and up projections into
one ``gate_up_proj``; they are cut into the decoder's separate weights on the way in and fused
again on the way out, so tensor parallelism splits each as LLaMA's. Partial rotary embeddings
(``partial_rotary_factor < 1``, Phi-4-mini) rotate the leading part of each head
(``rotary_fraction``); the long-context ``longrope`` scaling (128k variants) divides each
frequency by its short factor up to ``original_max_position_embeddings`` tokens and by its long
factor past them, as ``transformers`` does per forward pass.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes
from colfunc.models.family import HFWeight, linear, require

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
    """Phi-3 sizes (see :class:`colfunc.models.decoder.Config`): no biases, no q/k norms."""

    family_name = "phi3"
    variations = ("mlp_act", "rotary_fraction")

    def __post_init__(self) -> None:
        super().__post_init__()
        none = not (self.qkv_bias or self.o_bias or self.qk_norm)
        self.require_variations(none, "Phi-3 has no attention biases and no q/k norms")


tp_plans: dict[str, dict[str, P]] = decoder.plans()
tp_plan: dict[str, P] = tp_plans["1d"]


def _weights(cfg: decoder.Config) -> tuple[list[HFWeight], list[HFWeight]]:
    top, layer = decoder_hf.family_weights(cfg)
    fused = {
        "blocks.attn.wq": linear(
            "model.layers.{i}.self_attn.qkv_proj.weight",
            "blocks.attn.wq",
            "blocks.attn.wk",
            "blocks.attn.wv",
        ),
        "blocks.mlp.w_gate": linear(
            "model.layers.{i}.mlp.gate_up_proj.weight", "blocks.mlp.w_gate", "blocks.mlp.w_up"
        ),
    }
    gone = {"blocks.attn.wk", "blocks.attn.wv", "blocks.mlp.w_up"}
    out = []
    for e in layer:
        (path,) = e.paths
        if path in gone:
            continue
        out.append(fused.get(path, e))
    return top, out


def _read(c: Any) -> Config:
    require("Phi3", c, "attention_bias", (False,))
    rope = getattr(c, "rope_parameters", None) or {}
    fraction = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    window = getattr(c, "sliding_window", None)
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Phi3", sliding_window=window, rotary_fraction=float(fraction), longrope=True
    )


# Phi3Config's default special tokens (Phi-3's tokenizer), kept where the vocabulary holds them
_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}


def _write(cfg: decoder.Config) -> dict[str, Any]:
    ids = {k: (v if v < cfg.vocab_size else None) for k, v in _TOKEN_IDS.items()}
    return {
        **decoder_hf.write_hf_config(cfg),
        **ids,
        "sliding_window": cfg.sliding_window,
        "original_max_position_embeddings": cfg.rope_scaling.original_max_position,
        "partial_rotary_factor": cfg.rotary_fraction,
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    read=_read,
    write=_write,
    weights=_weights,
)
