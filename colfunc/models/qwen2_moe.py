"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen 2's decoder (q/k/v biases) with each MLP a
sparse mixture of SwiGLU experts (:mod:`colfunc.nn.moe`) beside a shared expert behind a sigmoid
gate; read from and written to ``Qwen2MoeForCausalLM``.
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
    """Qwen2-MoE sizes (see :class:`colfunc.models.decoder.Config`): q/k/v biases, 60 experts, 4
    per token, a shared expert; rotary base 10^6, RMS norm epsilon 1e-6."""

    family_name = "qwen2_moe"
    variations = ("mlp_act", "layer_types", *("n_experts", "dense_layers", "d_shared_expert", "router_aux_loss_coef", "router_z_loss_coef"))  # fmt: skip
    qkv_bias: bool = True
    n_experts: int = 60
    n_experts_per_tok: int = 4
    norm_topk_prob: bool = False
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.n_experts > 0 and self.qkv_bias and not (self.o_bias or self.qk_norm),
            "Qwen2-MoE has experts (n_experts > 0), q/k/v biases, no output bias, no q/k norms",
        )


tp_plan: dict[str, P] = moe_hf.plan(qkv_bias=True)
tp_plans: dict[str, dict[str, P]] = {"1d": tp_plan}


def _read(c: Any) -> Config:
    window, types = _window(c, "Qwen2-MoE")
    fields = moe_hf.read(c, "Qwen2-MoE")
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Qwen2-MoE", sliding_window=window, layer_types=types, **fields
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    return {**decoder_hf.write_hf_config(cfg), **_write_window(cfg), **moe_hf.write(cfg)}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    read=_read,
    write=_write,
    weights=lambda cfg: moe_hf.weights(cfg, moe_hf.Names()),
)
