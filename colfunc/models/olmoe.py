"""OLMoE: the shared decoder (:mod:`colfunc.models.decoder`) with RMS norms of the queries and
keys over all their heads and each MLP a sparse mixture of SwiGLU experts (:mod:`colfunc.nn.moe`);
read from and written to ``OlmoeForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf, moe_hf
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
    """OLMoE sizes (see :class:`colfunc.models.decoder.Config`): q/k norms over all heads, 64
    experts, 8 per token, the chosen weights not renormalized; ``qkv_bias`` and ``o_bias``
    together are Hugging Face's ``attention_bias``."""

    family_name = "olmoe"
    variations = ("mlp_act", "qk_norm_width", *("n_experts", "router_aux_loss_coef", "router_z_loss_coef"))  # fmt: skip
    qk_norm: bool = True
    qk_norm_width: str = "all"
    n_experts: int = 64
    n_experts_per_tok: int = 8
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.n_experts > 0 and self.qk_norm and self.qk_norm_width == "all"
            and self.qkv_bias == self.o_bias,
            "OLMoE has experts (n_experts > 0), q/k norms over all heads "
            "(qk_norm_width='all') and biases on all four attention projections or none",
        )  # fmt: skip


tp_plan: dict[str, P] = moe_hf.plan(qkv_bias=True, o_bias=True, bias_optional=True)
tp_plans: dict[str, dict[str, P]] = {"1d": tp_plan}


def _read(c: Any) -> Config:
    require("OLMoE", c, "clip_qkv", (None,))
    bias = bool(getattr(c, "attention_bias", False))
    fields = moe_hf.read(c, "OLMoE")
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "OLMoE", qkv_bias=bias, o_bias=bias, **fields
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    moe = moe_hf.write(cfg, moe_width=False)
    return {**decoder_hf.write_hf_config(cfg), "attention_bias": cfg.qkv_bias, **moe}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    read=_read,
    write=_write,
    weights=lambda cfg: moe_hf.weights(cfg, moe_hf.Names()),
)
