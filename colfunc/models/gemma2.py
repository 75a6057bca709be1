"""Gemma 2: the shared decoder (:mod:`colfunc.models.decoder`) with norms before and after the
attention and the MLP (``norm_style="sandwich"``), RMS norms scaling by ``1 + weight``, a GeGLU
MLP, embeddings scaled by sqrt(d_model), the softmax scale ``query_pre_attn_scalar ** -0.5``,
attention scores and final logits soft-capped, and sliding-window layers alternating with global
ones (``layer_types``), read from and written to Hugging Face's ``Gemma2ForCausalLM``."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar

from colfunc.core import P
from colfunc.models import decoder, decoder_hf
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes

__all__ = [
    "Config",
    "apply",
    "family",
    "init",
    "loss",
    "paged_forward",
    "param_shapes",
    "read_gemma",
    "tp_plan",
    "tp_plans",
    "write_gemma",
]

# the decoder's variations a Gemma has
VARIES = (
    "norm_style",
    "norm_offset",
    "mlp_act",
    "embed_scale",
    "attn_scale_dim",
    "attn_softcap",
    "final_softcap",
    "layer_types",
)
# what every Gemma (2 and 3) is, beyond its sizes
GEMMA = dict(norm_style="sandwich", norm_offset=1.0, embed_scale=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(decoder.Config):
    """Gemma 2 sizes (see :class:`colfunc.models.decoder.Config`): sandwich norms scaling by
    ``1 + weight``, GeGLU, scaled and tied embeddings, soft-capping (``attn_softcap`` 50 and
    ``final_softcap`` 30 in Hugging Face's defaults), the softmax scale ``attn_scale_dim **
    -0.5``; ``qkv_bias`` and ``o_bias`` together are ``attention_bias``."""

    family_name = "gemma2"
    variations: ClassVar[tuple[str, ...] | None] = VARIES
    norm_style: str = "sandwich"
    norm_offset: float = 1.0
    mlp_act: str = "gelu_tanh"
    embed_scale: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    label: ClassVar[str] = "Gemma 2"
    with_qk_norm: ClassVar[bool] = False  # (Gemma 3 has them)

    def __post_init__(self) -> None:
        super().__post_init__()
        gemma = all(getattr(self, k) == v for k, v in GEMMA.items())
        norms = "q/k norms" if self.with_qk_norm else "no q/k norms"
        self.require_variations(
            gemma and self.qk_norm == self.with_qk_norm and self.qkv_bias == self.o_bias,
            f"{self.label} has sandwich norms scaling by 1 + weight and scaled embeddings "
            f"({GEMMA}), {norms}, and biases on all four attention projections or none",
        )


tp_plans: dict[str, dict[str, P]] = decoder.plans(
    qkv_bias=True, o_bias=True, bias_optional=True, norm_style="sandwich"
)
tp_plan: dict[str, P] = tp_plans["1d"]


def read_gemma(c: Any, config: type[decoder.Config], label: str, **fields: Any) -> Any:
    """A Gemma config (2 or 3) from Hugging Face's: windows by ``layer_types``, the softmax
    scale, the soft-caps, the activation (``hidden_activation``), and ``fields``."""
    window, types = decoder_hf.read_layer_types(c)
    bias = bool(getattr(c, "attention_bias", False))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    scale_dim = getattr(c, "query_pre_attn_scalar", None)  # (its own: the head dim's is None)
    caps: dict[str, Any] = {
        k: float(v)
        for k, v in (
            ("attn_softcap", getattr(c, "attn_logit_softcapping", None)),
            ("final_softcap", getattr(c, "final_logit_softcapping", None)),
        )
        if v is not None
    }
    return decoder_hf.read_hf_config(
        c,
        config,
        label,
        sliding_window=window,
        act="hidden_activation",
        qkv_bias=bias,
        o_bias=bias,
        layer_types=types,
        attn_scale_dim=None if scale_dim == head_dim else scale_dim,
        **caps,
        **fields,
    )


def write_gemma(cfg: decoder.Config) -> dict[str, Any]:
    """The Hugging Face config fields of a Gemma (2 or 3) config."""
    out = {**decoder_hf.write_hf_config(cfg), **decoder_hf.write_layer_types(cfg)}
    out["hidden_activation"] = out.pop("hidden_act")
    return {
        **out,
        "attention_bias": cfg.qkv_bias,
        "query_pre_attn_scalar": cfg.attn_scale_dim or cfg.head_dim,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap,
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Gemma2ForCausalLM",
    model_type="gemma2",
    read=lambda c: read_gemma(c, Config, "Gemma 2"),
    write=write_gemma,
)
