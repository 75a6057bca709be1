"""An offloaded step's update: ZeRO 1-2's chunks of the masters and moments (their gradients
reduce-scattered by the data-parallel reduction), and AdamW on the host (the C++ CPU Adam) and
on device-homed chunks (see :mod:`colfunc.transforms.offload`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from colfunc import ops, torch_private, tree
from colfunc.memory.pool import DevicePool
from colfunc.optim.adam import AdamState
from colfunc.optim.base import learning_rate
from colfunc.sharding import Mesh
from colfunc.step import TrainState
from colfunc.transforms.data_parallel.chunks import cut_chunk, mesh_axes
from colfunc.transforms.local import (
    axes_reduction,
    local_piece,
    sharded_axes,
    to_local,
)
from colfunc.transforms.offload.state import OffloadState, offload_state

if TYPE_CHECKING:
    from colfunc.transforms.data_parallel import Reduction, ZeroLayout

PyTree = Any


def as_meta_tree(params: PyTree) -> PyTree:
    """``params`` as meta tensors (shapes and dtypes, nothing made)."""
    return tree.map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, params
    )


def zero_update(
    state: TrainState, dp: Reduction, hyper: Any, inner_update: Any
) -> tuple[TrainState, dict[str, Any]]:
    """ZeRO 1-2 under offload: the whole host gradients reduce-scattered, so each rank holds
    the averaged chunks it owns; the CPU Adam updates those chunks of the masters with this
    rank's chunks of the moments, and the new chunks are all-gathered into the host replicas
    (in place: the pool reads them). Another optimizer runs zero's own update, on the host."""
    off, z = offload_state(state.extra), state.extra["zero"]
    n, i = z.mesh.axis_size(z.axis), z.mesh.axis_index(z.axis)
    # the trainable leaves (all of them, unless some are frozen: those are not reduced)
    trained = off.trained_grads()
    flat, treedef = tree.flatten_with_paths(trained)
    host = [g for _, g in flat]
    params = dict(tree.flatten_with_paths(state.params)[0])
    metas = z.metas_of(trained)
    with DevicePool.host(), torch.no_grad():
        stacked = [m.stacked for m in tree.leaves(metas)]
        experts = None
        if dp.experts:  # expert weights reduced apart
            flag = dict(zip(off.paths, dp.expert_flags(off.templates)))
            experts = [flag[path] for path, _ in flat]
        grads = dp.scatter_rows(host, stacked, experts)  # the data-parallel reduction, on host rows
        if hyper is None:
            new_state, info = inner_update(tree.unflatten(treedef, grads), state)
            return local_state(new_state), info
        opt = state.opt_state
        if not isinstance(opt, AdamState):
            raise TypeError(
                f"offload: expected the AdamState of optim.adamw, got {type(opt).__name__}"
            )
        chunks = [cut_chunk(params[path], n, i, st)[0] for (path, _), st in zip(flat, stacked)]
        t, lr = opt.step + 1, learning_rate(hyper.lr, opt.step)
        squares = [g.double().square().sum() for g in grads]
        axes = norm_axes(off, z, None)
        if axes is not None and off.frozen:  # the trainable leaves' axes, as their squares
            trains = [k for k, t in enumerate(off.trains) if t]
            axes = ([axes[0][k] for k in trains], axes[1])
        norm = _reduced_norm(squares, axes)
        _host_adamw(
            chunks, grads, tree.leaves(opt.exp_avg), tree.leaves(opt.exp_avg_sq), hyper.at(t, lr)
        )
        new = tree.leaves(z.gather_chunks(tree.unflatten(treedef, chunks), metas))
        for (path, _), y in zip(flat, new, strict=True):
            params[path].copy_(local_piece(y))  # (a tensor-parallel piece comes back wrapped)
    new_opt = AdamState(t, opt.exp_avg, opt.exp_avg_sq, None)
    return state._replace(opt_state=new_opt), {"grad_norm": norm, "lr": lr}


def _host_adamw(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    h: ops.AdamWHyper,
) -> None:
    """AdamW on host tensors, in place: the C++ CPU Adam for fp32 masters, torch's fused kernel
    for fp64 ones (the C++ Adam is fp32)."""
    if not ps:
        return
    if all(x.dtype == torch.float32 for x in ps):
        ops.cpu_adamw_(ps, gs, ms, vs, h)
        return
    steps = [torch.tensor(float(h.step))] * len(ps)  # read only by the kernel
    torch_private.fused_adamw_(
        ps,
        gs,
        ms,
        vs,
        [],
        steps,
        amsgrad=False,
        maximize=False,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        eps=h.eps,
        weight_decay=h.weight_decay,
    )


NormAxes = tuple[list[tuple[str, ...]], Mesh] | None


