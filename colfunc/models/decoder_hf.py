"""The Hugging Face side of the shared decoder (:mod:`colfunc.models.decoder`): the
``LlamaForCausalLM`` weight table with the config's biases and q/k norms, the config both ways
(sizes, rotary settings and scaling, the sliding window), the Qwen configs' window fields, and the
:class:`~colfunc.models.family.Family` of a LLaMA-shaped family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colfunc import nn
from colfunc.models.decoder import Config
from colfunc.models.family import Family, HFMapping, HFWeight, KVCacheSpec, linear, require

__all__ = [
    "family",
    "family_weights",
    "read_hf_config",
    "read_layer_types",
    "read_window",
    "write_hf_config",
    "write_layer_types",
    "write_window",
]


def family_weights(cfg: Config) -> tuple[list[HFWeight], list[HFWeight]]:
    """The weight table of ``LlamaForCausalLM`` with ``cfg``'s biases and q/k norms: ``(top,
    per_layer)`` entries, each naming one colfunc path (a family that fuses some, as Phi-3,
    rewrites those)."""
    h = "model.layers.{i}."
    a = h + "self_attn."
    biases = [
        HFWeight(a + f"{x}_proj.bias", (f"blocks.attn.b{x}",))
        for x, on in (("q", cfg.qkv_bias), ("k", cfg.qkv_bias), ("v", cfg.qkv_bias))
        if on
    ]
    norms = (
        [
            HFWeight(a + "q_norm.weight", ("blocks.attn.q_norm",)),
            HFWeight(a + "k_norm.weight", ("blocks.attn.k_norm",)),
        ]
        if cfg.qk_norm
        else []
    )
    o_bias = [HFWeight(a + "o_proj.bias", ("blocks.attn.bo",))] if cfg.o_bias else []
    hf_norm = _NORM_NAMES[cfg.norm_style]
    norm = {n: [HFWeight(h + f"{hf_norm[n]}.weight", (f"blocks.{n}.weight",))] for n in hf_norm}
    layer = [
        *norm.get("ln1", []),
        linear(a + "q_proj.weight", "blocks.attn.wq"),
        linear(a + "k_proj.weight", "blocks.attn.wk"),
        linear(a + "v_proj.weight", "blocks.attn.wv"),
        *biases,
        *norms,
        linear(a + "o_proj.weight", "blocks.attn.wo"),
        *o_bias,
        *norm.get("post1", []),
        *norm.get("ln2", []),
        linear(h + "mlp.gate_proj.weight", "blocks.mlp.w_gate"),
        linear(h + "mlp.up_proj.weight", "blocks.mlp.w_up"),
        linear(h + "mlp.down_proj.weight", "blocks.mlp.w_down"),
        *norm.get("post2", []),
    ]
    top = [
        HFWeight("model.embed_tokens.weight", ("embed.tokens",)),
        HFWeight("model.norm.weight", ("final_norm.weight",)),
        HFWeight("lm_head.weight", ("embed.tokens",))
        if cfg.tie_embeddings
        else linear("lm_head.weight", "head.weight"),
    ]
    return top, layer


# the Hugging Face names of a block's norms, by norm_style
_NORM_NAMES = {
    "pre": {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"},
    "post": {"post1": "post_attention_layernorm", "post2": "post_feedforward_layernorm"},
    "sandwich": {
        "ln1": "input_layernorm",
        "post1": "post_attention_layernorm",
        "ln2": "pre_feedforward_layernorm",
        "post2": "post_feedforward_layernorm",
    },
}
# Hugging Face activations -> Config.mlp_act (the gated MLP's gate)
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_hf_config(
    c: Any,
    config: type[Config],
    label: str,
    *,
    sliding_window: int | None = None,
    rope: dict[str, Any] | None = None,
    act: str = "hidden_act",
    longrope: bool = False,
    **fields: Any,
) -> Config:
    """``config`` from a Hugging Face LLaMA-shaped config ``c``: sizes, rotary settings, norm
    and embeddings; ``fields`` are the family's own (its biases, its q/k norms), read by the
    family, which also refuses what it does not compute (:func:`require`). ``label`` names the
    family in errors. ``sliding_window``: the window every layer slides by, as the family reads
    it; one no shorter than the context computes the same model as none, and is read as None.
    ``rope``: the rotary settings where the family keeps them elsewhere (Gemma 3's per layer
    type); ``act``: the config field naming the MLP's activation; ``longrope``: whether the
    family takes LongRoPE (Phi-3, whose ``transformers`` generation computes a sequence's cache
    again when it grows past the short factors, as the engine does; others do not)."""
    if sliding_window is not None and sliding_window >= c.max_position_embeddings:
        sliding_window = None
        fields.pop("layer_types", None)
    require(label, c, act, tuple(_ACTS))
    require(label, c, "mlp_bias", (False,))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta and rope_scaling
    rope = (
        rope
        or getattr(c, "rope_parameters", None)
        or {
            **(getattr(c, "rope_scaling", None) or {}),
            "rope_theta": getattr(c, "rope_theta", 10000.0),
        }
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope" and not longrope:
        raise ValueError(
            f"from_hf: {label} with rope_type='longrope' is not supported; colfunc computes "
            "LongRoPE for Phi-3, whose generation in transformers recomputes the cache when a "
            "sequence outgrows the short factors"
        )
    if rope_type not in nn.ROPE_TYPES:
        raise ValueError(
            f"from_hf: {label} with rope_type={rope_type!r} is not supported; colfunc's model "
            f"computes the rope types {', '.join(nn.ROPE_TYPES)}"
        )
    scaling: dict[str, Any] = {}
    if rope_type in ("longrope", "dynamic"):  # (their factor may be left to the context's ratio)
        original = rope.get("original_max_position_embeddings") or getattr(
            c, "original_max_position_embeddings", None
        )
        rope = {
            "original_max_position_embeddings": original or c.max_position_embeddings,
            **{k: v for k, v in rope.items() if v is not None},
        }
        rope.setdefault(
            "factor", c.max_position_embeddings / rope["original_max_position_embeddings"]
        )
    needs = {
        "linear": ("factor",),
        "llama3": _LLAMA3_KEYS,
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor"),
    }.get(rope_type, ())
    missing = [k for k in needs if k not in rope]
    if missing:
        raise ValueError(f"from_hf: {label} rope_type={rope_type!r} without {', '.join(missing)}")
    if rope_type != "default":
        scaling = dict(rope_type=rope_type, rope_factor=float(rope["factor"]))
    if rope_type == "llama3":
        scaling.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
    if rope_type == "longrope":
        scaling.update(
            rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
            rope_short_factor=tuple(float(v) for v in rope["short_factor"]),
            rope_long_factor=tuple(float(v) for v in rope["long_factor"]),
        )
        if rope.get("attention_factor") is not None:
            scaling["rope_attention_factor"] = float(rope["attention_factor"])
    if rope_type == "yarn":
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"from_hf: {label} yarn with partial_rotary_factor="
                f"{rope['partial_rotary_factor']!r} is not supported (1.0 only)"
            )
        optional = {
            "rope_attention_factor": rope.get("attention_factor"),
            "rope_mscale": rope.get("mscale"),
            "rope_mscale_all_dim": rope.get("mscale_all_dim"),
        }
        scaling.update(
            rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
            rope_beta_fast=float(rope.get("beta_fast") or 32.0),
            rope_beta_slow=float(rope.get("beta_slow") or 1.0),
            rope_truncate=bool(rope.get("truncate", True)),
            **{k: float(v) for k, v in optional.items() if v is not None},
        )
    return config(
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        d_model=c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        d_ff=c.intermediate_size,
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        **scaling,
        norm_eps=c.rms_norm_eps,
        tie_embeddings=bool(c.tie_word_embeddings),
        sliding_window=sliding_window,
        mlp_act=_ACTS[getattr(c, act, "silu")],
        **fields,
    )


def write_hf_config(cfg: Config) -> dict[str, Any]:
    """The ``transformers`` config keyword arguments the LLaMA-shaped families share."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=_write_rope(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act={v: k for k, v in _ACTS.items()}[cfg.mlp_act],
    )


