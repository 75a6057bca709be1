"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each
token's ``k`` experts, each a SwiGLU MLP, and the token's output is their outputs weighted by the
router; Qwen2-MoE adds a shared expert every token runs, scaled by a sigmoid gate of its own.

Parameters (colfunc's ``[in, out]`` layout): ``router [D, E]``; ``experts.w_gate``,
``experts.w_up`` ``[E, D, F]`` and ``experts.w_down`` ``[E, F, D]``; with a shared expert
``shared.w_gate``, ``shared.w_up`` ``[D, S]``, ``shared.w_down`` ``[S, D]`` and ``shared_gate``
``[D, 1]``. The experts run in :func:`colfunc.ops.moe_ffn`.

Legend: B batch, T sequence, N = B * T tokens, D width, E experts, K experts per token,
F expert width, S shared expert width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from colfunc import core, ops
from colfunc.nn.dense import linear
from colfunc.nn.feedforward import gated

__all__ = ["Routing", "load_balancing_loss", "route", "sparse_mlp"]


class Routing(NamedTuple):
    """One MoE layer's routing: each token's experts ``topi[N, K]`` and weights ``topw[N, K]``,
    and the statistics of the load-balancing loss: the fraction of tokens routed to each expert
    by each of the K choices ``tokens[K, E]`` and the mean router probability of each expert
    ``probs[E]`` (Switch Transformer's f and P), the router logits' mean squared log-sum-exp
    ``z`` (the z-loss), and once the experts have run, how many choices each ran ``counts[E]``
    (fewer than routed to it where a capacity dropped some)."""

    topi: torch.Tensor
    topw: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor
    z: torch.Tensor
    counts: torch.Tensor | None = None


def route(x_ND: torch.Tensor, router_DE: torch.Tensor, k: int, norm_topk_prob: bool) -> Routing:
    """The router: softmax of ``x @ router`` (in fp32, or fp64 for fp64 inputs), the ``k``
    largest probabilities per token, renormalized to sum to 1 when ``norm_topk_prob``. A router
    that takes the top-k logits first and then their softmax computes these renormalized
    weights: ``p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j)``."""
    E = router_DE.shape[-1]
    logits_NE = linear(x_ND, router_DE)
    dtype = torch.float64 if logits_NE.dtype == torch.float64 else torch.float32
    probs_NE = torch.softmax(logits_NE.to(dtype), dim=-1)
    with torch.no_grad():
        topi_NK = torch.topk(probs_NE, k, dim=-1).indices
        hit_NKE = (topi_NK[..., None] == torch.arange(E, device=topi_NK.device)).to(dtype)
    # the chosen probabilities, differentiable (a masked sum: no gather across split tokens)
    topw_NK = (probs_NE[:, None, :] * hit_NKE).sum(-1)
    if norm_topk_prob:
        topw_NK = topw_NK / topw_NK.sum(-1, keepdim=True)
    z = torch.logsumexp(logits_NE.to(dtype), dim=-1).pow(2).mean()
    return Routing(topi_NK, topw_NK, hit_NKE.mean(0), probs_NE.mean(0), z)


def load_balancing_loss(tokens_KE: torch.Tensor, probs_E: torch.Tensor) -> torch.Tensor:
    """The auxiliary loss that keeps the experts evenly loaded (Switch Transformer; Mixtral's
    and ``transformers``' form): ``E * sum(f * P)`` over the choices and the experts."""
    E = probs_E.shape[-1]
    return (tokens_KE * probs_E[None, :]).sum() * E


def sparse_mlp(
    h_BTD: torch.Tensor,
    p: dict[str, Any],
    k: int,
    norm_topk_prob: bool,
    capacity_factor: float | None = None,
) -> tuple[torch.Tensor, Routing]:
    """The sparse MLP of ``h`` (its parameters ``p``, see the module docstring), and its
    routing, with how many choices each expert ran (``counts``). ``capacity_factor``: each
    expert runs at most ``ceil(capacity_factor * N * k / E)`` of the ``N`` tokens' choices (see
    :func:`colfunc.ops.moe_ffn`); None: dropless."""
    B, T, D = h_BTD.shape
    x_ND = h_BTD.reshape(B * T, D)
    r = route(x_ND, p["router"], k, norm_topk_prob)
    ex = p["experts"]
    y_ND, counts = ops.moe_ffn(
        x_ND, r.topi, r.topw, ex["w_gate"], ex["w_up"], ex["w_down"], capacity_factor
    )
    r = r._replace(counts=counts)
    core.sow("expert_counts", counts)  # (the step's metrics: each expert's choices, per layer)
    if "shared" in p:  # Qwen2-MoE: an expert every token runs, behind a sigmoid gate
        gate_N1 = torch.sigmoid(linear(x_ND, p["shared_gate"]))
        y_ND = y_ND + gate_N1 * gated(x_ND, p["shared"], torch.nn.functional.silu)
    return y_ND.reshape(B, T, D), r
