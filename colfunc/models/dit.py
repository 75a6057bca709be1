"""A spatial-temporal diffusion transformer (Open-Sora's STDiT) as a pure function over a pytree.

A video ``[B, C, F, H, W]`` is cut into patches of ``(1, p, p)`` (``S = H/p * W/p`` tokens per
frame, ``N = F * S`` in all) with fixed sin-cos positions: 2-D per patch, and the frame's. Each block runs, each
modulated adaLN-zero style by the timestep embedding (shift, scale and a gate that starts at zero):

1. spatial self-attention over the ``S`` tokens of each frame,
2. temporal self-attention over the ``F`` frames of each patch position, with rotary positions,
3. cross-attention from every token to the condition tokens (a caption's words, unmodulated),
4. an MLP.

A final adaLN layer maps each token back to its patch (zero-initialised), and the model predicts
the rectified-flow velocity (:mod:`colfunc.diffusion`). The blocks are stacked on a leading layer
axis and run by ``scan_layers``; the carry is ``{"x": tokens [B, N, D], "c": timestep embedding
[B, D], "y": condition tokens [B, L, D]}``, so pipeline stages pass the conditioning on with the
tokens.

Legend: B batch, C channels, F frames, H, W height and width, p patch size, S tokens per frame,
N = F*S tokens, D width, L condition tokens, E head dim, Q = C*p*p values per patch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

from colfunc import diffusion, nn, ops, random
from colfunc.core import Layered, P, layered, scan_layers
from colfunc.models.family import Family

__all__ = [
    "Config",
    "apply",
    "example_batch",
    "family",
    "init",
    "loss",
    "param_shapes",
    "patchify",
    "tp_plan",
    "unpatchify",
]

Params = dict[str, Any]
Carry = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """STDiT sizes and the video shape it takes. ``vocab_size`` counts the condition words, with
    id 0 the empty condition (classifier-free guidance's unconditional branch)."""

    channels: int = 3
    frames: int = 4
    size: int = 16
    patch: int = 2
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    vocab_size: int = 16
    cond_len: int = 3
    d_freq: int = 64
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        names = (
            "channels", "frames", "size", "patch", "n_layer", "n_head", "d_model",
            "vocab_size", "cond_len", "d_freq",
        )  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"dit.Config: {name} must be a positive int, got {value!r}")
        if self.size % self.patch:
            raise ValueError(
                f"dit.Config: patch={self.patch} must divide size={self.size} (the frame's side)"
            )
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"dit.Config: d_model={self.d_model} must split into n_head={self.n_head} heads "
                "of an even head dim (rotary positions rotate pairs)"
            )
        if self.d_freq % 2:
            raise ValueError(f"dit.Config: d_freq must be even, got {self.d_freq}")

    @classmethod
    def tiny(cls) -> Config:
        """4 frames of 16 x 16 RGB in 2 x 2 patches (256 tokens), 4 layers of width 64."""
        return cls()

    @property
    def tokens_per_frame(self) -> int:
        return (self.size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch * self.patch

    @property
    def video_shape(self) -> tuple[int, int, int, int]:
        """``(C, F, H, W)`` of one clip."""
        return (self.channels, self.frames, self.size, self.size)


# Megatron's layout per attention and MLP: q/k/v and the MLP input column-parallel, the output
# projections row-parallel; the modulation, the embeddings and the final layer stay whole.
tp_plan: dict[str, P] = {
    **{
        f"blocks.{a}.{w}": P(None, None, "tp")
        for a in ("s_attn", "t_attn", "x_attn")
        for w in ("wq", "wk", "wv")
    },
    **{
        f"blocks.{a}.{b}": P(None, "tp")
        for a in ("s_attn", "t_attn", "x_attn")
        for b in ("bq", "bk", "bv")
    },
    **{f"blocks.{a}.wo": P(None, "tp", None) for a in ("s_attn", "t_attn", "x_attn")},
    "blocks.mlp.w_in": P(None, None, "tp"),
    "blocks.mlp.b_in": P(None, "tp"),
    "blocks.mlp.w_out": P(None, "tp", None),
}


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, by dotted path (in the order of :func:`init`)."""
    L, D, Q = cfg.n_layer, cfg.d_model, cfg.patch_dim
    shapes: dict[str, tuple[int, ...]] = {
        "patch.weight": (Q, D),
        "patch.bias": (D,),
        "t_embed.w_in": (cfg.d_freq, D),
        "t_embed.b_in": (D,),
        "t_embed.w_out": (D, D),
        "t_embed.b_out": (D,),
        "y_embed.words": (cfg.vocab_size, D),
        "y_embed.positions": (cfg.cond_len, D),
        "blocks.ada.weight": (L, D, 9 * D),
        "blocks.ada.bias": (L, 9 * D),
    }
    for a in ("s_attn", "t_attn", "x_attn"):
        for w in ("wq", "wk", "wv", "wo"):
            shapes[f"blocks.{a}.{w}"] = (L, D, D)
        for b in ("bq", "bk", "bv", "bo"):
            shapes[f"blocks.{a}.{b}"] = (L, D)
    shapes |= {
        "blocks.mlp.w_in": (L, D, 4 * D),
        "blocks.mlp.b_in": (L, 4 * D),
        "blocks.mlp.w_out": (L, 4 * D, D),
        "blocks.mlp.b_out": (L, D),
        "final.ada.weight": (D, 2 * D),
        "final.ada.bias": (2 * D,),
        "final.out.weight": (D, Q),
        "final.out.bias": (Q,),
    }
    return shapes


_ZERO = {"blocks.ada.weight", "final.out.weight"}  # adaLN-zero: every block starts as identity
_STD = {"y_embed.words": 1.0}  # the caption as loud as the positions (see init)


def init(cfg: Config, seed: int = 0, *, abstract: bool = False) -> Params:
    """Fresh fp32 parameters; each value depends only on ``(seed, path)``.

    Weights N(0, 0.02), biases 0; the blocks' modulation and the output projection 0 (adaLN-zero:
    each block starts as the identity and the model predicts zero velocity). The condition
    words' embeddings are N(0, 1), the scale of the fixed sin-cos positions the tokens carry
    (``nn.Embedding``'s default): at 0.02 the caption reached the tokens so faintly that after the
    example config's 2500 steps the model had learned each caption's axis but not its sign.
    """

    def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
        leaf = path.rsplit(".", 1)[-1]
        if path in _ZERO or leaf in ("bias", "bq", "bk", "bv", "bo", "b_in", "b_out"):
            return torch.zeros(shape)
        return random.normal(seed, path, shape, _STD.get(path, 0.02))

    if abstract:
        return nn.nest(
            {
                p: random.abstract(s, functools.partial(value, p, s))
                for p, s in param_shapes(cfg).items()
            }
        )
    return nn.nest({p: value(p, s) for p, s in param_shapes(cfg).items()})


# --- patches and positions ------------------------------------------------------------------


def patchify(video_BCFHW: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``[B, C, F, H, W] -> [B, N, Q]``: frame-major tokens, each a ``(C, p, p)`` patch."""
    B, C, Fr, H, W = video_BCFHW.shape
    p = cfg.patch
    x = video_BCFHW.reshape(B, C, Fr, H // p, p, W // p, p)
    x = x.permute(0, 2, 3, 5, 1, 4, 6)  # B, F, H/p, W/p, C, p, p
    return x.reshape(B, Fr * (H // p) * (W // p), C * p * p)


def unpatchify(tokens_BNQ: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``[B, N, Q] -> [B, C, F, H, W]``."""
    B = tokens_BNQ.shape[0]
    C, Fr, H, W = cfg.video_shape
    p = cfg.patch
    x = tokens_BNQ.reshape(B, Fr, H // p, W // p, C, p, p)
    x = x.permute(0, 4, 1, 2, 5, 3, 6)  # B, C, F, H/p, p, W/p, p
    return x.reshape(B, C, Fr, H, W)


def _sincos(n: int, dim: int, device: Any) -> torch.Tensor:
    """``[n, dim]`` sin-cos embedding of positions ``0..n-1`` (half sines, half cosines)."""
    freq = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=device) / (dim // 2))
    angle = torch.arange(n, device=device).float()[:, None] * freq[None]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


def spatial_positions(cfg: Config, device: Any = None) -> torch.Tensor:
    """``[S, D]`` fixed 2-D sin-cos positions of a frame's patches (rows, then columns)."""
    g, D = cfg.size // cfg.patch, cfg.d_model
    rows = _sincos(g, D // 2, device)[:, None].expand(g, g, D // 2)
    cols = _sincos(g, D // 2, device)[None, :].expand(g, g, D // 2)
    return torch.cat([rows, cols], dim=-1).reshape(g * g, D)


def timestep_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    """``[B, dim]`` sin-cos features of ``1000 t`` (DiT's frequency embedding of the timestep)."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=t_B.device) / half)
    angle = 1000.0 * t_B.float()[:, None] * freq[None]
    return torch.cat([angle.cos(), angle.sin()], dim=1)


# --- the network ------------------------------------------------------------------------------


def _attention(
    x_BTD: torch.Tensor,
    p: Params,
    head_dim: int,
    *,
    context_BSD: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Bidirectional multi-head attention of ``x`` over itself or over ``context``."""
    ctx = x_BTD if context_BSD is None else context_BSD
    q = nn.split_heads(nn.linear(x_BTD, p["wq"], p["bq"]), head_dim)
    k = nn.split_heads(nn.linear(ctx, p["wk"], p["bk"]), head_dim)
    v = nn.split_heads(nn.linear(ctx, p["wv"], p["bv"]), head_dim)
    if rope is not None:
        q, k = ops.rope(q, *rope), ops.rope(k, *rope)
    y = ops.attention(q, k, v, causal=False)
    return nn.linear(nn.merge_heads(y), p["wo"], p["bo"])


def _modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    return ops.layer_norm(x, None, None, eps) * (1 + scale) + shift


def _block(layer: Params, carry: Carry, cfg: Config) -> Carry:
    x_BND, c_BD, y_BLD = carry["x"], carry["c"], carry["y"]
    B, N, D = x_BND.shape
    Fr, S, E, eps = cfg.frames, cfg.tokens_per_frame, D // cfg.n_head, cfg.norm_eps
    mod = nn.linear(F.silu(c_BD), layer["ada"]["weight"], layer["ada"]["bias"])
    shift1, scale1, gate1, shift2, scale2, gate2, shift3, scale3, gate3 = (
        m[:, None] for m in mod.chunk(9, dim=-1)
    )
    # spatial: the S tokens of each frame attend to each other
    h = _modulate(x_BND, shift1, scale1, eps).reshape(B * Fr, S, D)
    h = _attention(h, layer["s_attn"], E).reshape(B, N, D)
    x_BND = x_BND + gate1 * h
    # temporal: each patch position's F frames attend to each other, with rotary positions
    h = _modulate(x_BND, shift2, scale2, eps).reshape(B, Fr, S, D).transpose(1, 2)
    rope = nn.rope_tables(Fr, E, cfg.rope_theta, x_BND.device)
    h = _attention(h.reshape(B * S, Fr, D), layer["t_attn"], E, rope=rope)
    h = h.reshape(B, S, Fr, D).transpose(1, 2).reshape(B, N, D)
    x_BND = x_BND + gate2 * h
    # cross: every token reads the condition tokens
    x_BND = x_BND + _attention(x_BND, layer["x_attn"], E, context_BSD=y_BLD)
    h = _modulate(x_BND, shift3, scale3, eps)
    x_BND = x_BND + gate3 * nn.mlp(h, layer["mlp"], nn.gelu_tanh)
    return {"x": x_BND, "c": c_BD, "y": y_BLD}


def _check_batch(video: Any, t: Any, cond: Any, cfg: Config) -> None:
    if not isinstance(video, torch.Tensor) or tuple(video.shape[1:]) != cfg.video_shape:
        got = tuple(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(
            f"dit: a video batch is [B, C, F, H, W] = [B, {', '.join(map(str, cfg.video_shape))}] "
            f"for this config, got {got}"
        )
    B = video.shape[0]
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B,):
        raise ValueError(f"dit: t must be a tensor [B] = [{B}] of times in [0, 1], got {t!r}")
    if (
        not isinstance(cond, torch.Tensor)
        or cond.dtype != torch.long
        or tuple(cond.shape) != (B, cfg.cond_len)
    ):
        shown = (cond.dtype, tuple(cond.shape)) if isinstance(cond, torch.Tensor) else cond
        raise ValueError(
            f"dit: cond must be a LongTensor [B, cond_len] = [{B}, {cfg.cond_len}] of word ids "
            f"(0: none), got {shown}"
        )
    if (
        type(cond) is torch.Tensor
        and cond.numel()
        and not (int(cond.min()) >= 0 and int(cond.max()) < cfg.vocab_size)
    ):
        raise ValueError(
            f"dit: cond holds a word id outside [0, vocab_size={cfg.vocab_size}); check the "
            "captions' vocabulary against the model"
        )


def _carry(
    params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, cfg: Config
) -> Carry:
    _check_batch(x_t, t, cond, cfg)
    tokens = nn.linear(patchify(x_t, cfg), params["patch"]["weight"], params["patch"]["bias"])
    pos = spatial_positions(cfg, x_t.device).to(tokens.dtype)[None]  # [1, S, D]
    when = _sincos(cfg.frames, cfg.d_model, x_t.device).to(tokens.dtype)[:, None]  # [F, 1, D]
    B, N, D = tokens.shape
    x = (tokens.reshape(B, cfg.frames, -1, D) + pos + when).reshape(B, N, D)
    te = params["t_embed"]
    freq = timestep_embedding(t, cfg.d_freq).to(tokens.dtype)
    c = nn.linear(F.silu(nn.linear(freq, te["w_in"], te["b_in"])), te["w_out"], te["b_out"])
    y = nn.embedding(cond, params["y_embed"]["words"]) + params["y_embed"]["positions"]
    # the pooled caption joins the timestep in the modulation (DiT's class conditioning), besides
    # the per-token cross-attention
    return {"x": x, "c": c + y.mean(dim=1), "y": y}


def _velocity(params: Params, carry: Carry, cfg: Config) -> torch.Tensor:
    """The final adaLN layer: the predicted velocity per patch, ``[B, N, Q]``."""
    fin = params["final"]
    mod = nn.linear(F.silu(carry["c"]), fin["ada"]["weight"], fin["ada"]["bias"])
    shift, scale = (m[:, None] for m in mod.chunk(2, dim=-1))
    h = _modulate(carry["x"], shift, scale, cfg.norm_eps)
    return nn.linear(h, fin["out"]["weight"], fin["out"]["bias"])


def apply(
    params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, cfg: Config
) -> torch.Tensor:
    """The predicted velocity ``[B, C, F, H, W]`` of the noisy videos ``x_t`` at times ``t [B]``
    under the condition word ids ``cond [B, L]`` (0: none)."""
    carry = _carry(params, x_t, t, cond, cfg)
    carry = scan_layers(lambda layer, c: _block(layer, c, cfg), carry, params["blocks"])
    return unpatchify(_velocity(params, carry, cfg), cfg)


def loss(cfg: Config) -> Layered:
    """``loss_fn(params, {"video", "noise", "t", "cond"})``: the rectified-flow loss.

    ``x_t = (1 - t) video + t noise``; the model predicts the velocity ``noise - video`` and the
    loss is its mean squared error (:func:`colfunc.diffusion.flow_loss`). The noise, the times and
    the (sometimes dropped) conditions come in the batch, so the step is a pure function of it and
    every transform splits them with the videos.
    """

    def pre(params: Params, batch: Any) -> Carry:
        video = nn.batch_field(batch, "video")
        noise, t = nn.batch_field(batch, "noise"), nn.batch_field(batch, "t")
        if not isinstance(noise, torch.Tensor) or noise.shape != video.shape:
            raise ValueError("dit: the batch's noise must have the video's shape")
        x_t = diffusion.interpolate(video, noise, t)
        return _carry(params, x_t, t, nn.batch_field(batch, "cond"), cfg)

    def block(layer: Params, carry: Carry) -> Carry:
        return _block(layer, carry, cfg)

    def post(params: Params, carry: Carry, batch: Any) -> torch.Tensor:
        target = patchify(diffusion.velocity(batch["video"], batch["noise"]), cfg)
        return diffusion.flow_loss(_velocity(params, carry, cfg), target)

    divisors = {"n_head": cfg.n_head}
    return layered(pre, block, post, name="dit", divisors=divisors, sequence_dims={"x": 1})


def example_batch(cfg: Config, batch_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic training batch: moving shapes (:mod:`colfunc.data.video`), their captions'
    word ids, Gaussian noise and logit-normal times, all a function of ``seed``."""
    from colfunc.data import video

    return video.training_batch(cfg, batch_size, seed, step=0)


# the family: no Hugging Face side, and no KV cache (a denoiser is not served token by token)
family = Family(name="dit", module=sys.modules[__name__], config=Config)
