"""The decoder the LLaMA-shaped families share, as a pure function over a pytree of parameters.

Pre-RMSNorm blocks, rotary position embeddings (rotate-half convention), SwiGLU MLP,
grouped-query attention; the head is separate unless ``tie_embeddings``. The blocks are stacked
on a leading layer axis and run by ``scan_layers``. What the families vary is a field of
:class:`Config`: q/k/v biases (``qkv_bias``, Qwen 2), an output-projection bias (``o_bias``),
RMS norms of the queries and keys (``qk_norm``: per head, Qwen 3 and Gemma 3; over all heads,
OLMo 2), a sliding attention window (``sliding_window``, Mistral) on every layer or on those
``layer_types`` names (Gemma 2/3), the head dim, the rotary base and scaling (and a base of its
own for the sliding layers, Gemma 3; layers without rotary positions, SmolLM 3), norms before,
after or around each sub-layer (``norm_style``: pre, post for OLMo 2, sandwich for Gemma) and
Gemma's ``1 + w`` norm weights, a GeGLU MLP, scaled embeddings, soft-capped attention scores and
logits and a softmax scale of its own (Gemma 2). Where layers differ, the scan takes each layer's
index as its per-layer input (``xs``). A family (:mod:`colfunc.models.llama`, ``qwen2``, ``qwen3``, ``mistral``, ``phi3``) is a
``Config`` subclass naming itself, its tensor-parallel plan and its Hugging Face side
(:mod:`colfunc.models.decoder_hf`); every function here takes any of them.

Legend: L layers, B batch, T sequence, S = T - 1 predicted positions, D width (d_model),
F MLP width (d_ff), V vocabulary, H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from colfunc import core, nn, ops, random
from colfunc.core import Layered, P, layered, scan_layers
from colfunc.models import decoder_decode
from colfunc.models.decoder_config import LAYER_TYPES, VARIATIONS, Config
from colfunc.models.family import make_params

__all__ = [
    "LAYER_TYPES",
    "VARIATIONS",
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


def plans(
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    norm_style: str = "pre",
    bias_optional: bool = False,
    plain_mlp: bool = False,
    layer_norm: bool = False,
) -> dict[str, dict[str, P]]:
    """The tensor-parallel plans (one per mode) of a decoder with these biases (``bias_optional``:
    or without them, a family whose configs may have both) and norms (``layer_norm``: with
    biases), and a gated MLP or a plain one (``plain_mlp``: ``w_in``, ``w_out`` and their biases).

    Megatron-LM tensor parallelism: q/k/v and the gate/up projections split their output dim
    (column parallel, whole heads per rank, so n_kv_heads must be divisible by the degree; their
    biases with them), the attention and MLP output projections their input dim (row parallel;
    a bias of the output projection is replicated along the width); the embedding and the head
    split the vocabulary. Parameters not named here (the q/k norms) are replicated.
    """
    mlp_in = ("blocks.mlp.w_in",) if plain_mlp else ("blocks.mlp.w_gate", "blocks.mlp.w_up")
    norms = (*(f"blocks.{n}" for n in _block_norms(norm_style)), "final_norm")
    return nn.tensor_plans(
        column=("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", *mlp_in),
        column_bias=(
            *(("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv") if qkv_bias else ()),
            *(("blocks.mlp.b_in",) if plain_mlp else ()),
        ),
        row=("blocks.attn.wo", "blocks.mlp.w_out" if plain_mlp else "blocks.mlp.w_down"),
        hidden=(
            *(
                f"{n}.{w}"
                for n in norms
                for w in (("weight", "bias") if layer_norm else ("weight",))
            ),
            *(("blocks.attn.bo",) if o_bias else ()),
            *(("blocks.mlp.b_out",) if plain_mlp else ()),
        ),
        vocab=("embed.tokens",),
        head=("head.weight",),
        optional=tuple(sorted(_BIASES)) if bias_optional else (),
    )


def _block_norms(style: str) -> tuple[str, ...]:
    """The norms of a block by ``norm_style``: before (``ln1``, ``ln2``) and after (``post1``,
    ``post2``) the attention and the MLP."""
    return {"pre": ("ln1", "ln2"), "post": ("post1", "post2")}.get(
        style, ("ln1", "post1", "ln2", "post2")
    )


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, by dotted path (in the order of :func:`init`)."""
    L, D, V, F = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_ff
    assert F is not None and cfg.n_kv_heads is not None  # resolved by Config.__post_init__
    assert cfg.head_dim is not None
    HE, KE = cfg.n_head * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    E = cfg.head_dim
    norms = _block_norms(cfg.norm_style)
    qn, kn = (E, E) if cfg.qk_norm_width == "head" else (HE, KE)
    biased = cfg.norm_type == "layer"  # LayerNorm: a bias beside each weight
    shapes = {
        "embed.tokens": (V, D),
        **{f"blocks.{n}.{w}": (L, D) for n in norms for w in ("weight", "bias")[: 1 + biased]},
        "blocks.attn.wq": (L, D, HE),
        "blocks.attn.wk": (L, D, KE),
        "blocks.attn.wv": (L, D, KE),
        **(
            {"blocks.attn.bq": (L, HE), "blocks.attn.bk": (L, KE), "blocks.attn.bv": (L, KE)}
            if cfg.qkv_bias
            else {}
        ),
        **({"blocks.attn.q_norm": (L, qn), "blocks.attn.k_norm": (L, kn)} if cfg.qk_norm else {}),
        "blocks.attn.wo": (L, HE, D),
        **({"blocks.attn.bo": (L, D)} if cfg.o_bias else {}),
        **_mlp_shapes(cfg),
        "final_norm.weight": (D,),
        **({"final_norm.bias": (D,)} if biased else {}),
    }
    if not cfg.tie_embeddings:
        shapes["head.weight"] = (D, V)  # [in, out] like every other weight
    return shapes


