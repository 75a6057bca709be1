"""The decoder the LLaMA-shaped families share, as a pure function over a pytree of parameters.

Pre-RMSNorm blocks, rotary position embeddings (rotate-half convention), SwiGLU MLP,
grouped-query attention; the head is separate unless ``tie_embeddings``. The blocks are stacked
on a leading layer axis and run by ``scan_layers``. What the families vary is a field of
:class:`Config`: q/k/v biases (``qkv_bias``, Qwen 2), an output-projection bias (``o_bias``),
RMS norms of each query and key head (``qk_norm``, Qwen 3), a sliding attention window
(``sliding_window``, Mistral), the head dim, the rotary base and
scaling. A family (:mod:`colfunc.models.llama`, ``qwen2``, ``qwen3``, ``mistral``, ``phi3``) is a
``Config`` subclass naming itself, its tensor-parallel plan and its Hugging Face side
(:mod:`colfunc.models.decoder_hf`); every function here takes any of them.

Legend: L layers, B batch, T sequence, S = T - 1 predicted positions, D width (d_model),
F MLP width (d_ff), V vocabulary, H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import torch

from colfunc import nn, ops, random
from colfunc.core import Layered, P, layered, scan_layers
from colfunc.models.family import (
    positive_number,
)

__all__ = [
    "Config",
    "apply",
    "init",
    "loss",
    "paged_forward",
    "param_shapes",
    "plans",
]

Params = dict[str, Any]
Carry = dict[str, Any]  # {"h": x_BTD, "rope": (cos_TR, sin_TR)}


def _swiglu_width(d_model: int) -> int:
    # LLaMA keeps the MLP's parameter count at that of a 4x GELU MLP: 2/3 * 4 * d, rounded up to a
    # multiple of 32 so the width splits evenly over common tensor-parallel degrees.
    return 32 * math.ceil(8 * d_model / 3 / 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A decoder's sizes and variations. ``n_kv_heads=None`` means ``n_head`` (no grouping);
    ``d_ff=None`` means the SwiGLU width ``8/3 * d_model`` rounded up to a multiple of 32;
    ``head_dim=None`` means ``d_model / n_head`` (Qwen 3 and Gemma give another: q/k/v are
    ``n_head * head_dim`` wide). ``qkv_bias``: q/k/v projections with biases; ``o_bias``: the
    attention output projection with one; ``qk_norm``: an RMS norm over each query and key head
    (weights ``[E]`` shared by the heads) before the rotation; ``sliding_window``: every layer
    attends to each token's last ``sliding_window`` tokens, itself included (None: all of
    them). Subclasses name their family
    (``family_name``), which is the prefix of their errors and of their loss's name."""

    family_name: ClassVar[str] = "decoder"

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq_len: int = 128
    n_kv_heads: int | None = None
    d_ff: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_head)
        if self.d_ff is None and isinstance(self.d_model, int):
            object.__setattr__(self, "d_ff", _swiglu_width(self.d_model))
        for name in (
            "vocab_size",
            "n_layer",
            "n_head",
            "d_model",
            "max_seq_len",
            "n_kv_heads",
            "d_ff",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{self.family_name}.Config: {name} must be a positive int, got {value!r}"
                )
        if self.head_dim is None:  # the width split over the heads
            if self.d_model % self.n_head:
                raise ValueError(
                    f"{self.family_name}.Config: n_head={self.n_head} must divide "
                    f"d_model={self.d_model} "
                    "(or give head_dim)"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        head_dim = self.head_dim
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(
                f"{self.family_name}.Config: head_dim must be a positive int, got {head_dim!r}"
            )
        if head_dim % 2:
            raise ValueError(
                f"{self.family_name}.Config: rotary embeddings need an even head dim; head_dim={head_dim} "
                f"(d_model={self.d_model} / n_head={self.n_head} unless given)"
            )
        assert self.n_kv_heads is not None
        if self.n_head % self.n_kv_heads:
            raise ValueError(
                f"{self.family_name}.Config: n_kv_heads={self.n_kv_heads} must divide n_head={self.n_head}"
            )
        if not positive_number(self.rope_theta):
            raise ValueError(
                f"{self.family_name}.Config: rope_theta must be > 0, got {self.rope_theta!r}"
            )
        try:
            self.rope_scaling  # noqa: B018  (checks the rope_* fields together)
        except ValueError as e:
            detail = str(e).removeprefix("RopeScaling: ")
            raise ValueError(f"{self.family_name}.Config: the rope_* fields: {detail}") from None
        if not positive_number(self.norm_eps):
            raise ValueError(
                f"{self.family_name}.Config: norm_eps must be > 0, got {self.norm_eps!r}"
            )
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(
                f"{self.family_name}.Config: sliding_window must be None or an int >= 1, got {w!r}"
            )
        for flag in ("tie_embeddings", "qkv_bias", "o_bias", "qk_norm"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"{self.family_name}.Config: {flag} must be a bool, got {getattr(self, flag)!r}"
                )

    def require_variations(self, ok: bool, what: str) -> None:
        """A family's refusal of the decoder's variations it does not have: a ValueError
        naming ``what`` it has and the fields given, unless ``ok``."""
        if not ok:
            raise ValueError(
                f"{self.family_name}.Config: {what}; got qkv_bias={self.qkv_bias}, "
                f"o_bias={self.o_bias}, qk_norm={self.qk_norm} "
                "(colfunc.models.decoder.Config takes any mix)"
            )

    @functools.cached_property  # (made once: every forward pass reads it)
    def rope_scaling(self) -> nn.RopeScaling:
        """The rotary frequencies' scaling (``rope_type``: ``"default"``, ``"linear"``,
        ``"llama3"`` or ``"yarn"``; ``rope_original_max_seq_len=None`` means ``max_seq_len``)."""
        return nn.RopeScaling(
            type=self.rope_type,
            factor=self.rope_factor,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            original_max_position=self.rope_original_max_seq_len or self.max_seq_len,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            attention_factor=self.rope_attention_factor,
            mscale=self.rope_mscale,
            mscale_all_dim=self.rope_mscale_all_dim,
            truncate=self.rope_truncate,
        )

    @classmethod
    def tiny(cls) -> Config:
        """Byte-level, 4 layers, width 128, 4 query heads sharing 2 key/value heads, context 128."""
        return cls(vocab_size=256, n_layer=4, n_head=4, n_kv_heads=2, d_model=128, max_seq_len=128)

    @classmethod
    def small(cls) -> Config:
        """Byte-level, 6 layers, width 384, 6 query heads sharing 2 key/value heads, context 256."""
        return cls(vocab_size=256, n_layer=6, n_head=6, n_kv_heads=2, d_model=384, max_seq_len=256)


def plans(*, qkv_bias: bool = False, o_bias: bool = False) -> dict[str, dict[str, P]]:
    """The tensor-parallel plans (one per mode) of a decoder with these biases.

    Megatron-LM tensor parallelism: q/k/v and the gate/up projections split their output dim
    (column parallel, whole heads per rank, so n_kv_heads must be divisible by the degree; their
    biases with them), the attention and MLP output projections their input dim (row parallel;
    a bias of the output projection is replicated along the width); the embedding and the head
    split the vocabulary. Parameters not named here (the q/k norms) are replicated.
    """
    return nn.tensor_plans(
        column=(
            "blocks.attn.wq",
            "blocks.attn.wk",
            "blocks.attn.wv",
            "blocks.mlp.w_gate",
            "blocks.mlp.w_up",
        ),
        column_bias=("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv") if qkv_bias else (),
        row=("blocks.attn.wo", "blocks.mlp.w_down"),
        hidden=(
            "blocks.ln1.weight",
            "blocks.ln2.weight",
            "final_norm.weight",
            *(("blocks.attn.bo",) if o_bias else ()),
        ),
        vocab=("embed.tokens",),
        head=("head.weight",),
    )


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, by dotted path (in the order of :func:`init`)."""
    L, D, V, F = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_ff
    assert F is not None and cfg.n_kv_heads is not None  # resolved by Config.__post_init__
    assert cfg.head_dim is not None
    HE, KE = cfg.n_head * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    E = cfg.head_dim
    shapes = {
        "embed.tokens": (V, D),
        "blocks.ln1.weight": (L, D),
        "blocks.attn.wq": (L, D, HE),
        "blocks.attn.wk": (L, D, KE),
        "blocks.attn.wv": (L, D, KE),
        **(
            {"blocks.attn.bq": (L, HE), "blocks.attn.bk": (L, KE), "blocks.attn.bv": (L, KE)}
            if cfg.qkv_bias
            else {}
        ),
        **({"blocks.attn.q_norm": (L, E), "blocks.attn.k_norm": (L, E)} if cfg.qk_norm else {}),
        "blocks.attn.wo": (L, HE, D),
        **({"blocks.attn.bo": (L, D)} if cfg.o_bias else {}),
        "blocks.ln2.weight": (L, D),
        "blocks.mlp.w_gate": (L, D, F),
        "blocks.mlp.w_up": (L, D, F),
        "blocks.mlp.w_down": (L, F, D),
        "final_norm.weight": (D,),
    }
    if not cfg.tie_embeddings:
        shapes["head.weight"] = (D, V)  # [in, out] like every other weight
    return shapes


_NORM_WEIGHTS = {
    "blocks.ln1.weight",
    "blocks.ln2.weight",
    "final_norm.weight",
    "blocks.attn.q_norm",
    "blocks.attn.k_norm",
}
_BIASES = {"blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv", "blocks.attn.bo"}
_RESIDUAL_OUT = {"blocks.attn.wo", "blocks.mlp.w_down"}


def init(cfg: Config, seed: int = 0, *, abstract: bool = False) -> Params:
    """Fresh fp32 parameters; each value depends only on ``(seed, path)``.

    ``abstract=True``: :class:`colfunc.random.Abstract` leaves, described but not made, for a
    step that makes each where it belongs (``step.init``; see ``zero`` and ``offload``).

    Weights N(0, 0.02), the residual-stream output projections N(0, 0.02 / sqrt(2 * n_layer))
    as in GPT-2, norm weights 1, biases 0.
    """
    std_out = 0.02 / math.sqrt(2 * cfg.n_layer)

    def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
        if path in _NORM_WEIGHTS:
            return torch.ones(shape)
        if path in _BIASES:
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


def _head_dim(cfg: Config) -> int:
    assert cfg.head_dim is not None  # resolved by Config.__post_init__
    return cfg.head_dim


def _embed(params: Params, input_ids_BT: torch.Tensor, cfg: Config) -> torch.Tensor:
    nn.check_input_ids(input_ids_BT, cfg.max_seq_len, cfg.vocab_size)
    return nn.embedding(input_ids_BT, params["embed"]["tokens"])


def _carry(x_BTD: torch.Tensor, cfg: Config) -> Carry:
    """What each block reads: the residual stream and the rotary tables, made once per pass."""
    E = _head_dim(cfg)
    return {
        "h": x_BTD,
        "rope": nn.rope_tables(x_BTD.shape[1], E, cfg.rope_theta, x_BTD.device, cfg.rope_scaling),
    }


def _block(layer: Params, carry: Carry, cfg: Config) -> Carry:
    return _block_kv(layer, carry, cfg, None)[0]


def _block_kv(
    layer: Params, carry: Carry, cfg: Config, paged: nn.Paged | None
) -> tuple[Carry, dict[str, torch.Tensor] | None]:
    """One block; with ``paged`` its attention reads the KV cache, and it also returns this
    layer's new keys and values."""
    x_BTD, rope = carry["h"], carry["rope"]
    E = _head_dim(cfg)
    h_BTD = ops.rms_norm(x_BTD, layer["ln1"]["weight"], cfg.norm_eps)
    a_BTD, kv = nn.attend(
        h_BTD,
        layer["attn"],
        head_dim=E,
        rope=rope,
        paged=paged,
        norm_eps=cfg.norm_eps,
        window=cfg.sliding_window,
    )
    x_BTD = x_BTD + a_BTD
    h_BTD = ops.rms_norm(x_BTD, layer["ln2"]["weight"], cfg.norm_eps)
    return {"h": x_BTD + nn.swiglu(h_BTD, layer["mlp"]), "rope": rope}, kv


def _logits(params: Params, x_BTD: torch.Tensor, cfg: Config) -> torch.Tensor:
    h_BTD = ops.rms_norm(x_BTD, params["final_norm"]["weight"], cfg.norm_eps)
    if cfg.tie_embeddings:
        return nn.unembed(h_BTD, params["embed"]["tokens"])
    return nn.linear(h_BTD, params["head"]["weight"])


def apply(params: Params, input_ids: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[B, T, V]`` for ``input_ids[B, T]`` (fp32 for fp32 params)."""
    carry = _carry(_embed(params, input_ids, cfg), cfg)
    carry = scan_layers(lambda layer, c: _block(layer, c, cfg), carry, params["blocks"])
    return _logits(params, carry["h"], cfg)


def paged_forward(
    params: Params,
    tokens_N: torch.Tensor,
    batch: nn.PagedBatch,
    cache: dict[str, torch.Tensor],
    cfg: Config,
    select_R: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[R, V]`` at the packed rows ``select`` over a paged KV cache, and the new keys
    and values; see :func:`colfunc.models.gpt.paged_forward`. The rotary tables are taken at the
    new tokens' positions."""
    E = _head_dim(cfg)
    x_1ND = nn.embedding(tokens_N, params["embed"]["tokens"])[None]
    cos_TR, sin_TR = nn.rope_tables(
        cfg.max_seq_len, E, cfg.rope_theta, x_1ND.device, cfg.rope_scaling
    )
    positions_N = batch.token_positions()
    carry: Carry = {"h": x_1ND, "rope": (cos_TR[positions_N], sin_TR[positions_N])}
    block = lambda layer, c, paged: _block_kv(layer, c, cfg, paged)  # noqa: E731
    carry, ys = nn.paged_scan(block, carry, params["blocks"], cache, batch)
    return _logits(params, carry["h"][:, select_R], cfg)[0], ys


def loss(cfg: Config) -> Layered:
    """``loss_fn(params, {"input_ids", "labels"})``: mean next-token cross-entropy, ``-100`` ignored.

    The same computation as :func:`apply` followed by the shifted cross-entropy, in the
    ``layered(pre, block, post)`` form that ``pipeline`` cuts into stages.
    """

    def pre(params: Params, batch: Any) -> Carry:
        return _carry(_embed(params, nn.batch_field(batch, "input_ids"), cfg), cfg)

    def block(layer: Params, carry: Carry) -> Carry:
        return _block(layer, carry, cfg)

    def post(params: Params, carry: Carry, batch: Any) -> torch.Tensor:
        head = lambda h: _logits(params, h, cfg)  # noqa: E731
        return nn.causal_lm_loss(head, carry["h"], nn.batch_field(batch, "labels"))

    # whole heads per rank: the attention splits by head (any vocabulary splits, unevenly)
    divisors = {"n_head": cfg.n_head, "n_kv_heads": cfg.n_kv_heads}
    # only the residual stream has a sequence dim to split; the rotary tables stay whole
    return layered(
        pre, block, post, name=cfg.family_name, divisors=divisors, sequence_dims={"h": 1}
    )
