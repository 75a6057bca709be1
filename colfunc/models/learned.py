"""The decoder GPT-2 and OPT share: learned positions, pre-LayerNorm blocks with biases on every
projection, a plain MLP, a head tied to the token embedding. What differs is data: the MLP's
activation and the offset of the position table (OPT's 2). :mod:`colfunc.models.gpt` and
:mod:`colfunc.models.opt` each hold a :class:`LearnedPositions` and their own sizes, plans and
Hugging Face side.

Legend: L layers, B batch, T sequence, D width (d_model), V vocabulary, E head dim, N packed
tokens, R selected rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from colfunc import nn, ops, random
from colfunc.core import Layered, layered, positions, scan_layers
from colfunc.models.family import make_params, positive_number

__all__ = ["LearnedPositions", "Sizes"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The sizes of a GPT-2-shaped model (each family's ``Config`` subclasses it and names
    itself in ``family_name``). ``d_ff=None`` means ``4 * d_model``."""

    family_name: ClassVar[str] = "learned"

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq_len: int = 128
    d_ff: int | None = None
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        name = f"{self.family_name}.Config"
        if self.d_ff is None and isinstance(self.d_model, int):
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: {field} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"{name}: n_head={self.n_head} must divide d_model={self.d_model}")
        if not positive_number(self.norm_eps):
            raise ValueError(f"{name}: norm_eps must be > 0, got {self.norm_eps!r}")

    @classmethod
    def tiny(cls) -> Any:
        """Byte-level, 4 layers, width 128, 4 heads, context 128 (GPT-2's: the default model to
        train)."""
        return cls(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128)

    @classmethod
    def small(cls) -> Any:
        """Byte-level, 6 layers, width 384, 6 heads, context 256."""
        return cls(vocab_size=256, n_layer=6, n_head=6, d_model=384, max_seq_len=256)


_NORM_WEIGHTS = {"blocks.ln1.weight", "blocks.ln2.weight", "final_norm.weight"}
_RESIDUAL_OUT = {"blocks.attn.wo", "blocks.mlp.w_out"}


def _is_bias(path: str) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf in {"bq", "bk", "bv", "bo", "b_in", "b_out"}


