"""GPT-2 (Radford et al. 2019) as a pure function over a pytree of parameters.

Pre-LayerNorm blocks, learned positions, GELU (tanh approximation), and a head tied to the token
embedding. The blocks are stacked on a leading layer axis and run by ``scan_layers``.

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

from colfunc import nn, ops, random
from colfunc.core import Layered, P, layered, positions, scan_layers
from colfunc.models.family import Family, HFMapping, HFWeight, KVCacheSpec, positive_number, require

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
class Config:
    """GPT-2 sizes. ``Config()`` is the tiny byte-level model; ``d_ff=None`` means ``4 * d_model``."""

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
                raise ValueError(f"gpt.Config: {name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"gpt.Config: n_head={self.n_head} must divide d_model={self.d_model}")
        if not positive_number(self.norm_eps):
            raise ValueError(f"gpt.Config: norm_eps must be > 0, got {self.norm_eps!r}")

    @classmethod
    def tiny(cls) -> Config:
        """Byte-level, 4 layers, width 128, 4 heads, context 128: the default model to train."""
        return cls(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128)

    @classmethod
    def small(cls) -> Config:
        """Byte-level, 6 layers, width 384, 6 heads, context 256."""
        return cls(vocab_size=256, n_layer=6, n_head=6, d_model=384, max_seq_len=256)


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


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, by dotted path (in the order of :func:`init`)."""
    L, D, V, F = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_ff
    assert F is not None  # resolved by Config.__post_init__
    return {
        "embed.tokens": (V, D),
        "embed.positions": (cfg.max_seq_len, D),
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

    GPT-2 initialisation: weights N(0, 0.02), the projections that write into the residual stream
    N(0, 0.02 / sqrt(2 * n_layer)) (two per layer, so the stream's variance stays bounded with
    depth), biases 0, norm weights 1.
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
    pos_T = positions(T, input_ids_BT.device)
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
    return x_BTD + nn.mlp(h_BTD, layer["mlp"], nn.gelu_tanh), kv


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
    """Logits ``[R, V]`` at the packed rows ``select`` of a batch of sequences' new tokens, whose
    earlier tokens are in the paged KV cache ``cache`` (``{"k", "v"}``, ``[L, C, B, K, E]``,
    scanned as per-layer ``xs``), and the new tokens' keys and values (``[L, N, K, E]``, the
    scan's ``ys``) for the caller to write into the cache."""
    positions_N = batch.token_positions()
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
    return layered(pre, block, post, name="gpt", divisors=divisors)


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
