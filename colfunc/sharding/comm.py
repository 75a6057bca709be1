"""Collectives by mesh axis name, differentiable, on any backend.

Every function takes ``(x, axis, ..., mesh=None)``: ``axis`` is an axis name or a tuple of names
(the group is then ordered row-major in the tuple's order, see :class:`Mesh`), ``mesh`` defaults
to :func:`current_mesh`. Each returns a new tensor and never modifies ``x``.

Gradient convention: every rank's output is its own value, and the gradient is that of the sum
over ranks of what each rank's backward is seeded with. This is the plain loop over ranks: run
the collective on all ranks' inputs in one process, backpropagate all ranks' cotangents, read
off each rank's input gradient. The transposes follow from it:

=================================  =============================================================
forward                            backward
=================================  =============================================================
``all_reduce(sum)``                ``all_reduce(sum)`` of the grad (every output used every input)
``all_reduce(avg)``                ``all_reduce(avg)``
``all_reduce(max|min)``            the summed grad, split evenly among the ranks holding the extreme
``all_gather(dim)``                ``reduce_scatter(sum, dim)``
``reduce_scatter(sum|avg, dim)``   ``all_gather(dim)`` (divided by n for avg)
``all_to_all(split, concat)``      ``all_to_all(concat, split)``
``all_to_all_v(send, recv)``       ``all_to_all_v(recv, send)``
``ppermute(perm)``                 ``ppermute`` by the inverse permutation
``broadcast(src)``                 sum of the grads into ``src``, zeros elsewhere
``reduce(dst)``                    ``broadcast(dst)`` of the grad
=================================  =============================================================

(Megatron's identity-forward / all-reduce-backward pair is the case where the forward input is
replicated and only one rank's copy is seeded; here a replicated input is a value per rank.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from colfunc import torch_private
from colfunc.sharding.ledger import ring_bytes
from colfunc.sharding.mesh import Axes, Mesh, current_mesh
from colfunc.sharding.p2p import recv, send
from colfunc.sharding.world import Call, combine

__all__ = [
    "Pending",
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "ppermute",
    "ppermute_async",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_async",
    "send",
]

_REDUCE_OPS = ("sum", "avg", "max", "min")


def _record(mesh: Mesh, call: Call, x: torch.Tensor) -> None:
    n = len(call.group)
    led = mesh.ledger
    if led.enabled:
        index = call.group.index(mesh.rank)
        nbytes = x.numel() * x.element_size()
        if call.op == "all_to_all_v":  # the rows sent to the others, exactly
            sent = sum(c for j, c in enumerate(call.sizes[0]) if j != index)
            nbytes = sent * math.prod(x.shape[1:]) * x.element_size()
        elif call.op == "all_gather":
            nbytes *= n
        sends = True
        if call.op == "broadcast":
            sends = index != (call.root - 1) % n  # the last link of the chain sends nothing
        elif call.op == "reduce":
            sends = index != call.root
        elif call.op == "ppermute":
            sends = any(s == index != d for s, d in call.perm)
        axis: Any = call.axis[0] if len(call.axis) == 1 else call.axis
        if call.op != "all_to_all_v":
            nbytes = ring_bytes(call.op, nbytes, n, sends=sends)
        led.record(call.op, axis, nbytes)


def _world(mesh: Mesh, call: Call, x: torch.Tensor) -> Any:
    if mesh.world is None:
        raise RuntimeError(
            f"{call.describe(x)} on {mesh!r}: this mesh has no backend world; run the code under "
            "colfunc.sharding.launch(fn, mesh=...)"
        )
    return mesh.world


def _run(mesh: Mesh, call: Call, x: torch.Tensor) -> torch.Tensor:
    """Record ``call`` in the ledger, then run it on the mesh's world."""
    _record(mesh, call, x)
    if len(call.group) == 1:
        return combine(call, [x], 0)
    return _world(mesh, call, x).collective(mesh.rank, call, x)


def _prepare(x: Any, axis: Axes, mesh: Mesh | None, name: str) -> tuple[Mesh, tuple[str, ...]]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor; got {type(x).__name__}")
    mesh = mesh if mesh is not None else current_mesh()
    return mesh, mesh.axes(axis)


