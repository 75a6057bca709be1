"""Mixtral: the shared decoder (:mod:`colfunc.models.decoder`) as Mistral's, each MLP a sparse
mixture of SwiGLU experts (:mod:`colfunc.nn.moe`): the router's softmax, the top
``n_experts_per_tok`` renormalized; read from and written to ``MixtralForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf, moe_hf
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

NAMES = moe_hf.Names(block="block_sparse_moe", gate="w1", up="w3", down="w2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(decoder.Config):
    """Mixtral sizes (see :class:`colfunc.models.decoder.Config`): 8 experts, 2 per token, the
    chosen weights renormalized; no biases, rotary base 10^6."""

    family_name = "mixtral"
    variations = ("mlp_act", "n_experts", "router_aux_loss_coef", "router_z_loss_coef")
    n_experts: int = 8
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_variations(
            self.n_experts > 0 and self.norm_topk_prob and not self.d_shared_expert
            and not (self.qkv_bias or self.o_bias or self.qk_norm),
            "Mixtral has experts (n_experts > 0) whose chosen weights are renormalized "
            "(norm_topk_prob=True), no shared expert, no attention biases and no q/k norms",
        )  # fmt: skip


tp_plan: dict[str, P] = moe_hf.plan()
tp_plans: dict[str, dict[str, P]] = {"1d": tp_plan}


def _read(c: Any) -> Config:
    fields = moe_hf.read(c, "Mixtral", experts="num_local_experts", norm_topk=True)
    return decoder_hf.read_hf_config(  # type: ignore[return-value]
        c, Config, "Mixtral", sliding_window=getattr(c, "sliding_window", None), **fields
    )


def _write(cfg: decoder.Config) -> dict[str, Any]:
    moe = moe_hf.write(cfg, experts="num_local_experts", moe_width=False)
    moe.pop("norm_topk_prob")
    return {**decoder_hf.write_hf_config(cfg), "sliding_window": cfg.sliding_window, **moe}


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    read=_read,
    write=_write,
    weights=lambda cfg: moe_hf.weights(cfg, NAMES),
)
