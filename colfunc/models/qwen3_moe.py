"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3's decoder (q/k norms per head) with each
MLP a sparse mixture of SwiGLU experts (:mod:`colfunc.nn.moe`); read from and written to
``Qwen3MoeForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf, moe_hf
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
    """Qwen3-MoE sizes (see :class:`colfunc.models.decoder.Config`): q/k norms per head, 128
    experts, 8 per token, the chosen weights renormalized; rotary base 10^6, RMS norm epsilon
    1e-6; ``qkv_bias`` and ``o_bias`` together are Hugging Face's ``attention_bias``."""

    family_name = "qwen3_moe"
    variations = ("mlp_act", "layer_types", *("n_experts", "dense_layers", "router_aux_loss_coef", "router_z_loss_coef"))  # fmt: skip
    qk_norm: bool = True
    n_experts: int = 128
    n_experts_per_tok: int = 8
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.n_experts > 0 and self.qk_norm and self.qkv_bias == self.o_bias,
            "Qwen3-MoE has experts (n_experts > 0), q/k norms (qk_norm=True) and biases on all "
            "four attention projections or none",
        )


tp_plan: dict[str, P] = moe_hf.plan(qkv_bias=True, o_bias=True, bias_optional=True)
tp_plans: dict[str, dict[str, P]] = {"1d": tp_plan}


def _read(c: Any) -> Config:
    window, types = _window(c, "Qwen3-MoE")
    bias = bool(getattr(c, "attention_bias", False))
    fields = moe_hf.read(c, "Qwen3-MoE")
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Qwen3-MoE", qkv_bias=bias, o_bias=bias, sliding_window=window,
        layer_types=types, **fields,
    )  # fmt: skip


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {
        **decoder_hf.write_hf_config(cfg),
        "attention_bias": cfg.qkv_bias,
        **_write_window(cfg),
        **moe_hf.write(cfg),
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    read=_read,
    write=_write,
    weights=lambda cfg: moe_hf.weights(cfg, moe_hf.Names()),
)