def _dim(x: torch.Tensor, dim: int, name: str, what: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{name}: {what}={dim!r} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def _divisible(x: torch.Tensor, dim: int, n: int, axes: tuple[str, ...], name: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{name}: x.shape[{dim}] = {x.shape[dim]} (shape {tuple(x.shape)}) is not divisible by "
            f"the size {n} of axis {axes if len(axes) > 1 else axes[0]!r}; pad it first"
        )


def _group_call(mesh: Mesh, op: str, axes: tuple[str, ...], **kw: Any) -> Call:
    return Call(op=op, axis=axes, group=mesh.group_ranks(axes), **kw)


# --- autograd functions (forward/setup_context split, so torch.func transforms work) ---------


class _Collective(torch.autograd.Function):
    @classmethod
    def apply(cls, *args: Any) -> Any:
        # The per-call cost matters next to a ~1 ms collective. Function.apply binds default
        # arguments through inspect.signature on every call (tens of microseconds); every
        # argument is passed here, so outside torch.func transforms go to the C entry point that
        # Function.apply ends in, and with nothing to differentiate skip the autograd node.
        if torch_private.are_functorch_transforms_active():
            return super().apply(*args)
        if args[0].requires_grad and torch.is_grad_enabled():
            return super(torch.autograd.Function, cls).apply(*args)  # type: ignore[misc]
        return cls.forward(*args)


class _AllReduce(_Collective):
    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], op: str) -> torch.Tensor:
        call = _group_call(mesh, "all_reduce", axes, reduce="sum" if op == "avg" else op)
        out = _run(mesh, call, x)
        return out.div_(len(call.group)) if op == "avg" else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, ctx.mesh, ctx.axes, ctx.op = inputs
        if ctx.op in ("max", "min"):
            ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op in ("sum", "avg"):
            return all_reduce(g, ctx.axes, ctx.op, ctx.mesh), None, None, None
        x, y = ctx.saved_tensors
        hit = (x == y).to(g.dtype)  # ties share the gradient evenly, as torch.amax does
        count = all_reduce(hit, ctx.axes, "sum", ctx.mesh)
        return all_reduce(g, ctx.axes, "sum", ctx.mesh) * hit / count, None, None, None


class _AllGather(_Collective):
    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        return _run(mesh, _group_call(mesh, "all_gather", axes, dim=dim), x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return reduce_scatter(g, ctx.axes, ctx.dim, "sum", ctx.mesh), None, None, None


class _ReduceScatter(_Collective):
    @staticmethod
    def forward(
        x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], dim: int, op: str
    ) -> torch.Tensor:
        call = _group_call(mesh, "reduce_scatter", axes, reduce="sum", dim=dim)
        out = _run(mesh, call, x)
        return out.div_(len(call.group)) if op == "avg" else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.dim, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gx = all_gather(g, ctx.axes, ctx.dim, ctx.mesh)
        if ctx.op == "avg":
            gx = gx / ctx.mesh.axis_size(ctx.axes)
        return gx, None, None, None, None


