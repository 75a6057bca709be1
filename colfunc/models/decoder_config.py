"""The shared decoder's configuration (:class:`Config`): its sizes and the variations the
families pick from, checked; :mod:`colfunc.models.decoder` computes it."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

from colfunc import nn
from colfunc.models.family import positive_number

__all__ = ["LAYER_TYPES", "VARIATIONS", "Config"]


LAYER_TYPES = ("full_attention", "sliding_attention")
# the Config fields beyond LLaMA's that some families vary (see Config.variations)
VARIATIONS = (
    "qk_norm_width",
    "norm_style",
    "norm_offset",
    "mlp_act",
    "embed_scale",
    "attn_scale_dim",
    "attn_softcap",
    "final_softcap",
    "layer_types",
    "rope_local_theta",
    "nope_layers",
    "norm_type",
    "parallel_residual",
    "rotary_fraction",
    "mlp_gated",
    "mlp_bias",
    "n_experts",
    "dense_layers",
    "d_shared_expert",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)
_CHOICES: dict[str, tuple[Any, ...]] = {
    "qk_norm_width": ("head", "all"),
    "norm_style": ("pre", "post", "sandwich"),
    "mlp_act": ("silu", "gelu_tanh", "gelu"),
    "norm_type": ("rms", "layer"),
}


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
    # which of VARIATIONS the family has (None: all of them); the others must keep their defaults
    variations: ClassVar[tuple[str, ...] | None] = None

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
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    qk_norm_width: str = "head"
    norm_style: str = "pre"
    norm_offset: float = 0.0
    mlp_act: str = "silu"
    embed_scale: bool = False
    attn_scale_dim: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    nope_layers: tuple[int, ...] = ()
    norm_type: str = "rms"
    parallel_residual: bool = False
    rotary_fraction: float = 1.0
    mlp_gated: bool = True
    mlp_bias: bool = False
    # a sparse mixture-of-experts MLP in every layer (n_experts > 0; colfunc.nn.moe) but those
    # of dense_layers, whose MLP is a dense gated one d_ff wide (Qwen's mlp_only_layers)
    n_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    n_experts_per_tok: int = 2
    d_expert: int | None = None
    norm_topk_prob: bool = True
    d_shared_expert: int | None = None
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    capacity_factor: float | None = None

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
        f = self.rotary_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ValueError(
                f"{self.family_name}.Config: rotary_fraction must be in (0, 1], got {f!r}"
            )
        whence = f"d_model={self.d_model} / n_head={self.n_head} unless given"
        if f == 1 and head_dim % 2:
            raise ValueError(
                f"{self.family_name}.Config: rotary embeddings need an even head dim; "
                f"head_dim={head_dim} ({whence})"
            )
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"{self.family_name}.Config: rotary embeddings need an even number of rotated "
                f"dims >= 2; head_dim={head_dim} x rotary_fraction={f} gives {self.rotary_dim} "
                f"(head_dim is {whence})"
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
        flags = ("tie_embeddings", "qkv_bias", "o_bias", "qk_norm", "embed_scale")
        for flag in (*flags, "parallel_residual", "mlp_gated", "mlp_bias"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"{self.family_name}.Config: {flag} must be a bool, got {getattr(self, flag)!r}"
                )
        self._check_variations()
        self._check_experts()

    def _check_experts(self) -> None:
        name = f"{self.family_name}.Config"
        E, k = self.n_experts, self.n_experts_per_tok
        if isinstance(E, bool) or not isinstance(E, int) or E < 0:
            raise ValueError(f"{name}: n_experts must be an int >= 0, got {E!r}")
        if self.d_expert is None:
            object.__setattr__(self, "d_expert", self.d_ff)
        self._check_dense_layers()
        if not E:
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(
                f"{name}: n_experts_per_tok={k!r} must be an int in [1, n_experts={E}] (the "
                "experts each token is routed to)"
            )
        for field in ("d_expert", "d_shared_expert"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name}: {field} must be a positive int, got {value!r}")
        for field in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name}: {field} must be a number >= 0, got {value!r}")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not c > 0):
            raise ValueError(
                f"{name}: capacity_factor must be None (dropless) or a number > 0, got {c!r}"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"{name}: norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if not self.mlp_gated or self.parallel_residual:
            raise ValueError(
                f"{name}: the experts are gated MLPs in sequential blocks; n_experts > 0 needs "
                "mlp_gated=True and parallel_residual=False"
            )

    def _check_dense_layers(self) -> None:
        name, dense, L = f"{self.family_name}.Config", self.dense_layers, self.n_layer
        if not isinstance(dense, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in dense
        ):
            raise ValueError(
                f"{name}: dense_layers must be a tuple of layer indices in [0, {L}), got {dense!r}"
            )
        if dense and not self.n_experts:
            raise ValueError(
                f"{name}: dense_layers={dense!r} names the layers whose MLP is dense in a "
                "mixture of experts; with n_experts=0 every layer's is (leave it empty)"
            )
        if dense and len(set(dense)) == L:
            raise ValueError(
                f"{name}: dense_layers={dense!r} leaves no layer sparse; a model without "
                "experts is n_experts=0"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(dense))))

    def sparse_at(self, i: int | None) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts (``i=None``: a layer of a model
        whose layers are all alike)."""
        return bool(self.n_experts) and (i is None or i not in self.dense_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts."""
        return tuple(i for i in range(self.n_layer) if self.sparse_at(i))

    def _check_variations(self) -> None:
        name = f"{self.family_name}.Config"
        if self.variations is not None:  # the family's refusal of those it does not have
            base = {f.name: f.default for f in dataclasses.fields(Config)}
            off = [
                f"{n}={getattr(self, n)!r}"
                for n in VARIATIONS
                if n not in self.variations and getattr(self, n) != base[n]
            ]
            if off:
                raise ValueError(
                    f"{name}: {', '.join(off)}: not a variation this family has (it has "
                    f"{', '.join(self.variations) or 'none'} of them; colfunc.models.decoder."
                    "Config takes any mix)"
                )
        for field, allowed in _CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"{name}: {field} must be one of {allowed}, got {getattr(self, field)!r}"
                )
        for field in ("attn_scale_dim", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, field)
            if value is not None and not positive_number(value):
                raise ValueError(f"{name}: {field} must be None or a number > 0, got {value!r}")
        if isinstance(self.norm_offset, bool) or not isinstance(self.norm_offset, int | float):
            raise ValueError(f"{name}: norm_offset must be a number, got {self.norm_offset!r}")
        if self.mlp_gated and self.mlp_bias:
            raise ValueError(
                f"{name}: mlp_bias with a gated MLP (mlp_gated=True) is not built; biases go with "
                "the plain MLP (mlp_gated=False: w_in, w_out)"
            )
        types = self.layer_types
        if types is not None:
            if not isinstance(types, tuple) or len(types) != self.n_layer:
                raise ValueError(
                    f"{name}: layer_types must be a tuple of n_layer={self.n_layer} entries, "
                    f"got {types!r}"
                )
            bad = sorted({t for t in types if t not in LAYER_TYPES})
            if bad:
                raise ValueError(f"{name}: layer_types has {bad}; each is one of {LAYER_TYPES}")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError(
                    f"{name}: layer_types has sliding layers but sliding_window is None; give it"
                )
        nope = self.nope_layers
        if not isinstance(nope, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layer for i in nope
        ):
            raise ValueError(
                f"{name}: nope_layers must be a tuple of layer indices in [0, {self.n_layer}), "
                f"got {nope!r}"
            )

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each query and key head rotate (GPT-NeoX: a quarter)."""
        assert self.head_dim is not None  # resolved by __post_init__
        return int(self.head_dim * self.rotary_fraction)

    def window_at(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: it attends to everything before it)."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def cache_window(self) -> int | None:
        """The window every layer slides by (so the engine may give back the KV blocks before
        it); None where some layer attends to everything."""
        if self.layer_types is None or set(self.layer_types) == {"sliding_attention"}:
            return self.sliding_window
        return None

    @property
    def cache_regime(self) -> int | None:
        """The length past which a sequence is computed otherwise (LongRoPE: its long factors,
        from ``rope_original_max_seq_len`` tokens on), for the engine (see
        :class:`colfunc.models.KVCacheSpec`); None for the other rope types."""
        return self.rope_scaling.original_max_position if self.rope_type == "longrope" else None

    @property
    def per_layer(self) -> bool:
        """Whether the layers differ (windows, rotary bases, no rotary positions, dense MLPs
        between sparse ones), so that each needs its index."""
        mixed = self.layer_types is not None and len(set(self.layer_types)) > 1
        return (
            mixed
            or bool(self.nope_layers or self.dense_layers)
            or self.rope_local_theta is not None
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
        """The rotary frequencies' scaling (``rope_type``: one of
        :data:`colfunc.nn.ROPE_TYPES`; ``rope_original_max_seq_len=None`` means
        ``max_seq_len``)."""
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
            short_factor=self.rope_short_factor,
            long_factor=self.rope_long_factor,
        )

    @classmethod
    def tiny(cls) -> Config:
        """Byte-level, 4 layers, width 128, 4 query heads sharing 2 key/value heads, context 128."""
        return cls(vocab_size=256, n_layer=4, n_head=4, n_kv_heads=2, d_model=128, max_seq_len=128)

    @classmethod
    def small(cls) -> Config:
        """Byte-level, 6 layers, width 384, 6 query heads sharing 2 key/value heads, context 256."""
        return cls(vocab_size=256, n_layer=6, n_head=6, n_kv_heads=2, d_model=384, max_seq_len=256)