def _mlp_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    L, D, F = cfg.n_layer, cfg.d_model, cfg.d_ff
    assert F is not None
    if cfg.n_experts:  # colfunc.nn.moe's sparse MLP
        E, X, S = cfg.n_experts, cfg.d_expert, cfg.d_shared_expert or 0
        assert X is not None
        shared = {
            "blocks.mlp.shared.w_gate": (L, D, S),
            "blocks.mlp.shared.w_up": (L, D, S),
            "blocks.mlp.shared.w_down": (L, S, D),
            "blocks.mlp.shared_gate": (L, D, 1),
        }
        return {
            "blocks.mlp.router": (L, D, E),
            "blocks.mlp.experts.w_gate": (L, E, D, X),
            "blocks.mlp.experts.w_up": (L, E, D, X),
            "blocks.mlp.experts.w_down": (L, E, X, D),
            **(shared if S else {}),
            **(_gated_shapes(L, D, F) if cfg.dense_layers else {}),
        }
    if cfg.mlp_gated:
        return _gated_shapes(L, D, F)
    bias = {"blocks.mlp.b_in": (L, F), "blocks.mlp.b_out": (L, D)} if cfg.mlp_bias else {}
    return {"blocks.mlp.w_in": (L, D, F), "blocks.mlp.w_out": (L, F, D), **bias}


def _gated_shapes(L: int, D: int, F: int) -> dict[str, tuple[int, ...]]:
    return {
        "blocks.mlp.w_gate": (L, D, F),
        "blocks.mlp.w_up": (L, D, F),
        "blocks.mlp.w_down": (L, F, D),
    }


def unused_layers(cfg: Config, path: str) -> tuple[int, ...]:
    """The layers whose slice of the stacked parameter ``path`` no computation reads (zeros):
    where a mixture of experts has dense layers between its sparse ones, each layer holds both
    MLPs' weights and uses one (the sparse ones' for :meth:`Config.sparse_layers`, the dense
    gated MLP's for ``dense_layers``)."""
    if not cfg.dense_layers or not path.startswith("blocks.mlp."):
        return ()
    dense = path.startswith("blocks.mlp.w_")
    return cfg.sparse_layers if dense else cfg.dense_layers


_NORM_WEIGHTS = {
    *(f"blocks.{n}.weight" for n in ("ln1", "ln2", "post1", "post2")),
    "final_norm.weight",
    "blocks.attn.q_norm",
    "blocks.attn.k_norm",
}
_BIASES = {"blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv", "blocks.attn.bo"}
_RESIDUAL_OUT = {
    "blocks.attn.wo",
    "blocks.mlp.w_down",
    "blocks.mlp.w_out",
    "blocks.mlp.experts.w_down",
    "blocks.mlp.shared.w_down",
}