def _write_rope(cfg: Config) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_scaling.original_max_position,
        )
    if cfg.rope_type == "longrope":
        rope.update(
            original_max_position_embeddings=cfg.rope_scaling.original_max_position,
            short_factor=list(cfg.rope_short_factor or ()),
            long_factor=list(cfg.rope_long_factor or ()),
        )
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    if cfg.rope_type == "yarn":
        rope.update(
            original_max_position_embeddings=cfg.rope_scaling.original_max_position,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
        )
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(cfg, f"rope_{key}")
            if value is not None:
                rope[key] = value
    return rope


def family(
    module: Any,
    config: type[Config],
    *,
    architecture: str,
    model_type: str,
    read: Callable[[Any], Config],
    write: Callable[[Config], dict[str, Any]],
    weights: Callable[[Any], tuple[list[HFWeight], list[HFWeight]]] | None = None,
) -> Family:
    """A LLaMA-shaped family's :class:`Family`: its module, its ``Config`` subclass, its
    ``transformers`` class and config (``read`` and ``write``: the config both ways, built on
    :func:`read_hf_config` and :func:`write_hf_config`); the weights as LLaMA's, with the
    config's biases and q/k norms."""
    return Family(
        name=config.family_name,
        module=module,
        config=config,
        hf=HFMapping(
            architectures=(architecture,),
            model_type=model_type,
            weights=weights or family_weights,
            read_config=read,
            write_config=write,
        ),
        kv_cache=KVCacheSpec.of_decoder,
    )