@dataclasses.dataclass(frozen=True)
class LearnedPositions:
    """GPT-2's computation, with ``activation`` in the MLP and the positions read ``offset``
    rows into their table. Every method takes the family's ``cfg`` (``vocab_size``,
    ``n_layer``, ``n_head``, ``d_model``, ``max_seq_len``, ``norm_eps``)."""

    name: str
    activation: Callable[[torch.Tensor], torch.Tensor]
    offset: int = 0

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter, by dotted path (in the order of :meth:`init`); the
        position table holds ``max_seq_len + offset`` rows."""
        L, D, V, F = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_ff
        layer = {
            "ln1.weight": (D,), "ln1.bias": (D,),
            "attn.wq": (D, D), "attn.wk": (D, D), "attn.wv": (D, D), "attn.wo": (D, D),
            "attn.bq": (D,), "attn.bk": (D,), "attn.bv": (D,), "attn.bo": (D,),
            "ln2.weight": (D,), "ln2.bias": (D,),
            "mlp.w_in": (D, F), "mlp.b_in": (F,), "mlp.w_out": (F, D), "mlp.b_out": (D,),
        }  # fmt: skip
        return {
            "embed.tokens": (V, D),
            "embed.positions": (cfg.max_seq_len + self.offset, D),
            **{f"blocks.{p}": (L, *shape) for p, shape in layer.items()},
            "final_norm.weight": (D,),
            "final_norm.bias": (D,),
        }

    def init(self, cfg: Any, seed: int = 0, *, abstract: bool = False) -> Params:
        """Fresh fp32 parameters; each value depends only on ``(seed, path)``.

        ``abstract=True``: :class:`colfunc.random.Abstract` leaves, described but not made, for
        a step that makes each where it belongs (``step.init``; see ``zero`` and ``offload``).

        GPT-2 initialisation: weights N(0, 0.02), the projections that write into the residual
        stream N(0, 0.02 / sqrt(2 * n_layer)) (two per layer, so the stream's variance stays
        bounded with depth), biases 0, norm weights 1."""
        std_out = 0.02 / math.sqrt(2 * cfg.n_layer)

        def value(path: str, shape: tuple[int, ...]) -> torch.Tensor:
            if path in _NORM_WEIGHTS:
                return torch.ones(shape)
            if _is_bias(path):
                return torch.zeros(shape)
            return random.normal(seed, path, shape, std_out if path in _RESIDUAL_OUT else 0.02)

        return make_params(self.param_shapes(cfg), value, abstract)

    def embed(self, params: Params, input_ids_BT: torch.Tensor, cfg: Any) -> torch.Tensor:
        nn.check_input_ids(input_ids_BT, cfg.max_seq_len, cfg.vocab_size)
        pos_T = positions(input_ids_BT.shape[1], input_ids_BT.device) + self.offset
        tok_BTD = nn.embedding(input_ids_BT, params["embed"]["tokens"])
        return tok_BTD + nn.embedding(pos_T, params["embed"]["positions"])

    def block_kv(
        self, layer: Params, x_BTD: torch.Tensor, cfg: Any, paged: nn.Paged | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """One block; with ``paged`` its attention reads the KV cache, and it also returns this
        layer's new keys and values."""
        E = cfg.d_model // cfg.n_head
        ln1, ln2 = layer["ln1"], layer["ln2"]
        h_BTD = ops.layer_norm(x_BTD, ln1["weight"], ln1["bias"], cfg.norm_eps)
        a_BTD, kv = nn.attend(h_BTD, layer["attn"], head_dim=E, paged=paged)
        x_BTD = x_BTD + a_BTD
        h_BTD = ops.layer_norm(x_BTD, ln2["weight"], ln2["bias"], cfg.norm_eps)
        return x_BTD + nn.mlp(h_BTD, layer["mlp"], self.activation), kv

    def logits(self, params: Params, x_BTD: torch.Tensor, cfg: Any) -> torch.Tensor:
        norm = params["final_norm"]
        h_BTD = ops.layer_norm(x_BTD, norm["weight"], norm["bias"], cfg.norm_eps)
        return nn.unembed(h_BTD, params["embed"]["tokens"])

    def apply(self, params: Params, input_ids: torch.Tensor, cfg: Any) -> torch.Tensor:
        """Logits ``[B, T, V]`` for ``input_ids[B, T]`` (fp32 for fp32 params)."""
        x_BTD = self.embed(params, input_ids, cfg)
        block = lambda layer, x: self.block_kv(layer, x, cfg, None)[0]  # noqa: E731
        return self.logits(params, scan_layers(block, x_BTD, params["blocks"]), cfg)

    def paged_forward(
        self,
        params: Params,
        tokens_N: torch.Tensor,
        batch: nn.PagedBatch,
        cache: dict[str, torch.Tensor],
        cfg: Any,
        select_R: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits ``[R, V]`` at the packed rows ``select`` of a batch of sequences' new tokens,
        whose earlier tokens are in the paged KV cache ``cache`` (``{"k", "v"}``,
        ``[L, C, B, K, E]``, scanned as per-layer ``xs``), and the new tokens' keys and values
        (``[L, N, K, E]``, the scan's ``ys``) for the caller to write into the cache."""
        positions_N = batch.token_positions() + self.offset
        x_1ND = nn.embedding(tokens_N, params["embed"]["tokens"])[None]
        x_1ND = x_1ND + nn.embedding(positions_N, params["embed"]["positions"])[None]
        block = lambda layer, x, paged: self.block_kv(layer, x, cfg, paged)  # noqa: E731
        x_1ND, ys = nn.paged_scan(block, x_1ND, params["blocks"], cache, batch)
        return self.logits(params, x_1ND[:, select_R], cfg)[0], ys

    def loss(self, cfg: Any) -> Layered:
        """``loss_fn(params, {"input_ids", "labels"})``: mean next-token cross-entropy, ``-100``
        ignored: the same computation as :meth:`apply` followed by the shifted cross-entropy, in
        the ``layered(pre, block, post)`` form that ``pipeline`` cuts into stages."""

        def pre(params: Params, batch: Any) -> torch.Tensor:
            return self.embed(params, nn.batch_field(batch, "input_ids"), cfg)

        def block(layer: Params, x_BTD: torch.Tensor) -> torch.Tensor:
            return self.block_kv(layer, x_BTD, cfg, None)[0]

        def post(params: Params, x_BTD: torch.Tensor, batch: Any) -> torch.Tensor:
            head = lambda h: self.logits(params, h, cfg)  # noqa: E731
            return nn.causal_lm_loss(head, x_BTD, nn.batch_field(batch, "labels"))

        # whole heads per rank: the attention splits by head (any vocabulary splits, unevenly)
        divisors = {"n_head": cfg.n_head}
        return layered(pre, block, post, name=self.name, divisors=divisors)