def init(cfg: Config, seed: int = 0, *, abstract: bool = False) -> Params:
    """Fresh fp32 parameters; each value depends only on ``(seed, path)``.

    ``abstract=True``: :class:`colfunc.random.Abstract` leaves, described but not made, for a
    step that makes each where it belongs (``step.init``; see ``zero`` and ``offload``).

    Weights N(0, 0.02), the residual-stream output projections N(0, 0.02 / sqrt(2 * n_layer))
    as in GPT-2, norm scales 1, biases 0.
    """
    std_out = 0.02 / math.sqrt(2 * cfg.n_layer)

    def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
        if path in _NORM_WEIGHTS:  # scales of 1 (Gemma's weights are offsets from it)
            return torch.full(shape, 1.0 - cfg.norm_offset)
        if path in _BIASES or path.endswith(".bias") or path.startswith("blocks.mlp.b_"):
            return torch.zeros(shape)
        x = random.normal(seed, path, shape, std_out if path in _RESIDUAL_OUT else 0.02)
        unused = unused_layers(cfg, path)
        if unused:
            x[list(unused)] = 0.0
        return x

    return make_params(param_shapes(cfg), value, abstract)


def _head_dim(cfg: Config) -> int:
    assert cfg.head_dim is not None  # resolved by Config.__post_init__
    return cfg.head_dim


def _embed(params: Params, input_ids_BT: torch.Tensor, cfg: Config) -> torch.Tensor:
    nn.check_input_ids(input_ids_BT, cfg.max_seq_len, cfg.vocab_size)
    return _scaled(nn.embedding(input_ids_BT, params["embed"]["tokens"]), cfg)