class _AllToAll(_Collective):
    @staticmethod
    def forward(
        x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], split_dim: int, concat_dim: int
    ) -> torch.Tensor:
        call = _group_call(mesh, "all_to_all", axes, split_dim=split_dim, concat_dim=concat_dim)
        return _run(mesh, call, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.split_dim, ctx.concat_dim = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gx = all_to_all(g, ctx.axes, ctx.concat_dim, ctx.split_dim, ctx.mesh)
        return gx, None, None, None, None


class _AllToAllV(_Collective):
    @staticmethod
    def forward(
        x: torch.Tensor,
        mesh: Mesh,
        axes: tuple[str, ...],
        send: tuple[int, ...],
        recv: tuple[int, ...],
    ) -> torch.Tensor:
        return _run(mesh, _group_call(mesh, "all_to_all_v", axes, sizes=(send, recv)), x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gx = _AllToAllV.apply(g.contiguous(), ctx.mesh, ctx.axes, ctx.recv, ctx.send)
        return gx, None, None, None, None


class _PPermute(_Collective):
    @staticmethod
    def forward(
        x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        return _run(mesh, _group_call(mesh, "ppermute", axes, perm=perm), x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.perm = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        inverse = [(d, s) for s, d in ctx.perm]
        return ppermute(g, ctx.axes, inverse, ctx.mesh), None, None, None


class _Broadcast(_Collective):
    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], src: int) -> torch.Tensor:
        return _run(mesh, _group_call(mesh, "broadcast", axes, root=src), x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.src = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _Reduce.apply(g, ctx.mesh, ctx.axes, ctx.src), None, None, None


class _Reduce(_Collective):
    """Sum into group index ``dst``; the other ranks' outputs are zeros (broadcast's transpose)."""

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], dst: int) -> torch.Tensor:
        return _run(mesh, _group_call(mesh, "reduce", axes, reduce="sum", root=dst), x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.axes, ctx.dst = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return broadcast(g, ctx.axes, ctx.dst, ctx.mesh), None, None, None


# --- the public collectives ------------------------------------------------------------------


def all_reduce(
    x: torch.Tensor, axis: Axes, op: str = "sum", mesh: Mesh | None = None
) -> torch.Tensor:
    """Reduce ``x`` over the group (``op``: ``"sum"|"avg"|"max"|"min"``); every rank gets the result.

    Sums run in group order on the threads backend, so results are deterministic.
    """
    mesh, axes = _prepare(x, axis, mesh, "all_reduce")
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {_REDUCE_OPS}; got {op!r}")
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"all_reduce: op='avg' needs a floating tensor; got dtype {x.dtype}")
    return _AllReduce.apply(x, mesh, axes, op)


class Pending:
    """A collective in flight; ``wait()`` returns its result (and the same tensor if called again)."""

    def __init__(self, work: Any, divide: int = 1) -> None:
        self._work, self._divide = work, divide
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            out = self._work.wait()
            self._result = out.div_(self._divide) if self._divide > 1 else out
            self._work = None
        return self._result


class _Done:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def wait(self) -> torch.Tensor:
        return self.x


def all_reduce_async(
    x: torch.Tensor, axis: Axes, op: str = "sum", mesh: Mesh | None = None
) -> Pending:
    """Start :func:`all_reduce` of ``x`` and return at once; ``wait()`` on the result gives it.

    ``x`` is handed over: the backend may reduce in its storage, so neither read nor write it
    until ``wait()`` returns. On torch.distributed the reduction runs on the backend's own threads
    while this rank computes (``async_op=True``); the threads backend runs it when waited for.
    Every rank must start the same collectives in the same order, as for blocking ones. Not
    differentiable (it is for gradients, which are reduced after they are computed).
    """
    mesh, axes = _prepare(x, axis, mesh, "all_reduce_async")
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_async: op must be one of {_REDUCE_OPS}; got {op!r}")
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"all_reduce_async: op='avg' needs a floating tensor; got dtype {x.dtype}")
    call = _group_call(mesh, "all_reduce", axes, reduce="sum" if op == "avg" else op)
    _record(mesh, call, x)
    n = len(call.group)
    x = x.detach()
    if n == 1:
        return Pending(_Done(x))
    work = _world(mesh, call, x).start(mesh.rank, call, x)
    return Pending(work, n if op == "avg" else 1)


def all_gather_async(x: torch.Tensor, axis: Axes, mesh: Mesh | None = None) -> Pending:
    """Start :func:`all_gather` of ``x`` along dim 0 and return at once; ``wait()`` gives it.

    Lets a rank fetch what it needs next (ZeRO-3's next layer) while it computes. ``x`` must not
    be modified until ``wait()`` returns; the rest is as for :func:`all_reduce_async`.
    """
    mesh, axes = _prepare(x, axis, mesh, "all_gather_async")
    if x.dim() == 0:
        raise ValueError("all_gather_async: x must have at least one dim to gather along")
    call = _group_call(mesh, "all_gather", axes, dim=0)
    _record(mesh, call, x)
    x = x.detach()
    if len(call.group) == 1:
        return Pending(_Done(x.clone(memory_format=torch.contiguous_format)))
    return Pending(_world(mesh, call, x).start(mesh.rank, call, x))


