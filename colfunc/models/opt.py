"""OPT (Zhang et al. 2022) as a pure function over a pytree of parameters.

Pre-LayerNorm blocks (``do_layer_norm_before=True``, every OPT size but 350m), learned positions
offset by 2, ReLU MLP, a final LayerNorm and a head tied to the token embedding. The blocks are
stacked on a leading layer axis and run by ``scan_layers``.

Legend: L layers, B batch, T sequence, S = T - 1 predicted positions, D width (d_model),
F MLP width (d_ff), V vocabulary, E head dim.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch.nn.functional as F

from colfunc.core import P
from colfunc.models.family import (
    Family,
    HFMapping,
    HFWeight,
    KVCacheSpec,
    linear,
    require,
)
from colfunc.models.learned import LearnedPositions, Sizes

__all__ = [
    "POSITION_OFFSET",
    "Config",
    "apply",
    "family",
    "init",
    "loss",
    "paged_forward",
    "param_shapes",
    "tp_plan",
]

Params = dict[str, Any]

# OPT's position table has two extra leading rows (a leftover of fairseq's padding scheme):
# position i reads row i + 2.
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Sizes):
    """OPT sizes (see :class:`colfunc.models.learned.Sizes`). ``Config()`` is the tiny
    byte-level model; ``d_ff=None`` means ``4 * d_model``."""

    family_name = "opt"


# Megatron-LM tensor parallelism: q/k/v and the MLP input split their output dim (column
# parallel), the attention and MLP output projections their input dim (row parallel); the tied
# embedding splits the vocabulary. Parameters not named here are replicated.
tp_plan: dict[str, P] = {
    "embed.tokens": P("tp", None),
    "blocks.attn.wq": P(None, None, "tp"),
    "blocks.attn.wk": P(None, None, "tp"),
    "blocks.attn.wv": P(None, None, "tp"),
    "blocks.attn.bq": P(None, "tp"),
    "blocks.attn.bk": P(None, "tp"),
    "blocks.attn.bv": P(None, "tp"),
    "blocks.attn.wo": P(None, "tp", None),
    "blocks.mlp.w_in": P(None, None, "tp"),
    "blocks.mlp.b_in": P(None, "tp"),
    "blocks.mlp.w_out": P(None, "tp", None),
}


_MODEL = LearnedPositions("opt", F.relu, POSITION_OFFSET)
# the model's functions (see colfunc.models.learned): init(cfg, seed), apply(params, ids, cfg),
# paged_forward(...), loss(cfg), param_shapes(cfg)
init, apply, paged_forward, loss = _MODEL.init, _MODEL.apply, _MODEL.paged_forward, _MODEL.loss
param_shapes = _MODEL.param_shapes


# --- the family: Hugging Face's OPTForCausalLM, and the KV cache -------------------------------


def _hf_weights(cfg: Config) -> tuple[list[HFWeight], list[HFWeight]]:
    h = "model.decoder.layers.{i}."
    layer = [
        HFWeight(h + "self_attn_layer_norm.weight", ("blocks.ln1.weight",)),
        HFWeight(h + "self_attn_layer_norm.bias", ("blocks.ln1.bias",)),
        linear(h + "self_attn.q_proj.weight", "blocks.attn.wq"),
        HFWeight(h + "self_attn.q_proj.bias", ("blocks.attn.bq",)),
        linear(h + "self_attn.k_proj.weight", "blocks.attn.wk"),
        HFWeight(h + "self_attn.k_proj.bias", ("blocks.attn.bk",)),
        linear(h + "self_attn.v_proj.weight", "blocks.attn.wv"),
        HFWeight(h + "self_attn.v_proj.bias", ("blocks.attn.bv",)),
        linear(h + "self_attn.out_proj.weight", "blocks.attn.wo"),
        HFWeight(h + "self_attn.out_proj.bias", ("blocks.attn.bo",)),
        HFWeight(h + "final_layer_norm.weight", ("blocks.ln2.weight",)),
        HFWeight(h + "final_layer_norm.bias", ("blocks.ln2.bias",)),
        linear(h + "fc1.weight", "blocks.mlp.w_in"),
        HFWeight(h + "fc1.bias", ("blocks.mlp.b_in",)),
        linear(h + "fc2.weight", "blocks.mlp.w_out"),
        HFWeight(h + "fc2.bias", ("blocks.mlp.b_out",)),
    ]
    top = [
        HFWeight("model.decoder.embed_tokens.weight", ("embed.tokens",)),
        HFWeight("model.decoder.embed_positions.weight", ("embed.positions",)),
        HFWeight("model.decoder.final_layer_norm.weight", ("final_norm.weight",)),
        HFWeight("model.decoder.final_layer_norm.bias", ("final_norm.bias",)),
        HFWeight("lm_head.weight", ("embed.tokens",)),  # tied
    ]
    return top, layer


def _read_hf_config(c: Any) -> Config:
    require("OPT", c, "activation_function", ("relu",))
    require("OPT", c, "do_layer_norm_before", (True,))
    require("OPT", c, "_remove_final_layer_norm", (False,))
    require("OPT", c, "enable_bias", (True,))
    require("OPT", c, "layer_norm_elementwise_affine", (True,))
    require("OPT", c, "tie_word_embeddings", (True,))
    proj = getattr(c, "word_embed_proj_dim", None) or c.hidden_size
    if proj != c.hidden_size:
        raise ValueError(
            f"from_hf: OPT with word_embed_proj_dim={proj} != hidden_size={c.hidden_size} "
            "(project_in/project_out, as in opt-350m) is not supported"
        )
    return Config(
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        d_model=c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        d_ff=c.ffn_dim,
        norm_eps=1e-5,  # OPT's LayerNorms use torch's default eps
    )


def _write_hf_config(cfg: Config) -> dict[str, Any]:
    if cfg.norm_eps != 1e-5:
        raise ValueError(
            f"hf_config: OPT's LayerNorms use eps=1e-5 and have no option for it; got "
            f"norm_eps={cfg.norm_eps}"
        )
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        ffn_dim=cfg.d_ff,
        max_position_embeddings=cfg.max_seq_len,
        dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=True,
    )


family = Family(
    name="opt",
    module=sys.modules[__name__],
    config=Config,
    hf=HFMapping(
        architectures=("OPTForCausalLM",),
        model_type="opt",
        weights=_hf_weights,
        read_config=_read_hf_config,
        write_config=_write_hf_config,
    ),
    kv_cache=KVCacheSpec.of_decoder,
)
