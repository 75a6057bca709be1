"""A layer's experts homed in host memory and fetched when routed to (see
:mod:`colfunc.transforms.offload`).

The expert weights (a layered loss's ``expert_dims``, stacked ``[L, E, ...]``) are chunked one
expert at a time (:mod:`colfunc.memory.chunks`). A layer's fetch brings everything but them;
the model sees each as a :class:`~colfunc.ops.moe.RoutedExperts`, and :func:`colfunc.ops.moe_ffn`
hands the routing to :meth:`Experts.run`, which fetches only the experts the tokens are routed to
and runs them as one compact mixture (``ops.moe.compact``). Its backward pass fetches them again,
computes their gradients, and writes each expert's home; the experts no token chose get none
(zero, as on one device). Nothing of theirs is kept on the device between the passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from colfunc import torch_private, tree
from colfunc.ops import moe
from colfunc.transforms.offload.state import OffloadState

if TYPE_CHECKING:
    from colfunc.transforms.offload.streaming import Streaming

__all__ = ["Experts", "routed_leaves"]


def routed_leaves(
    loss_fn: Any, params: Any, templates: list[Any], gathers: bool, experts: str = "routed"
) -> frozenset[int]:
    """The flat indices of the expert weights to fetch when routed to (``experts="routed"``):
    those the loss names in its ``expert_dims`` (on dim 1, after the layers), each held whole by
    this rank (not split by a tensor-parallel or expert axis, nor cut by ZeRO-3); none
    otherwise (a layer's experts then come with it)."""
    dims = dict(getattr(loss_fn, "expert_dims", None) or {})
    if not dims or gathers or experts != "routed":
        return frozenset()
    paths = [p for p, _ in tree.flatten_with_paths(params)[0]]
    return frozenset(k for k, p in enumerate(paths) if dims.get(p) == 1 and templates[k] is None)


class Experts:
    """Layer ``group - 1``'s routed expert weights, as the model's
    :class:`~colfunc.ops.moe.RoutedExperts` stand-ins reach them."""

    def __init__(self, frame: Streaming, group: int) -> None:
        self.frame, self.group = frame, group
        self.chunks = frame.state.layout.expert_chunks(group)

    def stand_in(self, k: int, row: torch.Tensor) -> moe.RoutedExperts:
        """Leaf ``k``'s stand-in (``row``: its host row ``[E, ...]`` of this layer)."""
        dtype = self.frame.pool.compute if self.frame.pool.compute is not None else row.dtype
        return moe.RoutedExperts(self, k, tuple(row.shape), dtype, self.frame.pool.device)

    def weights(self, experts: list[int], leaves: list[int]) -> list[torch.Tensor]:
        """The listed experts' weights of ``leaves``, fetched, each stacked ``[n, ...]``."""
        state: OffloadState = self.frame.state
        chunks = [c for e in experts for c in self.chunks[e]]
        bufs = self.frame.pool.require_experts(chunks)
        views: dict[tuple[int, int], torch.Tensor] = {}
        for c in chunks:
            for p in state.layout.chunks[c].pieces:
                assert p.expert is not None
                views[(p.leaf, p.expert)] = bufs[c][p.offset : p.offset + p.numel].view(p.shape)
        return [torch.stack([views[(k, e)] for e in experts]) for k in leaves]

    def trained(self, experts: list[int]) -> list[int]:
        """The chunks of ``experts`` whose fetch has a backward (a trainable piece)."""
        state = self.frame.state
        return [c for e in experts for c in self.chunks[e] if state.chunk_trains(c)]

    def run(
        self,
        x_ND: torch.Tensor,
        topi_NK: torch.Tensor,
        topw_NK: torch.Tensor,
        capacity: float,
        weights: tuple[moe.RoutedExperts, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`colfunc.ops.moe_ffn` of the routed experts only: the output and each of the
        ``E`` experts' count of choices."""
        E = weights[0].shape[0]
        if x_ND.device.type == "meta":  # a dry run routes nowhere: every expert, the most
            used, topi_c, cap = torch.arange(E, device="meta"), topi_NK, capacity
            experts = list(range(E))
        else:
            used, topi_c, cap = moe.compact(topi_NK, E, capacity)
            experts = used.tolist()
        leaves = [w.leaf for w in weights]
        token = self.frame.token
        if token is not None and torch.is_grad_enabled():
            y, counts_c, *_ = _Routed.apply(
                self, experts, leaves, cap, x_ND, topi_c, topw_NK, token
            )
        else:
            wg, wu, wd = self.weights(experts, leaves)
            y, *_, counts_c = torch.ops.colfunc.moe_ffn(x_ND, topi_c, topw_NK, wg, wu, wd, cap)
        if len(experts) == E:
            return y, counts_c
        counts = torch.zeros(E, dtype=counts_c.dtype, device=counts_c.device)
        return y, counts.index_copy_(0, used.to(counts.device), counts_c)


class _Routed(torch.autograd.Function):
    """The routed experts' mixture: the forward pass fetches them and keeps only the
    activations; the backward pass fetches them again, and writes their gradients home."""

    @staticmethod
    def forward(
        layer: Experts, experts: list[int], leaves: list[int], cap: float,
        x: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor, token: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        wg, wu, wd = layer.weights(experts, leaves)
        y, a, b, o, counts = torch.ops.colfunc.moe_ffn(x, topi, topw, wg, wu, wd, cap)
        return y, counts, a, b, o

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layer, experts, leaves, cap, x, topi, topw, _ = inputs
        _, counts, a, b, o = output
        ctx.layer, ctx.experts, ctx.leaves, ctx.cap = layer, experts, leaves, cap
        ctx.save_for_backward(x, topi, topw, a, b, o)
        ctx.mark_non_differentiable(counts, a, b, o)
        ctx.set_materialize_grads(False)
        if not torch_private.in_backward():  # (remat's recomputation: counted by the forward)
            frame, group = layer.frame, layer.group
            frame.pending[group] = frame.pending.get(group, 0) + len(layer.trained(experts))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, *unused: Any) -> tuple[Any, ...]:
        layer: Experts = ctx.layer
        x, topi, topw, a, b, o = ctx.saved_tensors
        state, trained = layer.frame.state, layer.trained(ctx.experts)
        dx = dtopw = None
        if dy is not None:
            ws = layer.weights(ctx.experts, ctx.leaves)
            dx, dtopw, *dws = torch.ops.colfunc.moe_ffn_backward(
                dy, x, topi, topw, *ws, a, b, o, ctx.cap
            )
            at = dict(zip(ctx.leaves, dws, strict=True))
            position = {e: j for j, e in enumerate(ctx.experts)}
            for c in trained:
                pieces = state.layout.chunks[c].pieces
                grads = tuple(  # (an expert chunk's pieces all have their expert)
                    at[p.leaf][position[p.expert]]
                    if p.leaf in at and state.trains[p.leaf]
                    else None
                    for p in pieces
                )
                state.write_grad(c, grads)
        for _ in trained:
            layer.frame.chunk_done(layer.group)
        return None, None, None, None, dx, None, dtopw, None
