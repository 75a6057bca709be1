"""Multi-head self-attention (also over a paged KV cache) and rotary position tables.

Legend: B batch, T sequence, D width, H query heads, K key/value heads, E head dim, R rotary
frequencies (E/2), N packed tokens of several sequences, C cache blocks, S sequences,
M blocks per sequence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from colfunc import ops
from colfunc.core import positions, scan_layers
from colfunc.nn.dense import linear
from colfunc.ops import PagedBatch  # the op layer's value, which the models pass on

__all__ = [
    "ROPE_TYPES",
    "AttentionOptions",
    "Paged",
    "PagedBatch",
    "RopeScaling",
    "attend",
    "merge_heads",
    "paged_scan",
    "paged_self_attention",
    "rope_tables",
    "rotate",
    "self_attention",
    "split_heads",
]


class Paged(NamedTuple):
    """One layer's paged KV cache (``[C, B slots, K, E]`` each), the batch that reads it, and
    the layer's index (for models whose layers differ)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: PagedBatch
    layer: int = 0


def split_heads(x_BTD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, T, H*E] -> [B, H, T, E]``; the head count is inferred, so a shard of heads works too."""
    B, T, _ = x_BTD.shape
    return x_BTD.view(B, T, -1, head_dim).transpose(1, 2)


def merge_heads(x_BHTE: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, E] -> [B, T, H*E]``, the inverse of :func:`split_heads`."""
    B, _, T, _ = x_BHTE.shape
    return x_BHTE.transpose(1, 2).reshape(B, T, -1)


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How the rotary frequencies are stretched past the context a model was trained on.

    - ``"default"``: none;
    - ``"linear"``: every frequency divided by ``factor`` (position interpolation, Chen et al.
      2023);
    - ``"llama3"``: Llama 3.1's: wavelengths shorter than ``original_max_position /
      high_freq_factor`` kept, longer than ``original_max_position / low_freq_factor`` divided
      by ``factor``, the ones between interpolated smoothly.
    - ``"yarn"``: YaRN (Peng et al. 2023; Qwen 2.5's long context): frequencies that turn more
      than ``beta_fast`` times over ``original_max_position`` kept, fewer than ``beta_slow``
      times divided by ``factor``, a linear ramp between (its bounds rounded out unless
      ``truncate=False``); the tables multiplied by ``attention_factor`` (None: ``0.1 ln(factor)
      + 1``, or the ratio of the ``mscale`` and ``mscale_all_dim`` forms where both are given).
    - ``"dynamic"``: dynamic NTK, which changes the base only for sequences longer than the
      model's context; colfunc's models take no longer ones, so its frequencies are the default.
    - ``"longrope"``: LongRoPE (Phi-3's long context): each frequency divided by its entry of
      ``short_factor`` while the sequence is at most ``original_max_position`` long, of
      ``long_factor`` past it (:func:`rope_tables`' ``context``); the tables multiplied by
      ``attention_factor`` (None: ``sqrt(1 + ln(factor) / ln(original_max_position))``).
    """

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"RopeScaling: type={self.type!r} is not built; the built types are "
                f"{', '.join(ROPE_TYPES)}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"RopeScaling: {name} must be > 0, got {value!r}")
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise ValueError(f"RopeScaling: {name} must be None or > 0, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RopeScaling: truncate must be a bool, got {self.truncate!r}")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor!r} and {self.low_freq_factor!r}"
            )
        if self.type == "longrope":
            for name in ("short_factor", "long_factor"):
                value = getattr(self, name)
                if (
                    not isinstance(value, tuple)
                    or not value
                    or not all(
                        isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                        for v in value
                    )
                ):
                    raise ValueError(
                        f"RopeScaling: longrope needs {name} as a tuple of numbers > 0 (one per "
                        f"rotary frequency), got {value!r}"
                    )
        value = self.original_max_position
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"RopeScaling: original_max_position must be a positive int, got {value!r}"
            )

    @property
    def table_factor(self) -> float:
        """What the cos and sin tables are multiplied by (YaRN's and LongRoPE's attention
        factor; else 1)."""
        if self.type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position))
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    def yarn(self, pos_freq_R: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
        """YaRN's frequencies from ``theta ** (2r / E)`` (the operations of the
        ``transformers`` reference, so that the tables agree with it)."""
        dim, old = head_dim, self.original_max_position

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # (no zero-width ramp)
        ramp = torch.arange(dim // 2, dtype=torch.float32, device=pos_freq_R.device)
        extrapolation = 1 - torch.clamp((ramp - low) / (high - low), 0, 1)
        inv_interpolation = 1.0 / (self.factor * pos_freq_R)
        inv_extrapolation = 1.0 / pos_freq_R
        return inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation

    def scale(self, inv_freq_R: torch.Tensor) -> torch.Tensor:
        """The frequencies ``inv_freq_R`` as this scaling changes them (the operations of the
        ``transformers`` reference, so that the tables agree with it). YaRN's need the base and
        the head dim: :meth:`yarn`."""
        if self.type in ("default", "dynamic"):
            return inv_freq_R
        if self.type == "yarn":
            raise ValueError("RopeScaling.scale: yarn's frequencies come from RopeScaling.yarn")
        if self.type == "linear":
            return inv_freq_R / self.factor
        old_context = self.original_max_position
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen_R = 2 * math.pi / inv_freq_R
        scaled_R = torch.where(wavelen_R > low_freq_wavelen, inv_freq_R / self.factor, inv_freq_R)
        smooth_R = (old_context / wavelen_R - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed_R = (1 - smooth_R) * scaled_R / self.factor + smooth_R * scaled_R
        medium_R = ~(wavelen_R < high_freq_wavelen) * ~(wavelen_R > low_freq_wavelen)
        return torch.where(medium_R, smoothed_R, scaled_R)


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
    context: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos[T, R], sin[T, R])`` for rotary embeddings (Su et al. 2021), fp32.

    Frequency ``r`` is ``theta ** (-2r / E)``, changed by ``scaling`` where given; the
    operations and their order are those of the LLaMA reference so that the tables agree bit
    for bit. ``context``: the sequence length a length-dependent scaling reads (LongRoPE's
    choice of factors; None: ``seq_len``), where the tables cover more positions than the
    sequences hold (the engine's, for every position of the context).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    exponent_R = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    if scaling is not None and scaling.type == "longrope":
        assert scaling.short_factor is not None and scaling.long_factor is not None
        long = (context or seq_len) > scaling.original_max_position
        factors = scaling.long_factor if long else scaling.short_factor
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"rope_tables: longrope has {len(factors)} factors for {head_dim // 2} rotary "
                "frequencies (head_dim / 2)"
            )
        ext_R = torch.tensor(factors, dtype=torch.float32, device=device)
        inv_freq_R = 1.0 / (ext_R * theta**exponent_R)
    elif scaling is not None and scaling.type == "yarn":
        inv_freq_R = scaling.yarn(theta**exponent_R, head_dim, theta)
    else:
        inv_freq_R = 1.0 / (theta**exponent_R)
        if scaling is not None:
            inv_freq_R = scaling.scale(inv_freq_R)
    # the positions a sequence dim holds (arange, unless a sequence-parallel frame reorders it)
    angle_TR = positions(seq_len, device).float()[:, None] * inv_freq_R[None, :]
    factor = scaling.table_factor if scaling is not None else 1.0
    if factor != 1.0:
        return angle_TR.cos() * factor, angle_TR.sin() * factor
    return angle_TR.cos(), angle_TR.sin()


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """What a block's attention varies by, beyond its weights.

    ``norm_eps``: the q/k norms' epsilon, where the weights have them (``q_norm``, ``k_norm``);
    ``qk_norm``: ``"head"`` normalizes each query and key head over its head dim (weights
    ``[E]``, Qwen 3, Gemma 3), ``"all"`` the whole projection over all its heads (weights
    ``[H*E]`` and ``[K*E]``, OLMo 2); ``norm_offset``: the norms scale by ``offset + weight``
    (Gemma's ``1 + w``); ``window``: a sliding window; ``scale``: the softmax scale (None:
    ``1/sqrt(E)``); ``softcap``: the scores soft-capped (Gemma 2)."""

    norm_eps: float = 1e-6
    qk_norm: str = "head"
    norm_offset: float = 0.0
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None


_PLAIN = AttentionOptions()


def _norm(x: torch.Tensor, w: torch.Tensor, o: AttentionOptions) -> torch.Tensor:
    return ops.rms_norm(x, w + o.norm_offset if o.norm_offset else w, o.norm_eps)


def _qkv(
    x: torch.Tensor, p: dict[str, torch.Tensor], head_dim: int, o: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values ``[..., T, H|K, E]`` (heads before the head dim), normalized as
    ``o`` says where ``p`` has q/k norm weights."""
    q, k, v = (linear(x, p[f"w{n}"], p.get(f"b{n}")) for n in "qkv")
    normed = "q_norm" in p
    if normed and o.qk_norm == "all":
        q, k = _norm(q, p["q_norm"], o), _norm(k, p["k_norm"], o)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    if normed and o.qk_norm == "head":
        q, k = _norm(q, p["q_norm"], o), _norm(k, p["k_norm"], o)
    return q, k, v


def rotate(x_BHTE: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """:func:`colfunc.ops.rope` of the head dims the tables cover (``2 R``): all of them, or the
    leading ones with the rest passed through (a partial rotary embedding, GPT-NeoX's)."""
    R2 = 2 * cos_TR.shape[-1]
    if x_BHTE.shape[-1] == R2:
        return ops.rope(x_BHTE, cos_TR, sin_TR)
    rot = ops.rope(x_BHTE[..., :R2], cos_TR, sin_TR)
    return torch.cat([rot, x_BHTE[..., R2:]], dim=-1)


def self_attention(
    x_BTD: torch.Tensor,
    p: dict[str, torch.Tensor],
    *,
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_eps: float = 1e-6,
    window: int | None = None,
    options: AttentionOptions | None = None,
) -> torch.Tensor:
    """Causal multi-head (or grouped-query) self-attention.

    ``p`` holds ``wq[D, H*E]``, ``wk, wv[D, K*E]``, ``wo[H*E, D]`` and optionally the biases
    ``bq, bk, bv, bo`` and the RMS norm weights ``q_norm, k_norm`` (see
    :class:`AttentionOptions`: each query and key head normalized, with ``norm_eps``, before the
    rotation). Query heads share key/value heads in contiguous groups of ``H / K``. ``rope`` is
    ``(cos[T, R], sin[T, R])`` from :func:`rope_tables`, applied to q and k. ``window``:
    sliding-window attention (each token sees its last ``window`` tokens, itself included);
    ``options`` (which then holds the window and the epsilon) the other variations.
    """
    o = options or dataclasses.replace(_PLAIN, norm_eps=norm_eps, window=window)
    q_BTHE, k_BTKE, v_BTKE = _qkv(x_BTD, p, head_dim, o)
    q_BHTE, k_BKTE, v_BKTE = (t.transpose(1, 2) for t in (q_BTHE, k_BTKE, v_BTKE))
    if rope is not None:
        q_BHTE, k_BKTE = rotate(q_BHTE, *rope), rotate(k_BKTE, *rope)
    y_BHTE = ops.attention(
        q_BHTE, k_BKTE, v_BKTE, causal=True, scale=o.scale, window=o.window, softcap=o.softcap
    )
    return linear(merge_heads(y_BHTE), p["wo"], p.get("bo"))


def paged_self_attention(
    x_1ND: torch.Tensor,
    p: dict[str, torch.Tensor],
    *,
    head_dim: int,
    paged: Paged,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_eps: float = 1e-6,
    window: int | None = None,
    options: AttentionOptions | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`self_attention` of a packed batch whose earlier tokens are in a paged KV cache.

    ``x`` holds the ``N`` new tokens of every sequence (``[1, N, D]``); ``rope`` is ``(cos, sin)``
    at their positions (``[N, R]``). Returns the output and the new tokens' ``(k[N, K, E],
    v[N, K, E])`` (rotated), which the caller writes into the cache after the layer. A softmax
    ``scale`` other than ``1/sqrt(E)`` is folded into the queries.
    """
    o = options or dataclasses.replace(_PLAIN, norm_eps=norm_eps, window=window)
    N = x_1ND.shape[1]
    q_1NHE, k_1NKE, v_1NKE = _qkv(x_1ND, p, head_dim, o)
    q_NHE, k_NKE, v_NKE = q_1NHE[0], k_1NKE[0], v_1NKE[0]
    if rope is not None:
        q_NHE = rotate(q_NHE.transpose(0, 1), *rope).transpose(0, 1)
        k_NKE = rotate(k_NKE.transpose(0, 1), *rope).transpose(0, 1)
    if o.scale is not None:  # the paged op scales by 1/sqrt(E)
        q_NHE = q_NHE * (o.scale * math.sqrt(head_dim))
    y_NHE = ops.paged_attention(
        q_NHE,
        k_NKE,
        v_NKE,
        paged.k_cache,
        paged.v_cache,
        paged.batch,
        window=o.window,
        softcap=o.softcap,
    )
    return linear(y_NHE.reshape(1, N, -1), p["wo"], p.get("bo")), (k_NKE, v_NKE)


def attend(
    x_BTD: torch.Tensor,
    p: dict[str, torch.Tensor],
    *,
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    paged: Paged | None = None,
    norm_eps: float = 1e-6,
    window: int | None = None,
    options: AttentionOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """A block's attention: :func:`self_attention` (and None), or with ``paged``
    :func:`paged_self_attention` and this layer's new ``{"k", "v"}``. ``norm_eps``: the q/k
    norms' epsilon, where ``p`` has them; ``window``: a sliding window; ``options`` (instead
    of those two) every variation of :class:`AttentionOptions`."""
    o = options or dataclasses.replace(_PLAIN, norm_eps=norm_eps, window=window)
    if paged is None:
        return self_attention(x_BTD, p, head_dim=head_dim, rope=rope, options=o), None
    y, (k, v) = paged_self_attention(x_BTD, p, head_dim=head_dim, paged=paged, rope=rope, options=o)
    return y, {"k": k, "v": v}


def paged_scan(
    block_kv: Callable[[Any, Any, Paged], tuple[Any, Any]],
    carry: Any,
    blocks: Any,
    cache: dict[str, torch.Tensor],
    batch: PagedBatch,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``scan_layers`` of ``block_kv(layer, carry, paged)`` with each layer's slice of the paged
    cache (``{"k", "v"}``, ``[L, C, B, K, E]``) as its ``x``; returns the carry and the new keys
    and values, stacked per layer (``[L, N, K, E]``), for the caller to write into the cache."""

    def block(layer: Any, c: Any, x: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        return block_kv(layer, c, Paged(x["k"], x["v"], batch, int(x["layer"])))

    first = next(iter(cache.values()))
    xs = {**cache, "layer": torch.arange(first.shape[0])}
    out: tuple[Any, dict[str, torch.Tensor]] = scan_layers(block, carry, blocks, xs=xs)
    return out
