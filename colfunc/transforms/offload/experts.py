"""A layer's experts homed in host memory and fetched when routed to (see
:mod:`colfunc.transforms.offload`).

The expert weights (a layered loss's ``expert_dims``, stacked ``[L, E, ...]``) are chunked one
expert at a time (:mod:`colfunc.memory.chunks`). A layer's fetch brings everything but them;
the model sees each as a :class:`~colfunc.ops.moe.RoutedExperts`, and :func:`colfunc.ops.moe_ffn`
hands the routing to :meth:`Experts.run`, which fetches only the experts the tokens are routed to
and runs them as one compact mixture (``ops.moe.compact``). Its backward pass fetches them again,
computes their gradients, and writes each expert's home; the experts no token chose get none
(zero, as on one device). Nothing of theirs is kept on the device between the passes.

Under expert parallelism (the experts split over ``ep``, each rank holding its experts whole)
the same goes for this rank's experts: the tokens are exchanged as the ``moe_ffn`` rule
exchanges them (:mod:`colfunc.sharding.rules.moe`), and only the local experts that rows
arrive for are fetched, in both passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from colfunc import torch_private, tree
from colfunc.ops import moe
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import Partial, Replicate, Shard
from colfunc.sharding.rules import moe as ep
from colfunc.sharding.tensor import ShardedTensor, from_local
from colfunc.transforms.offload.state import OffloadState

if TYPE_CHECKING:
    from colfunc.transforms.offload.streaming import Streaming

__all__ = ["Experts", "routed_leaves"]


def routed_leaves(
    loss_fn: Any, params: Any, templates: list[Any], gathers: bool, experts: str = "routed"
) -> frozenset[int]:
    """The flat indices of the expert weights to fetch when routed to (``experts="routed"``):
    those the loss names in its ``expert_dims`` (on dim 1, after the layers) whose experts this
    rank holds whole (at most split over experts, by an expert axis: not by a tensor-parallel
    one, nor cut by ZeRO-3); none otherwise (a layer's experts then come with it)."""
    dims = dict(getattr(loss_fn, "expert_dims", None) or {})
    if not dims or gathers or experts != "routed":
        return frozenset()
    paths = [p for p, _ in tree.flatten_with_paths(params)[0]]
    return frozenset(
        k
        for k, p in enumerate(paths)
        if dims.get(p) == 1
        and (
            templates[k] is None
            or all(q in (Replicate(), Shard(1)) for q in templates[k].placements)
        )
    )


def expert_split(template: Any) -> tuple[tuple[str, ...], Mesh] | None:
    """The mesh axes a routed expert leaf's experts are split over, and its mesh (None: whole)."""
    if template is None:
        return None
    axes = tuple(a for a, q in zip(template.mesh.axis_names, template.placements) if q == Shard(1))
    return (axes, template.mesh) if axes else None


class Experts:
    """Layer ``group - 1``'s routed expert weights, as the model's
    :class:`~colfunc.ops.moe.RoutedExperts` stand-ins reach them."""

    def __init__(self, frame: Streaming, group: int) -> None:
        self.frame, self.group = frame, group
        state = frame.state
        self.chunks = state.layout.expert_chunks(group)
        # (axes, mesh) the experts are split over (expert parallelism), the same for every leaf
        self.split = expert_split(state.templates[min(state.routed)]) if state.routed else None

    def stand_in(self, k: int, row: torch.Tensor) -> moe.RoutedExperts:
        """Leaf ``k``'s stand-in (``row``: its host row of this layer, ``[E, ...]``, or this
        rank's experts of it under expert parallelism; the stand-in has the whole's shape)."""
        dtype = self.frame.pool.compute if self.frame.pool.compute is not None else row.dtype
        template = self.frame.state.templates[k]
        shape = tuple(row.shape) if template is None else tuple(template.shape[1:])
        return moe.RoutedExperts(self, k, shape, dtype, self.frame.pool.device)

    def weights(self, experts: list[int], leaves: list[int]) -> list[torch.Tensor]:
        """The listed experts' weights of ``leaves``, fetched, each stacked ``[n, ...]``."""
        state: OffloadState = self.frame.state
        if not experts:  # (a rank no row came to, under expert parallelism)
            return self._none(leaves)
        chunks = [c for e in experts for c in self.chunks[e]]
        bufs = self.frame.pool.require_experts(chunks)
        views: dict[tuple[int, int], torch.Tensor] = {}
        for c in chunks:
            for p in state.layout.chunks[c].pieces:
                assert p.expert is not None
                views[(p.leaf, p.expert)] = bufs[c][p.offset : p.offset + p.numel].view(p.shape)
        return [torch.stack([views[(k, e)] for e in experts]) for k in leaves]

    def _none(self, leaves: list[int]) -> list[torch.Tensor]:
        """No expert's weights of ``leaves``: each ``[0, ...]``."""
        layout, pool = self.frame.state.layout, self.frame.pool
        of = {p.leaf: (p.shape, layout.chunks[c].dtype)
              for cs in self.chunks.values() for c in cs for p in layout.chunks[c].pieces}  # fmt: skip
        return [
            torch.empty((0, *of[k][0]), dtype=pool.compute or of[k][1], device=pool.device)
            for k in leaves
        ]

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
        if self.split is not None:
            return self._run_split(x_ND, topi_NK, topw_NK, capacity, weights)
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

    def _run_split(
        self, x_ND: torch.Tensor, topi_NK: torch.Tensor, topw_NK: torch.Tensor, capacity: float,
        weights: tuple[moe.RoutedExperts, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:meth:`run` with the experts split over an expert axis: the tokens' rows exchanged as
        the ``moe_ffn`` rule exchanges them, and only the local experts rows came for fetched."""
        assert self.split is not None
        if isinstance(x_ND, ShardedTensor):  # the tokens split over data-parallel axes as well
            return _on_local(self._run_split, x_ND, topi_NK, topw_NK, capacity, weights)
        axes, mesh = self.split
        leaves, E = [w.leaf for w in weights], weights[0].shape[0]
        if x_ND.device.type == "meta":  # a dry run routes nowhere: every local expert, the most
            wg, wu, wd = self.weights(sorted(self.chunks), leaves)
            y, *_ = torch.ops.colfunc.moe_ffn(x_ND, topi_NK % wg.shape[0], topw_NK, wg, wu, wd)
            return y, topi_NK.new_zeros(E)
        picks, tokens, _, counts = moe.routed(topi_NK, E, capacity)
        ex = ep.Exchange(counts, axes, mesh)  # (the counts exchanged: which local experts run)
        experts = [e for e, size in enumerate(ex.sizes) if size]
        token = self.frame.token
        if token is not None and torch.is_grad_enabled():
            y, _ = _RoutedSplit.apply(
                self, ex, experts, leaves, x_ND, topw_NK, picks, tokens, token
            )
        else:
            wg, wu, wd = self.weights(experts, leaves)
            sizes = [ex.sizes[e] for e in experts]
            y, _ = ep.exchanged_forward(ex, x_ND, topw_NK, picks, tokens, (wg, wu, wd), sizes)
        return y, counts

    def write_grads(self, experts: list[int], leaves: list[int], dws: list[torch.Tensor]) -> None:
        """Each trained chunk of ``experts`` gets its pieces' rows of ``dws`` (per leaf of
        ``leaves``, stacked ``[len(experts), ...]``) as its gradient, and is done."""
        state = self.frame.state
        position = {e: j for j, e in enumerate(experts)}
        trained = self.trained(experts)
        if dws:  # (none: no gradient reached the layer's output)
            at = dict(zip(leaves, dws, strict=True))
            for c in trained:
                grads = tuple(  # (an expert chunk's pieces all have their expert)
                    at[p.leaf][position[cast(int, p.expert)]]
                    if p.leaf in at and state.trains[p.leaf]
                    else None
                    for p in state.layout.chunks[c].pieces
                )
                state.write_grad(c, grads)
        for _ in trained:
            self.frame.chunk_done(self.group)

    def count_pending(self, experts: list[int]) -> None:
        """The trained chunks of ``experts`` wait for their gradients (a forward pass, not
        remat's recomputation, which its forward counted)."""
        if not torch_private.in_backward():
            frame, group = self.frame, self.group
            frame.pending[group] = frame.pending.get(group, 0) + len(self.trained(experts))


def _on_local(
    run: Any, x_ND: ShardedTensor, topi_NK: torch.Tensor, topw_NK: torch.Tensor, capacity: float,
    weights: tuple[moe.RoutedExperts, ...],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``run`` on this rank's tokens of sharded ones (split on the token dim, or whole): the
    output as ``x`` is placed, the counts summed over the ranks that split the tokens."""
    pl = x_ND.placements
    if any(q not in (Replicate(), Shard(0)) for q in pl):
        raise ValueError(
            f"offload: experts fetched when routed to take tokens split on their first dim or "
            f"whole, got placements {pl}; use offload(..., experts='layer')"
        )
    local = [t.to_local() if isinstance(t, ShardedTensor) else t for t in (x_ND, topi_NK, topw_NK)]
    y, counts = run(*local, capacity, weights)
    summed = [Partial() if q == Shard(0) else Replicate() for q in pl]
    return (
        from_local(y, x_ND.mesh, pl, tuple(x_ND.shape)),
        from_local(counts, x_ND.mesh, summed, tuple(counts.shape)),
    )


class _RoutedSplit(torch.autograd.Function):
    """:class:`_Routed` under expert parallelism: the rows exchanged over the expert axes and
    run by this rank's routed experts in both passes."""

    @staticmethod
    def forward(
        layer: Experts, ex: ep.Exchange, experts: list[int], leaves: list[int], x: torch.Tensor,
        topw: torch.Tensor, picks: torch.Tensor, tokens: torch.Tensor, token: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        wg, wu, wd = layer.weights(experts, leaves)
        sizes = [ex.sizes[e] for e in experts]
        return ep.exchanged_forward(ex, x, topw, picks, tokens, (wg, wu, wd), sizes)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layer, ex, experts, leaves, x, topw, picks, tokens, _ = inputs
        ctx.layer, ctx.ex, ctx.experts, ctx.leaves = layer, ex, experts, leaves
        ctx.save_for_backward(x, topw, picks, tokens, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        layer.count_pending(experts)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, *unused: Any) -> tuple[Any, ...]:
        layer: Experts = ctx.layer
        x, topw, picks, tokens, o_M = ctx.saved_tensors
        dx = dtopw = None
        if dy is not None:  # (every rank's exchange runs: each has the layer's output gradient)
            wg, wu, wd = layer.weights(ctx.experts, ctx.leaves)
            sizes = [ctx.ex.sizes[e] for e in ctx.experts]
            dx, dtopw, *dws = ep.exchanged_backward(
                ctx.ex, dy, x, topw, picks, tokens, o_M, (wg, wu, wd), sizes
            )
        else:
            dws = []
        layer.write_grads(ctx.experts, ctx.leaves, dws)
        return None, None, None, None, dx, dtopw, None, None, None


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
        layer.count_pending(experts)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, *unused: Any) -> tuple[Any, ...]:
        layer: Experts = ctx.layer
        x, topi, topw, a, b, o = ctx.saved_tensors
        dx = dtopw = None
        dws: list[torch.Tensor] = []
        if dy is not None:
            ws = layer.weights(ctx.experts, ctx.leaves)
            dx, dtopw, *dws = torch.ops.colfunc.moe_ffn_backward(
                dy, x, topi, topw, *ws, a, b, o, ctx.cap
            )
        layer.write_grads(ctx.experts, ctx.leaves, dws)
        return None, None, None, None, dx, None, dtopw, None
