"""Working on this rank's local pieces of distributed tensors, and adding up their norms.

Optimizers are elementwise, so updating each rank's piece of a tensor-parallel parameter (or
its ZeRO chunk) is updating the whole; only the global gradient norm needs the other ranks.
``shard``, ``zero`` and the pipeline share these helpers.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, ShardedTensor, comm
from colfunc.sharding.placement import Shard
from colfunc.step import TrainState, Update

__all__ = [
    "as_full",
    "axes_reduction",
    "in_placement",
    "like",
    "local_piece",
    "local_update",
    "norm_reduction",
    "rewrap",
    "sharded_axes",
    "to_local",
]

PyTree = Any


def local_piece(x: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``x`` (``x`` itself for a plain tensor)."""
    return x._local if isinstance(x, ShardedTensor) else x


def rewrap(like_: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` as a tensor distributed like ``like_`` (``piece`` itself if ``like_`` is plain)."""
    if isinstance(like_, ShardedTensor):
        return ShardedTensor(piece, like_.mesh, like_.placements, tuple(like_.shape))
    return piece


def as_full(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a plain tensor: a ShardedTensor gathered whole (a tensor-parallel loss is
    replicated, so this moves nothing), a plain tensor as it is."""
    return x.full_tensor() if isinstance(x, ShardedTensor) else x


def to_local(t: PyTree) -> PyTree:
    """Every tensor leaf of ``t`` replaced by its local piece."""
    return tree.map(lambda x: local_piece(x) if isinstance(x, torch.Tensor) else x, t)


def like(template: PyTree, pieces: PyTree) -> PyTree:
    """``pieces``' leaves wrapped back with the metadata of ``template``'s sharded leaves."""
    return tree.map(
        lambda t, x: rewrap(t, x) if isinstance(t, ShardedTensor) else x, template, pieces
    )


def in_placement(g: Any, p: Any) -> Any:
    """The gradient ``g`` in its parameter ``p``'s placements (a rule may leave one Partial)."""
    if (
        isinstance(p, ShardedTensor)
        and isinstance(g, ShardedTensor)
        and g.placements != p.placements
    ):
        return g.redistribute(p.placements)
    return g


def sharded_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes over which ``x`` is split (empty for a plain or replicated tensor)."""
    if not isinstance(x, ShardedTensor):
        return ()
    return tuple(a for a, pl in zip(x.mesh.axis_names, x.placements) if isinstance(pl, Shard))


def axes_reduction(axes: list[tuple[str, ...]], mesh: Mesh) -> core.NormReduction:
    """Squared norms of local pieces, each summed over the axes that partition its tensor.

    ``axes[i]`` names the mesh axes over which leaf ``i`` is split (empty: replicated, counted
    once). Leaves split the same way are added up first, so there is one all_reduce per kind.
    """

    def reduce(squares: list[torch.Tensor]) -> torch.Tensor:
        groups: dict[tuple[str, ...], torch.Tensor] = {}
        for ax, sq in zip(axes, squares):
            groups[ax] = groups[ax] + sq if ax in groups else sq
        total = torch.zeros((), dtype=squares[0].dtype)
        for ax in sorted(groups):  # the same order on every rank
            part = groups[ax]
            total = total + (comm.all_reduce(part, ax, mesh=mesh) if ax else part)
        return total

    return core.NormReduction(reduce)


def norm_reduction(grads: PyTree, mesh: Mesh) -> core.NormReduction:
    """How the local squared norms of ``grads``' leaves add up to the global squared norm."""
    return axes_reduction([sharded_axes(g) for g in tree.tensors(grads)], mesh)


def local_update(update: Update, mesh: Mesh) -> Update:
    """Run an update piece on the local shards of sharded parameters, states and gradients."""

    def run(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        local_state = state._replace(
            params=to_local(state.params), opt_state=to_local(state.opt_state)
        )
        with core.context(norm_reduction(grads, mesh)):
            new, info = update(to_local(grads), local_state)
        new = new._replace(
            params=like(state.params, new.params), opt_state=like(state.opt_state, new.opt_state)
        )
        return new, info

    return run