def _scaled(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Gemma's embeddings times sqrt(d_model), the factor rounded to their dtype first."""
    if not cfg.embed_scale:
        return x
    return x * torch.tensor(math.sqrt(cfg.d_model), dtype=x.dtype, device=x.device)


def _ropes(
    cfg: Config, length: int, device: Any, context: int | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The rotary tables of the first ``length`` positions: ``rope`` (every layer's, or the
    full-attention layers'), and ``rope_local`` for the sliding layers where their base differs."""
    R = cfg.rotary_dim  # (the head dim, or its leading part: GPT-NeoX's rotary_pct)
    scaling = cfg.rope_scaling
    if scaling.type == "longrope" and context is None and core.sequence_split():
        raise ValueError(
            f"{cfg.family_name}: rope_type='longrope' chooses its factors by the whole sequence's "
            "length, which a long-sequence shard (ulysses, ring, zigzag, usp) splits; train it "
            "without one"
        )
    out = {"rope": nn.rope_tables(length, R, cfg.rope_theta, device, scaling, context)}
    if cfg.rope_local_theta is not None:
        out["rope_local"] = nn.rope_tables(length, R, cfg.rope_local_theta, device)
    return out


@functools.lru_cache(maxsize=16)
def _context_ropes(
    cfg: Config, device: Any, context: int | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The rotary tables of every position of the context, which the engine indexes at its new
    tokens' positions: made once per config, device and LongRoPE regime, not at every step (no
    frame reorders positions in the engine)."""
    with torch.no_grad():
        return _ropes(cfg, cfg.max_seq_len, device, context)


def _carry(x_BTD: torch.Tensor, cfg: Config) -> Carry:
    """What each block reads: the residual stream and the rotary tables, made once per pass;
    with sparse MLPs, their routing statistics so far (see :func:`_mlp`)."""
    carry = {"h": x_BTD, **_ropes(cfg, x_BTD.shape[1], x_BTD.device)}
    if cfg.n_experts:
        dtype = torch.float64 if x_BTD.dtype == torch.float64 else torch.float32
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=x_BTD.device)  # noqa: E731
        E, K = cfg.n_experts, cfg.n_experts_per_tok
        carry.update(moe_tokens=zeros(K, E), moe_probs=zeros(E), moe_z=zeros())
    return carry


def _xs(cfg: Config) -> dict[str, torch.Tensor] | None:
    """The scan's per-layer input where the layers differ: each layer's index."""
    return {"layer": torch.arange(cfg.n_layer)} if cfg.per_layer else None


def _norm(x: torch.Tensor, p: Params, cfg: Config) -> torch.Tensor:
    """The norm whose parameters are ``p``: RMSNorm (scaling by ``norm_offset + weight``) or
    LayerNorm with its bias."""
    w = p["weight"]
    if cfg.norm_type == "layer":
        return ops.layer_norm(x, w, p["bias"], cfg.norm_eps)
    return ops.rms_norm(x, w + cfg.norm_offset if cfg.norm_offset else w, cfg.norm_eps)


_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": nn.gelu_tanh,
    "gelu": torch.nn.functional.gelu,
}


def _mlp(
    h_BTD: torch.Tensor, p: Params, cfg: Config, carry: Carry, i: int | None
) -> tuple[torch.Tensor, Carry]:
    """Block ``i``'s MLP, and the carry with a sparse MLP's routing statistics added (each
    layer's share of the load-balancing and z losses' means over the sparse layers)."""
    if not cfg.sparse_at(i):
        return (nn.gated if cfg.mlp_gated else nn.mlp)(h_BTD, p, _ACT[cfg.mlp_act]), carry
    k, norm, capacity = cfg.n_experts_per_tok, cfg.norm_topk_prob, cfg.capacity_factor
    y_BTD, r = nn.sparse_mlp(h_BTD, p, k, norm, capacity)
    if "moe_tokens" not in carry:  # (the engine's passes keep no statistics)
        return y_BTD, carry
    L = len(cfg.sparse_layers)
    return y_BTD, {
        **carry,
        "moe_tokens": carry["moe_tokens"] + r.tokens / L,
        "moe_probs": carry["moe_probs"] + r.probs / L,
        "moe_z": carry["moe_z"] + r.z / L,
    }


def _block(layer: Params, carry: Carry, cfg: Config, i: int | None = None) -> Carry:
    return _block_kv(layer, carry, cfg, None, i)[0]


def _block_kv(
    layer: Params, carry: Carry, cfg: Config, paged: nn.Paged | None, i: int | None = None
) -> tuple[Carry, dict[str, torch.Tensor] | None]:
    """Block ``i`` (its index matters where the layers differ, :attr:`Config.per_layer`); with
    ``paged`` its attention reads the KV cache, and it also returns this layer's new keys and
    values."""
    x_BTD = carry["h"]
    local = i is not None and cfg.window_at(i) is not None
    rope = carry["rope_local"] if local and "rope_local" in carry else carry["rope"]
    if i is not None and i in cfg.nope_layers:
        rope = None
    options = nn.AttentionOptions(
        norm_eps=cfg.norm_eps,
        qk_norm=cfg.qk_norm_width,
        norm_offset=cfg.norm_offset,
        window=cfg.window_at(i) if i is not None else cfg.sliding_window,
        scale=None if cfg.attn_scale_dim is None else cfg.attn_scale_dim**-0.5,
        softcap=cfg.attn_softcap,
    )
    pre, post = cfg.norm_style != "post", cfg.norm_style != "pre"
    h_BTD = _norm(x_BTD, layer["ln1"], cfg) if pre else x_BTD
    a_BTD, kv = nn.attend(
        h_BTD, layer["attn"], head_dim=_head_dim(cfg), rope=rope, paged=paged, options=options
    )
    if cfg.parallel_residual:  # GPT-NeoX: both sub-layers read the block's input
        m_BTD, carry = _mlp(_norm(x_BTD, layer["ln2"], cfg), layer["mlp"], cfg, carry, i)
        return {**carry, "h": m_BTD + a_BTD + x_BTD}, kv
    x_BTD = x_BTD + (_norm(a_BTD, layer["post1"], cfg) if post else a_BTD)
    h_BTD = _norm(x_BTD, layer["ln2"], cfg) if pre else x_BTD
    m_BTD, carry = _mlp(h_BTD, layer["mlp"], cfg, carry, i)
    x_BTD = x_BTD + (_norm(m_BTD, layer["post2"], cfg) if post else m_BTD)
    return {**carry, "h": x_BTD}, kv


def _logits(params: Params, x_BTD: torch.Tensor, cfg: Config) -> torch.Tensor:
    h_BTD = _norm(x_BTD, params["final_norm"], cfg)
    if cfg.tie_embeddings:
        logits = nn.unembed(h_BTD, params["embed"]["tokens"])
    else:
        logits = nn.linear(h_BTD, params["head"]["weight"])
    cap = cfg.final_softcap
    # (tanh in place on the quotient, which nothing saves: one vocabulary-wide tensor fewer)
    return logits if cap is None else (logits / cap).tanh_() * cap


def _scan_block(cfg: Config) -> Any:
    """The block ``scan_layers`` runs: ``block(layer, carry)``, or where the layers differ
    ``block(layer, carry, x) -> (carry, None)`` with the layer's index in ``x``."""
    if not cfg.per_layer:
        return lambda layer, c: _block(layer, c, cfg)
    return lambda layer, c, x: (_block(layer, c, cfg, int(x["layer"])), None)


def _run(params: Params, carry: Carry, cfg: Config) -> Carry:
    xs = _xs(cfg)
    if xs is None:
        return scan_layers(_scan_block(cfg), carry, params["blocks"])
    return scan_layers(_scan_block(cfg), carry, params["blocks"], xs=xs)[0]


def apply(params: Params, input_ids: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[B, T, V]`` for ``input_ids[B, T]`` (fp32 for fp32 params)."""
    carry = _run(params, _carry(_embed(params, input_ids, cfg), cfg), cfg)
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
    x_1ND = _scaled(nn.embedding(tokens_N, params["embed"]["tokens"])[None], cfg)
    positions_N = batch.token_positions()
    # (LongRoPE: the short factors' tables here, the long ones' where a sequence is past them)
    ropes = _context_ropes(cfg, x_1ND.device, cfg.cache_regime)
    carry: Carry = {
        "h": x_1ND,
        **{k: (c[positions_N], s[positions_N]) for k, (c, s) in ropes.items()},
    }
    if cfg.cache_regime is not None:  # each sequence's tokens by its own length, as if alone
        carry["rope"] = _longrope_at(cfg, batch, positions_N, carry["rope"])
    act = _ACT[cfg.mlp_act]
    fast = decoder_decode.layers(params["blocks"], x_1ND, carry["rope"], batch, cache, cfg, act)
    if fast is not None:  # a decoding step on the CPU: the same kernels, called directly
        h_1ND, ys = fast
        return _logits(params, h_1ND[:, select_R], cfg)[0], ys
    if cfg.per_layer:
        block = lambda layer, c, paged: _block_kv(layer, c, cfg, paged, paged.layer)  # noqa: E731
    else:
        block = lambda layer, c, paged: _block_kv(layer, c, cfg, paged)  # noqa: E731
    carry, ys = nn.paged_scan(block, carry, params["blocks"], cache, batch)
    return _logits(params, carry["h"][:, select_R], cfg)[0], ys


def _longrope_at(
    cfg: Config,
    batch: nn.PagedBatch,
    positions_N: torch.Tensor,
    short_N: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's tables at the new tokens' positions (``short_N``: the short factors'), each
    token's from the long factors instead where its sequence's whole length is past them
    (``transformers`` chooses by the length in each forward pass, and computes a sequence's
    cache again when it grows past the short factors' reach: the engine does too, see
    :class:`colfunc.models.KVCacheSpec`'s ``regime``)."""
    original, device = cfg.rope_scaling.original_max_position, positions_N.device
    long = _context_ropes(cfg, device, original + 1)["rope"]
    lens = torch.tensor(batch.query_lens, device=device)
    past = torch.tensor([e > original for e in batch.seq_lens or ()], device=device)
    past_N1 = past.repeat_interleave(lens)[:, None]
    cos, sin = (torch.where(past_N1, lg[positions_N], sh) for sh, lg in zip(short_N, long))
    return cos, sin


def loss(cfg: Config) -> Layered:
    """``loss_fn(params, {"input_ids", "labels"})``: mean next-token cross-entropy, ``-100`` ignored.

    The same computation as :func:`apply` followed by the shifted cross-entropy, in the
    ``layered(pre, block, post)`` form that ``pipeline`` cuts into stages.
    """

    def pre(params: Params, batch: Any) -> Carry:
        return _carry(_embed(params, nn.batch_field(batch, "input_ids"), cfg), cfg)

    def post(params: Params, carry: Carry, batch: Any, ys: Any = None) -> torch.Tensor:
        head = lambda h: _logits(params, h, cfg)  # noqa: E731
        loss = nn.causal_lm_loss(head, carry["h"], nn.batch_field(batch, "labels"))
        if cfg.n_experts and cfg.router_aux_loss_coef:  # (Switch's load balancing, Mixtral's)
            aux = nn.load_balancing_loss(carry["moe_tokens"], carry["moe_probs"])
            loss = loss + cfg.router_aux_loss_coef * aux.to(loss.dtype)
        if cfg.n_experts and cfg.router_z_loss_coef:  # (ST-MoE's router z-loss)
            loss = loss + cfg.router_z_loss_coef * carry["moe_z"].to(loss.dtype)
        return loss

    # whole heads per rank: the attention splits by head (any vocabulary splits, unevenly)
    divisors = {"n_head": cfg.n_head, "n_kv_heads": cfg.n_kv_heads}
    # only the residual stream has a sequence dim to split; the rotary tables stay whole
    xs = None if not cfg.per_layer else lambda params, batch: _xs(cfg)
    return layered(
        pre,
        _scan_block(cfg),
        post,
        name=cfg.family_name,
        divisors=divisors,
        sequence_dims={"h": 1},
        xs=xs,
        expert_dims={f"blocks.mlp.experts.{w}": 1 for w in ("w_gate", "w_up", "w_down")}
        if cfg.n_experts
        else None,
    )
