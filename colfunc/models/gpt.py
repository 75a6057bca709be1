"""GPT-2 (Radford et al. 2019) as a pure function over a pytree of parameters.

Pre-LayerNorm blocks, learned positions, GELU (tanh approximation), and a head tied to the token
embedding. The blocks are stacked on a leading layer axis and run by ``scan_layers``.

Legend: L layers, B batch, T sequence, S = T - 1 predicted positions, D width (d_model),
F MLP width (d_ff), V vocabulary, E head dim.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc import nn
from colfunc.core import P
from colfunc.models.family import Family, HFMapping, HFWeight, KVCacheSpec, require
from colfunc.models.learned import LearnedPositions, Sizes

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

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Sizes):
    """GPT-2 sizes (see :class:`colfunc.models.learned.Sizes`). ``Config()`` is the tiny
    byte-level model; ``d_ff=None`` means ``4 * d_model``."""

    family_name = "gpt"


# Megatron-LM tensor parallelism: q/k/v and the MLP input split their output dim (column
# parallel), the attention and MLP output projections their input dim (row parallel), so each
# block needs one reduction per sub-layer; the tied embedding splits the vocabulary. Parameters
# not named here are replicated.
tp_plans: dict[str, dict[str, P]] = nn.tensor_plans(
    column=("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", "blocks.mlp.w_in"),
    row=("blocks.attn.wo", "blocks.mlp.w_out"),
    column_bias=("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv", "blocks.mlp.b_in"),
    hidden=(
        "blocks.attn.bo",
        "blocks.mlp.b_out",
        "blocks.ln1.*",
        "blocks.ln2.*",
        "final_norm.*",
    ),
    vocab=("embed.tokens",),
)
tp_plan: dict[str, P] = tp_plans["1d"]


_MODEL = LearnedPositions("gpt", nn.gelu_tanh, 0)
# the model's functions (see colfunc.models.learned): init(cfg, seed), apply(params, ids, cfg),
# paged_forward(...), loss(cfg), param_shapes(cfg)
init, apply, paged_forward, loss = _MODEL.init, _MODEL.apply, _MODEL.paged_forward, _MODEL.loss
param_shapes = _MODEL.param_shapes


# --- the family: Hugging Face's GPT2LMHeadModel, and the KV cache ------------------------------


def _hf_weights(cfg: Config) -> tuple[list[HFWeight], list[HFWeight]]:
    h = "transformer.h.{i}."
    layer = [
        HFWeight(h + "ln_1.weight", ("blocks.ln1.weight",)),
        HFWeight(h + "ln_1.bias", ("blocks.ln1.bias",)),
        # GPT-2 fuses q, k, v into one Conv1D; colfunc keeps them apart for column parallelism
        HFWeight(h + "attn.c_attn.weight", ("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv")),
        HFWeight(h + "attn.c_attn.bias", ("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv")),
        HFWeight(h + "attn.c_proj.weight", ("blocks.attn.wo",)),
        HFWeight(h + "attn.c_proj.bias", ("blocks.attn.bo",)),
        HFWeight(h + "ln_2.weight", ("blocks.ln2.weight",)),
        HFWeight(h + "ln_2.bias", ("blocks.ln2.bias",)),
        HFWeight(h + "mlp.c_fc.weight", ("blocks.mlp.w_in",)),
        HFWeight(h + "mlp.c_fc.bias", ("blocks.mlp.b_in",)),
        HFWeight(h + "mlp.c_proj.weight", ("blocks.mlp.w_out",)),
        HFWeight(h + "mlp.c_proj.bias", ("blocks.mlp.b_out",)),
    ]
    top = [
        HFWeight("transformer.wte.weight", ("embed.tokens",)),
        HFWeight("transformer.wpe.weight", ("embed.positions",)),
        HFWeight("transformer.ln_f.weight", ("final_norm.weight",)),
        HFWeight("transformer.ln_f.bias", ("final_norm.bias",)),
        HFWeight("lm_head.weight", ("embed.tokens",)),  # tied
    ]
    return top, layer


def _read_hf_config(c: Any) -> Config:
    require("GPT-2", c, "activation_function", ("gelu_new", "gelu_pytorch_tanh"))
    require("GPT-2", c, "scale_attn_weights", (True,))
    require("GPT-2", c, "scale_attn_by_inverse_layer_idx", (False,))
    require("GPT-2", c, "add_cross_attention", (False,))
    require("GPT-2", c, "tie_word_embeddings", (True,))
    return Config(
        vocab_size=c.vocab_size,
        n_layer=c.n_layer,
        n_head=c.n_head,
        d_model=c.n_embd,
        max_seq_len=c.n_positions,
        d_ff=c.n_inner or 4 * c.n_embd,
        norm_eps=c.layer_norm_epsilon,
    )


def _write_hf_config(cfg: Config) -> dict[str, Any]:
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.d_ff,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=cfg.vocab_size - 1,  # GPT-2 keeps <|endoftext|> as the last token
        eos_token_id=cfg.vocab_size - 1,
        tie_word_embeddings=True,
    )


family = Family(
    name="gpt",
    module=sys.modules[__name__],
    config=Config,
    hf=HFMapping(
        architectures=("GPT2LMHeadModel",),
        model_type="gpt2",
        weights=_hf_weights,
        read_config=_read_hf_config,
        write_config=_write_hf_config,
    ),
    kv_cache=KVCacheSpec.of_decoder,
)