def all_gather(x: torch.Tensor, axis: Axes, dim: int = 0, mesh: Mesh | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` (equal shapes) along ``dim`` in group order."""
    mesh, axes = _prepare(x, axis, mesh, "all_gather")
    return _AllGather.apply(x, mesh, axes, _dim(x, dim, "all_gather"))


def reduce_scatter(
    x: torch.Tensor, axis: Axes, dim: int = 0, op: str = "sum", mesh: Mesh | None = None
) -> torch.Tensor:
    """Reduce ``x`` over the group (``"sum"|"avg"``) and return this rank's chunk along ``dim``.

    ``x.shape[dim]`` must be divisible by the group size; chunk ``i`` goes to group index ``i``.
    """
    mesh, axes = _prepare(x, axis, mesh, "reduce_scatter")
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter: op must be 'sum' or 'avg'; got {op!r}")
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"reduce_scatter: op='avg' needs a floating tensor; got dtype {x.dtype}")
    dim = _dim(x, dim, "reduce_scatter")
    _divisible(x, dim, mesh.axis_size(axes), axes, "reduce_scatter")
    return _ReduceScatter.apply(x, mesh, axes, dim, op)


def reduce_scatter_async(
    x: torch.Tensor, axis: Axes, op: str = "sum", mesh: Mesh | None = None
) -> Pending:
    """Start :func:`reduce_scatter` of ``x`` along dim 0 and return at once; ``wait()`` gives
    this rank's reduced chunk. ``x`` is handed over, as for :func:`all_reduce_async`."""
    mesh, axes = _prepare(x, axis, mesh, "reduce_scatter_async")
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_async: op must be 'sum' or 'avg'; got {op!r}")
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"reduce_scatter_async: op='avg' needs a floating tensor; got dtype {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError("reduce_scatter_async: x must have at least one dim to scatter along")
    _divisible(x, 0, mesh.axis_size(axes), axes, "reduce_scatter_async")
    call = _group_call(mesh, "reduce_scatter", axes, reduce="sum", dim=0)
    _record(mesh, call, x)
    n = len(call.group)
    x = x.detach()
    if n == 1:
        return Pending(_Done(x.clone(memory_format=torch.contiguous_format)))
    work = _world(mesh, call, x).start(mesh.rank, call, x)
    return Pending(work, n if op == "avg" else 1)


def all_to_all(
    x: torch.Tensor, axis: Axes, split_dim: int, concat_dim: int, mesh: Mesh | None = None
) -> torch.Tensor:
    """Split ``x`` along ``split_dim`` into one chunk per group member, send chunk ``j`` to member
    ``j``, and concatenate the chunks received along ``concat_dim`` in sender order."""
    mesh, axes = _prepare(x, axis, mesh, "all_to_all")
    split_dim = _dim(x, split_dim, "all_to_all", "split_dim")
    concat_dim = _dim(x, concat_dim, "all_to_all", "concat_dim")
    _divisible(x, split_dim, mesh.axis_size(axes), axes, "all_to_all")
    return _AllToAll.apply(x, mesh, axes, split_dim, concat_dim)


def all_to_all_v(
    x: torch.Tensor,
    axis: Axes,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """The all-to-all of rows in sizes of each rank's choosing (MPI's ``alltoallv``): the first
    ``send_sizes[0]`` rows of ``x`` (along dim 0) go to group member 0, the next
    ``send_sizes[1]`` to member 1, and so on; the result is the rows received, concatenated in
    sender order. ``recv_sizes[j]`` is how many rows member ``j`` sends this rank; when None it
    is learned first, by an ``all_to_all`` of the sizes (one int64 per member). The other dims
    must agree across the group. Expert parallelism sends each token to its experts' ranks with
    it. The ledger counts the rows this rank sends to the others, exactly (op ``all_to_all_v``).
    """
    mesh, axes = _prepare(x, axis, mesh, "all_to_all_v")
    n = mesh.axis_size(axes)
    if x.dim() == 0:
        raise ValueError("all_to_all_v: x must have at least one dim (its rows are sent)")
    send = _sizes(send_sizes, n, axis, "send_sizes")
    if sum(send) != x.shape[0]:
        raise ValueError(
            f"all_to_all_v: send_sizes {list(send)} add up to {sum(send)} rows, but x has "
            f"{x.shape[0]} (shape {tuple(x.shape)})"
        )
    if recv_sizes is None:
        got = all_to_all(torch.tensor(send, dtype=torch.int64, device=x.device), axes, 0, 0, mesh)
        recv = tuple(int(c) for c in got.tolist())
    else:
        recv = _sizes(recv_sizes, n, axis, "recv_sizes")
    return _AllToAllV.apply(x, mesh, axes, send, recv)


def _sizes(sizes: Any, n: int, axis: Axes, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(c) for c in sizes)
    except (TypeError, ValueError):
        raise TypeError(
            f"all_to_all_v: {what} must be a sequence of {n} row counts; got {sizes!r}"
        ) from None
    if len(out) != n or any(c < 0 for c in out):
        raise ValueError(
            f"all_to_all_v: {what} must hold {n} counts >= 0 (one per member of axis "
            f"{axis!r}); got {list(out)}"
        )
    return out


def _perm_pairs(perm: Any, n: int, axis: Axes, name: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name}: perm must be (src, dst) pairs of group indices; got {perm!r}"
        ) from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < n for i in srcs + dsts):
        raise ValueError(
            f"{name}: perm {list(pairs)} has an index outside [0, {n}) of axis {axis!r}"
        )
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{name}: perm {list(pairs)} repeats a source or a destination")
    return pairs


def ppermute(
    x: torch.Tensor, axis: Axes, perm: Sequence[tuple[int, int]], mesh: Mesh | None = None
) -> torch.Tensor:
    """Send ``x`` from group index ``src`` to ``dst`` for each ``(src, dst)`` in ``perm``.

    Each index is a source at most once and a destination at most once; a rank that receives
    nothing gets zeros. ``ppermute(x, "pp", [(i, (i + 1) % n) for i in range(n)])`` is a ring shift.
    """
    mesh, axes = _prepare(x, axis, mesh, "ppermute")
    pairs = _perm_pairs(perm, mesh.axis_size(axes), axis, "ppermute")
    return _PPermute.apply(x, mesh, axes, pairs)


def ppermute_async(
    x: torch.Tensor, axis: Axes, perm: Sequence[tuple[int, int]], mesh: Mesh | None = None
) -> Pending:
    """Start :func:`ppermute` of ``x`` and return at once; ``wait()`` gives what this rank
    receives. Ring attention sends the next key/value block while it computes on this one.

    ``x`` must not be modified until ``wait()`` returns; the rest is as for
    :func:`all_reduce_async` (on torch.distributed the transfers are in flight meanwhile).
    """
    mesh, axes = _prepare(x, axis, mesh, "ppermute_async")
    pairs = _perm_pairs(perm, mesh.axis_size(axes), axis, "ppermute_async")
    call = _group_call(mesh, "ppermute", axes, perm=pairs)
    _record(mesh, call, x)
    x = x.detach()
    if len(call.group) == 1:
        return Pending(_Done(x.clone(memory_format=torch.contiguous_format)))
    return Pending(_world(mesh, call, x).start(mesh.rank, call, x))


def broadcast(x: torch.Tensor, axis: Axes, src: int = 0, mesh: Mesh | None = None) -> torch.Tensor:
    """Every rank gets group index ``src``'s ``x`` (all ranks pass tensors of the same shape)."""
    mesh, axes = _prepare(x, axis, mesh, "broadcast")
    _group_index(src, mesh.axis_size(axes), axis, "broadcast", "src")
    return _Broadcast.apply(x, mesh, axes, src)


def _group_index(index: Any, n: int, axis: Axes, name: str, what: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise ValueError(
            f"{name}: {what}={index!r} is not a group index in [0, {n}) of axis {axis!r}"
        )


def reduce(x: torch.Tensor, axis: Axes, dst: int = 0, mesh: Mesh | None = None) -> torch.Tensor:
    """Group index ``dst`` gets the sum of every rank's ``x``; the others get zeros (all ranks
    pass tensors of the same shape). SUMMA's matmuls reduce each partial product to its owner."""
    mesh, axes = _prepare(x, axis, mesh, "reduce")
    _group_index(dst, mesh.axis_size(axes), axis, "reduce", "dst")
    return _Reduce.apply(x, mesh, axes, dst)