# --- the Qwen configs' sliding window (``use_sliding_window``, ``sliding_window``,
# ``max_window_layers``, ``layer_types``), for qwen2 and qwen3 -------------------------------


def read_window(c: Any, label: str) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of the Qwen config ``c``: the window where
    ``use_sliding_window`` (None otherwise), and the layers' types where some slide and others
    do not (``layer_types``, or in transformers 4.x the layers from ``max_window_layers`` on)."""
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", False) else None
    types = getattr(c, "layer_types", None)
    if types is None:  # transformers 4.x: the layers from max_window_layers on slide
        start = getattr(c, "max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(n)]  # fmt: skip
    sliding = [t == "sliding_attention" for t in types]
    if window is None or not any(sliding):
        return None, None  # (one no shorter than the context: None too, in read_hf_config)
    return int(window), None if all(sliding) else tuple(types)


def write_window(cfg: Any) -> dict[str, Any]:
    """The Qwen config fields of ``cfg``'s windows: every layer sliding, none, or a mix by
    ``layer_types``."""
    if cfg.sliding_window is None:
        return {"use_sliding_window": False}
    return {
        "use_sliding_window": True,
        "max_window_layers": 0,
        **write_layer_types(cfg),
    }


def read_layer_types(c: Any) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a config that names each layer's attention
    (``layer_types``, Gemma 2/3, SmolLM 3): the window and no per-layer types where every layer
    slides, none of either where none does, both where they are mixed."""
    types = tuple(getattr(c, "layer_types", None) or ())
    window = getattr(c, "sliding_window", None)
    if window is None or "sliding_attention" not in types:
        return None, None
    if set(types) == {"sliding_attention"}:
        return int(window), None
    return int(window), types


def write_layer_types(cfg: Any) -> dict[str, Any]:
    """The config fields of ``cfg``'s windows: ``layer_types`` and ``sliding_window``."""
    types = [
        "sliding_attention" if cfg.window_at(i) is not None else "full_attention"
        for i in range(cfg.n_layer)
    ]
    return {"layer_types": types, "sliding_window": cfg.sliding_window}
