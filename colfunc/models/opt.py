"""OPT (Zhang et al. 2022) as a pure function over a pytree of parameters.

Pre-LayerNorm blocks (``do_layer_norm_before=True``, every OPT size but 350m), learned positions
offset by 2, ReLU MLP, a final LayerNorm and a head tied to the token embedding. The blocks are
stacked on a leading layer axis and run by ``scan_layers``.

Legend: L layers, B batch, T sequence, S = T - 1 predicted positions, D width (d_model),
F MLP width (d_ff), V vocabulary, E head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

from colfunc import nn, ops, random
from colfunc.core import Layered, P, layered, positions, scan_layers
from colfunc.models.family import (
    Family,
    HFMapping,
    HFWeight,
    KVCacheSpec,
    linear,
    positive_number,
    require,
)

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
class Config:
    """OPT sizes. ``Config()`` is a tiny byte-level model; ``d_ff=None`` means ``4 * d_model``."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq_len: int = 128
    d_ff: int | None = None
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_ff is None and isinstance(self.d_model, int):
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"opt.Config: {name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"opt.Config: n_head={self.n_head} must divide d_model={self.d_model}")
        if not positive_number(self.norm_eps):
            raise ValueError(f"opt.Config: norm_eps must be > 0, got {self.norm_eps!r}")

    @classmethod
    def tiny(cls) -> Config:
        """Byte-level, 4 layers, width 128, 4 heads, context 128."""
        return cls(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128)

    @classmethod
    def small(cls) -> Config:
        """Byte-level, 6 layers, width 384, 6 heads, context 256."""
        return cls(vocab_size=256, n_layer=6, n_head=6, d_model=384, max_seq_len=256)


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


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, by dotted path (in the order of :func:`init`)."""
    L, D, V, F = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_ff
    assert F is not None  # resolved by Config.__post_init__
    return {
        "embed.tokens": (V, D),
        "embed.positions": (cfg.max_seq_len + POSITION_OFFSET, D),
        "blocks.ln1.weight": (L, D),
        "blocks.ln1.bias": (L, D),
        "blocks.attn.wq": (L, D, D),
        "blocks.attn.wk": (L, D, D),
        "blocks.attn.wv": (L, D, D),
        "blocks.attn.wo": (L, D, D),
        "blocks.attn.bq": (L, D),
        "blocks.attn.bk": (L, D),
        "blocks.attn.bv": (L, D),
        "blocks.attn.bo": (L, D),
        "blocks.ln2.weight": (L, D),
        "blocks.ln2.bias": (L, D),
        "blocks.mlp.w_in": (L, D, F),
        "blocks.mlp.b_in": (L, F),
        "blocks.mlp.w_out": (L, F, D),
        "blocks.mlp.b_out": (L, D),
        "final_norm.weight": (D,),
        "final_norm.bias": (D,),
    }


_NORM_WEIGHTS = {"blocks.ln1.weight", "blocks.ln2.weight", "final_norm.weight"}
_RESIDUAL_OUT = {"blocks.attn.wo", "blocks.mlp.w_out"}


def _is_bias(path: str) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf in {"bq", "bk", "bv", "bo", "b_in", "b_out"}


def init(cfg: Config, seed: int = 0, *, abstract: bool = False) -> Params:
    """Fresh fp32 parameters; each value depends only on ``(seed, path)``.

    ``abstract=True``: :class:`colfunc.random.Abstract` leaves, described but not made, for a
    step that makes each where it belongs (``step.init``; see ``zero`` and ``offload``).

    Weights N(0, 0.02), the residual-stream output projections N(0, 0.02 / sqrt(2 * n_layer))
    as in GPT-2, biases 0, norm weights 1.
    """
    std_out = 0.02 / math.sqrt(2 * cfg.n_layer)

    def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
        if path in _NORM_WEIGHTS:
            return torch.ones(shape)
        if _is_bias(path):
            return torch.zeros(shape)
        return random.normal(seed, path, shape, std_out if path in _RESIDUAL_OUT else 0.02)

    if abstract:
        return nn.nest(
            {
                p: random.abstract(s, functools.partial(value, p, s))
                for p, s in param_shapes(cfg).items()
            }
        )
    return nn.nest({p: value(p, s) for p, s in param_shapes(cfg).items()})


def _embed(params: Params, input_ids_BT: torch.Tensor, cfg: Config) -> torch.Tensor:
    nn.check_input_ids(input_ids_BT, cfg.max_seq_len, cfg.vocab_size)
    T = input_ids_BT.shape[1]
    pos_T = positions(T, input_ids_BT.device) + POSITION_OFFSET
    tok_BTD = nn.embedding(input_ids_BT, params["embed"]["tokens"])
    return tok_BTD + nn.embedding(pos_T, params["embed"]["positions"])


def _block(layer: Params, x_BTD: torch.Tensor, cfg: Config) -> torch.Tensor:
    return _block_kv(layer, x_BTD, cfg, None)[0]


def _block_kv(
    layer: Params, x_BTD: torch.Tensor, cfg: Config, paged: nn.Paged | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """One block; with ``paged`` its attention reads the KV cache, and it also returns this
    layer's new keys and values."""
    E = cfg.d_model // cfg.n_head
    ln1, ln2 = layer["ln1"], layer["ln2"]
    h_BTD = ops.layer_norm(x_BTD, ln1["weight"], ln1["bias"], cfg.norm_eps)
    a_BTD, kv = nn.attend(h_BTD, layer["attn"], head_dim=E, paged=paged)
    x_BTD = x_BTD + a_BTD
    h_BTD = ops.layer_norm(x_BTD, ln2["weight"], ln2["bias"], cfg.norm_eps)
    return x_BTD + nn.mlp(h_BTD, layer["mlp"], F.relu), kv