def norm_axes(off: OffloadState, z: ZeroLayout | None, tp: Mesh | None) -> NormAxes:
    """Per leaf, the mesh axes over which its pieces partition it (None: every rank holds the
    whole of every leaf): a ZeRO-3 chunk's axis and its tensor-parallel axes, or those alone."""
    if z is not None:
        metas = tree.leaves(z.metas)
        return [mesh_axes(z.mesh, {z.axis, *sharded_axes(m.template)}) for m in metas], z.mesh
    if tp is not None:
        return [sharded_axes(t) if t is not None else () for t in off.templates], tp
    return None


def _reduced_norm(squares: list[torch.Tensor], axes: NormAxes) -> torch.Tensor:
    """The global norm from per-leaf squared norms of this rank's pieces."""
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    if axes is None:
        total = torch.stack(squares).sum()
    else:
        total = axes_reduction(*axes).reduce(squares)
    return total.sqrt().to(torch.float32)


def _grad_norm(off: OffloadState, axes: NormAxes) -> torch.Tensor:
    """The global gradient norm, from this rank's gradients where they live (host rows,
    device-homed mirrors), in fp64."""
    groups: dict[bool, tuple[list[torch.Tensor], list[int]]] = {False: ([], []), True: ([], [])}
    for chunk in off.layout.chunks:
        mirror = off.pool.mirrors.get(chunk.index)
        parts, leaves = groups[mirror is not None]
        for p in chunk.pieces:
            if not off.trains[p.leaf]:
                continue
            g = (
                off._row(off.grads, p)
                if mirror is None
                else mirror.grad[p.offset : p.offset + p.numel]
            )
            parts.append(g)
            leaves.append(p.leaf)
    squares = [torch.zeros((), dtype=torch.float64) for _ in off.templates]
    for parts, leaves in groups.values():
        if parts:
            norms = torch_private.foreach_norm(parts, 2.0, dtype=torch.float64)
            for k, n in zip(leaves, norms):
                squares[k] = squares[k] + n.cpu().square()
    return _reduced_norm(squares, axes)


def adamw_update(
    off: OffloadState, hyper: Any, state: TrainState, axes: NormAxes = None
) -> tuple[TrainState, dict[str, Any]]:
    """AdamW where each chunk lives: host chunks by the CPU Adam, mirrors by the fused one.
    ``axes``: how this rank's pieces add up to the global gradient norm (ZeRO-3 chunks,
    tensor-parallel pieces)."""
    opt = state.opt_state
    if not isinstance(opt, AdamState):
        raise TypeError(f"offload: expected the AdamState of optim.adamw, got {type(opt).__name__}")
    ps = tree.leaves(state.params)
    ms, vs = off.by_leaf(opt.exp_avg), off.by_leaf(opt.exp_avg_sq)  # (None for a frozen leaf)
    off._host = (ps, ms, vs)
    t, lr = opt.step + 1, learning_rate(hyper.lr, opt.step)
    h = hyper.at(t, lr)
    mirrors = off.pool.mirrors
    for c in sorted(off._needs_moments):  # moments of chunks just device-homed
        m = mirrors[c]
        for p in off.layout.chunks[c].pieces:
            for flat, host in ((m.exp_avg, ms), (m.exp_avg_sq, vs)):
                flat[p.offset : p.offset + p.numel].view(p.shape).copy_(off._row(host, p))
        off.pool.h2d += 2 * off.layout.chunks[c].used * m.exp_avg.element_size()
    off._needs_moments.clear()
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for chunk in off.layout.chunks:
        if chunk.index in mirrors:
            continue
        for p in chunk.pieces:
            if not off.trains[p.leaf]:
                continue  # frozen: no gradient, no state, no update
            for out, src in zip(lists, (ps, off.grads, ms, vs)):
                out.append(off._row(src, p))
    with DevicePool.host():
        norm = _grad_norm(off, axes)
        _host_adamw(lists[0], lists[1], lists[2], lists[3], h)
    if mirrors:
        order = sorted(mirrors)
        ops.adamw_(
            [mirrors[c].param for c in order],
            [mirrors[c].grad for c in order],
            [mirrors[c].exp_avg for c in order],
            [mirrors[c].exp_avg_sq for c in order],
            h,
        )
    new_opt = AdamState(t, opt.exp_avg, opt.exp_avg_sq, None)
    return state._replace(opt_state=new_opt), {"grad_norm": norm, "lr": lr}


def local_state(state: TrainState) -> TrainState:
    """``state`` with its parameters and optimizer states as this rank's local pieces (an
    inner update may hand back tensor-parallel tensors)."""
    return state._replace(params=to_local(state.params), opt_state=to_local(state.opt_state))
