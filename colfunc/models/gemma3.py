"""Gemma 3 (text): Gemma 2's decoder (:mod:`colfunc.models.gemma2`) without soft-capping, with
RMS norms of each query and key head (scaling by ``1 + weight`` too), and a rotary base of their
own for the sliding layers (``rope_local_theta``; the global layers take ``rope_theta`` and its
scaling), read from and written to Hugging Face's ``Gemma3ForCausalLM`` (``gemma3_text``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar

from colfunc.core import P
from colfunc.models import decoder, decoder_hf, gemma2
from colfunc.models.decoder import apply, init, loss, paged_forward, param_shapes
from colfunc.models.gemma2 import read_gemma, write_gemma

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
class Config(gemma2.Config):
    """Gemma 3 sizes: Gemma 2's (see :class:`colfunc.models.gemma2.Config`) with q/k norms,
    rotary base 10^6 on the global layers and ``rope_local_theta`` 10^4 on the sliding ones, and
    no soft-capping by default."""

    family_name = "gemma3"
    variations: ClassVar[tuple[str, ...] | None] = (*gemma2.VARIES, "rope_local_theta")
    label = "Gemma 3"
    with_qk_norm = True
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    rope_local_theta: float | None = 10_000.0


tp_plans: dict[str, dict[str, P]] = decoder.plans(
    qkv_bias=True, o_bias=True, bias_optional=True, norm_style="sandwich"
)
tp_plan: dict[str, P] = tp_plans["1d"]


def _read(c: Any) -> Config:
    params = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in params:  # transformers 5: the rotary settings per layer type
        rope, local = params["full_attention"], params.get("sliding_attention") or {}
    else:  # 4.x: rope_theta and rope_scaling for the global layers, a base for the local
        rope = {**(getattr(c, "rope_scaling", None) or {}), "rope_theta": c.rope_theta}
        local = {"rope_type": "default", "rope_theta": getattr(c, "rope_local_base_freq", 1e4)}
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"from_hf: Gemma 3 with rope_type={kind!r} on its sliding layers is not supported; "
            "colfunc's model scales the global layers' rotary frequencies only"
        )
    cfg = read_gemma(c, Config, "Gemma 3", rope=rope)
    theta = float(local.get("rope_theta", 10_000.0)) if cfg.sliding_window is not None else None
    return dataclasses.replace(cfg, rope_local_theta=theta)


def _write(cfg: decoder.Config) -> dict[str, Any]:
    out = write_gemma(cfg)
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {
        **out,
        "rope_parameters": {"full_attention": out["rope_parameters"], "sliding_attention": local},
    }


family = decoder_hf.family(
    sys.modules[__name__],
    Config,
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    read=_read,
    write=_write,
)