def _logits(params: Params, x_BTD: torch.Tensor, cfg: Config) -> torch.Tensor:
    norm = params["final_norm"]
    h_BTD = ops.layer_norm(x_BTD, norm["weight"], norm["bias"], cfg.norm_eps)
    return nn.unembed(h_BTD, params["embed"]["tokens"])


def apply(params: Params, input_ids: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[B, T, V]`` for ``input_ids[B, T]`` (fp32 for fp32 params)."""
    x_BTD = _embed(params, input_ids, cfg)
    x_BTD = scan_layers(lambda layer, x: _block(layer, x, cfg), x_BTD, params["blocks"])
    return _logits(params, x_BTD, cfg)


def paged_forward(
    params: Params,
    tokens_N: torch.Tensor,
    batch: nn.PagedBatch,
    cache: dict[str, torch.Tensor],
    cfg: Config,
    select_R: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[R, V]`` at the packed rows ``select`` over a paged KV cache, and the new keys
    and values; see :func:`colfunc.models.gpt.paged_forward`."""
    positions_N = batch.token_positions() + POSITION_OFFSET
    x_1ND = nn.embedding(tokens_N, params["embed"]["tokens"])[None]
    x_1ND = x_1ND + nn.embedding(positions_N, params["embed"]["positions"])[None]
    block = lambda layer, x, paged: _block_kv(layer, x, cfg, paged)  # noqa: E731
    x_1ND, ys = nn.paged_scan(block, x_1ND, params["blocks"], cache, batch)
    return _logits(params, x_1ND[:, select_R], cfg)[0], ys


def loss(cfg: Config) -> Layered:
    """``loss_fn(params, {"input_ids", "labels"})``: mean next-token cross-entropy, ``-100`` ignored.

    The same computation as :func:`apply` followed by the shifted cross-entropy, in the
    ``layered(pre, block, post)`` form that ``pipeline`` cuts into stages.
    """

    def pre(params: Params, batch: Any) -> torch.Tensor:
        return _embed(params, nn.batch_field(batch, "input_ids"), cfg)

    def block(layer: Params, x_BTD: torch.Tensor) -> torch.Tensor:
        return _block(layer, x_BTD, cfg)

    def post(params: Params, x_BTD: torch.Tensor, batch: Any) -> torch.Tensor:
        head = lambda h: _logits(params, h, cfg)  # noqa: E731
        return nn.causal_lm_loss(head, x_BTD, nn.batch_field(batch, "labels"))

    # whole heads per rank: the attention splits by head (any vocabulary splits, unevenly)
    divisors = {"n_head": cfg.n_head}
    return layered(pre, block, post, name="opt", divisors=divisors)


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
