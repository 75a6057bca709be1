"""GPT-NeoX (Pythia, GPT-NeoX-20B): the shared decoder (:mod:`colfunc.models.decoder`) with
LayerNorms, attention and MLP reading the same block input (``parallel_residual``), rotary
embeddings on the leading quarter of each head (``rotary_fraction``), a plain GELU MLP and
biases on every projection, read from and written to Hugging Face's ``GPTNeoXForCausalLM``.
Its fused ``query_key_value`` (each head's query, key and value in turn) is cut into the
decoder's ``wq``, ``wk``, ``wv`` and fused again on export."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes
from colfunc.models.family import HFWeight, linear, require

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
    """GPT-NeoX sizes (see :class:`colfunc.models.decoder.Config`): LayerNorms, the parallel
    residual (``use_parallel_residual``; off, the sub-layers run one after the other), a quarter
    of each head rotated, a 4x GELU MLP with biases, biases on q/k/v and the output projection
    (``attention_bias``), no grouped heads."""

    family_name = "gpt_neox"
    variations = (
        "norm_type",
        "parallel_residual",
        "rotary_fraction",
        "mlp_gated",
        "mlp_bias",
        "mlp_act",
    )
    norm_type: str = "layer"
    parallel_residual: bool = True
    rotary_fraction: float = 0.25
    mlp_gated: bool = False
    mlp_bias: bool = True
    mlp_act: str = "gelu"
    qkv_bias: bool = True
    o_bias: bool = True

    def __post_init__(self) -> None:
        if self.d_ff is None and isinstance(self.d_model, int):
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        super().__post_init__()
        self.require_variations(
            self.norm_type == "layer"
            and not self.mlp_gated
            and self.mlp_bias
            and self.qkv_bias == self.o_bias
            and not self.qk_norm
            and self.n_kv_heads == self.n_head,
            "GPT-NeoX has LayerNorms, a plain MLP with biases, biases on all four attention "
            "projections or none, no q/k norms and no grouped key/value heads",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(
    qkv_bias=True, o_bias=True, bias_optional=True, plain_mlp=True, layer_norm=True
)
tp_plan: dict[str, P] = tp_plans["1d"]


def _weights(cfg: Any) -> tuple[list[HFWeight], list[HFWeight]]:
    h, a = "gpt_neox.layers.{i}.", "gpt_neox.layers.{i}.attention."
    qkv = ("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv")
    heads = cfg.n_head
    biases = (
        [
            HFWeight(
                a + "query_key_value.bias", tuple(p.replace(".w", ".b") for p in qkv), groups=heads
            ),
            HFWeight(a + "dense.bias", ("blocks.attn.bo",)),
        ]
        if cfg.qkv_bias
        else []
    )
    norm = lambda hf, ours: [  # noqa: E731
        HFWeight(f"{hf}.weight", (f"{ours}.weight",)),
        HFWeight(f"{hf}.bias", (f"{ours}.bias",)),
    ]
    layer = [
        *norm(h + "input_layernorm", "blocks.ln1"),
        HFWeight(a + "query_key_value.weight", qkv, transpose=True, groups=heads),
        linear(a + "dense.weight", "blocks.attn.wo"),
        *biases,
        *norm(h + "post_attention_layernorm", "blocks.ln2"),
        linear(h + "mlp.dense_h_to_4h.weight", "blocks.mlp.w_in"),
        HFWeight(h + "mlp.dense_h_to_4h.bias", ("blocks.mlp.b_in",)),
        linear(h + "mlp.dense_4h_to_h.weight", "blocks.mlp.w_out"),
        HFWeight(h + "mlp.dense_4h_to_h.bias", ("blocks.mlp.b_out",)),
    ]
    top = [
        HFWeight("gpt_neox.embed_in.weight", ("embed.tokens",)),
        *norm("gpt_neox.final_layer_norm", "final_norm"),
        # (transformers names the head lm_head, and saves it as embed_out, Pythia's name)
        HFWeight("lm_head.weight", ("embed.tokens",), aliases=("embed_out.weight",))
        if cfg.tie_embeddings
        else HFWeight("lm_head.weight", ("head.weight",), True, aliases=("embed_out.weight",)),
    ]
    return top, layer


def _read(c: Any) -> Config:
    require("GPT-NeoX", c, "hidden_act", ("gelu", "gelu_new", "gelu_pytorch_tanh"))
    rope = dict(getattr(c, "rope_parameters", None) or {})
    fraction = rope.pop("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
    if "rope_theta" not in rope:  # transformers 4.x
        rope = {**(getattr(c, "rope_scaling", None) or {}), "rope_theta": c.rotary_emb_base}
    bias = bool(getattr(c, "attention_bias", True))
    shim = _Shim(c, num_key_value_heads=c.num_attention_heads, rms_norm_eps=c.layer_norm_eps)
    act = "gelu" if c.hidden_act == "gelu" else "gelu_tanh"
    cfg = decoder_hf.read_hf_config(
        shim,
        Config,
        "GPT-NeoX",
        rope=rope,
        qkv_bias=bias,
        o_bias=bias,
        rotary_fraction=float(fraction),
        parallel_residual=bool(c.use_parallel_residual),
    )
    return dataclasses.replace(cfg, mlp_act=act)  # type: ignore[return-value]


class _Shim:
    """``c`` with the LLaMA-shaped names :func:`decoder_hf.read_hf_config` reads."""

    def __init__(self, c: Any, **names: Any) -> None:
        self._c, self._names = c, {**names, "hidden_act": "silu", "mlp_bias": False}

    def __getattr__(self, name: str) -> Any:
        return self._names[name] if name in self._names else getattr(self._c, name)


def _write(cfg: decoder.Config) -> dict[str, Any]:
    out = decoder_hf.write_hf_config(cfg)
    for key in ("num_key_value_heads", "head_dim"):
        out.pop(key)
    rope = {**out.pop("rope_parameters"), "partial_rotary_factor": cfg.rotary_fraction}
    return {
        **out,
        "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.mlp_act],
        "layer_norm_eps": out.pop("rms_norm_eps"),
        "rope_parameters": rope,
        "use_parallel_residual": cfg.parallel_residual,
        "attention_bias": cfg.qkv_bias,
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="GPTNeoXForCausalLM",
    model_type="gpt_neox",
    read=_read,
    write=_write,
    weights=_weights,
)
