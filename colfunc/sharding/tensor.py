"""``ShardedTensor``: a torch.Tensor holding this rank's shard of a global tensor.

The wrapper reports the *global* shape, dtype and device; the data is this rank's local part
(``to_local()``), laid out by one placement per mesh axis. Every ATen op on it goes through
``__torch_dispatch__`` to :func:`colfunc.sharding.dispatch.dispatch`, which applies the op's
propagation rule, so model code written for one device runs unchanged. Autograd runs above
dispatch and sees global tensors: gradients are ShardedTensors, computed by the same rules.

``redistribute``, ``full_tensor``, ``to_local`` and ``from_local`` are differentiable. A
gradient goes back to the placements of the forward input, with Partial replaced by Replicate
(the transpose of summing pieces is handing each piece the whole gradient). At the boundary to
plain tensors (``to_local``, ``full_tensor``) a replicated value's gradient is taken to be the
same on every rank, as when every rank computes the same loss from it; code that calls
collectives on local tensors itself belongs in :func:`colfunc.sharding.shard_map`, whose
boundary follows the collectives' own convention instead (the plain loop over ranks).

Rules choose how the global ops run, so gradients take the placements that the backward ops
produce: a split weight gets a gradient split alike, a replicated norm weight a replicated one
(under tensor parallelism). A gradient that comes out Partial is reduced onto the placements of
its tensor once autograd has summed it (for a tensor an op made; a leaf's is left to the
caller), as Megatron reduces the input gradients of its column-parallel layers. An embedding
table's gradient cannot know how the table was split (the backward op sees only ids and
gradient) and comes back replicated unless the table is tied to a split head;
``grad.redistribute(param.placements)`` is then a local slice.

Example (inside ``launch(fn, mesh={"tp": 2})``)::

    w = distribute(torch.randn(4, 6), mesh, [Shard(1)])   # each rank holds [4, 3]
    y = x @ w                                                 # Shard(1) too, no communication
    y.full_tensor()                                           # [B, 6] on every rank
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc import torch_private
from colfunc.sharding import comm
from colfunc.sharding.mesh import Mesh, current_mesh
from colfunc.sharding.placement import (
    Placements,
    Replicate,
    Shard,
    grad_placements,
    local_shape,
    normalize_placements,
    spec_from_placements,
)
from colfunc.sharding.redistribute import redistribute_local

__all__ = ["ShardedTensor", "distribute", "from_local"]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class ShardedTensor(torch.Tensor):
    """This rank's shard of a global tensor; see the module docstring.

    Build one with :func:`distribute` (every rank holds the full tensor) or :func:`from_local`
    (every rank holds its shard). The constructor does not validate; it is for code that already
    knows the shard matches.
    """

    _local: torch.Tensor
    _mesh: Mesh
    _placements: Placements
    _param = False  # a view or cast of a parameter (the propagation rules keep those in place)

    __torch_function__ = torch_private.get("disabled_torch_function_impl")

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        mesh: Mesh,
        placements: Placements,
        shape: tuple[int, ...],
        stride: tuple[int, ...] | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        shape = tuple(shape)
        r = torch_private.make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous_strides(shape) if stride is None else stride,
            dtype=local.dtype,
            device=local.device,
            layout=local.layout,
            requires_grad=requires_grad,
        )
        r._local, r._mesh, r._placements = local, mesh, placements
        return r

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def placements(self) -> Placements:
        """One placement per mesh axis."""
        return self._placements

    @property
    def spec(self) -> Any:
        """The partition spec (:class:`colfunc.P`) of Shard/Replicate placements."""
        return spec_from_placements(self._mesh, self._placements)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, placements={self._placements}, "
            f"mesh={self._mesh!r}, local={self._local!r})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Mesh, Placements]]:
        return ["_local"], (self._mesh, self._placements)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor],
        meta: tuple[Mesh, Placements],
        outer_size: Any,
        outer_stride: Any,
    ) -> ShardedTensor:
        mesh, placements = meta
        return ShardedTensor(
            inner["_local"], mesh, placements, tuple(outer_size), tuple(outer_stride)
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        from colfunc.sharding.dispatch import dispatch

        return dispatch(func, args, kwargs or {})

    # --- the public methods (differentiable) ---------------------------------------------------
    def to_local(self) -> torch.Tensor:
        """This rank's shard, a plain tensor; its gradient comes back with these placements."""
        return _ToLocal.apply(self)

    def redistribute(self, placements: Any) -> ShardedTensor:
        """The same global tensor under ``placements`` (a sequence per axis, a mapping or a P)."""
        pl = normalize_placements(self._mesh, placements, self.dim())
        if pl == self._placements:
            return self
        return _Redistribute.apply(self, pl)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank, a plain tensor (a collective)."""
        return self.redistribute([Replicate()] * len(self._placements)).to_local()


# --- autograd functions (forward/setup_context split, so torch.func transforms work) ----------


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(x: ShardedTensor, placements: Placements) -> ShardedTensor:
        local = redistribute_local(x._local, x.shape, x._mesh, x._placements, placements)
        return ShardedTensor(local, x._mesh, placements, tuple(x.shape))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.src = inputs[0]._placements

    @staticmethod
    def backward(ctx: Any, g: ShardedTensor) -> tuple[Any, ...]:
        return g.redistribute(grad_placements(ctx.src)), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(x: ShardedTensor) -> torch.Tensor:
        # a fresh tensor object: autograd writes its metadata on what forward returns
        return x._local.view_as(x._local)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x = inputs[0]
        ctx.mesh, ctx.placements, ctx.shape = x._mesh, x._placements, tuple(x.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return _FromLocal.apply(g, ctx.mesh, grad_placements(ctx.placements), ctx.shape)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(
        local: torch.Tensor, mesh: Mesh, placements: Placements, shape: tuple[int, ...]
    ) -> ShardedTensor:
        return ShardedTensor(local.detach(), mesh, placements, shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.placements = inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple[Any, ...]:
        if isinstance(g, ShardedTensor):
            g = g.redistribute(grad_placements(ctx.placements)).to_local()
        return g, None, None, None


# --- constructors ---------------------------------------------------------------------------


def distribute(t: torch.Tensor, mesh: Mesh | None = None, placements: Any = None) -> ShardedTensor:
    """Shard ``t``, which every rank holds whole, by ``placements``; no communication.

    ``placements``: one per mesh axis, a mapping ``{axis: placement}`` or a :class:`colfunc.P`
    (default: replicated). The result is a new leaf (``requires_grad`` copied from ``t``) that
    shares no memory with ``t``.
    """
    if not isinstance(t, torch.Tensor) or isinstance(t, ShardedTensor):
        raise TypeError(f"distribute: t must be a plain torch.Tensor, got {type(t).__name__}")
    mesh = current_mesh() if mesh is None else mesh
    n = len(mesh.axis_names)
    pl = normalize_placements(
        mesh, [Replicate()] * n if placements is None else placements, t.dim()
    )
    full = t.detach()
    local = redistribute_local(full, tuple(t.shape), mesh, (Replicate(),) * n, pl)
    if local is full:
        local = full.clone()
    return ShardedTensor(local, mesh, pl, tuple(t.shape), requires_grad=t.requires_grad)


def from_local(
    local: torch.Tensor,
    mesh: Mesh | None = None,
    placements: Any = None,
    shape: tuple[int, ...] | None = None,
) -> ShardedTensor:
    """The ShardedTensor whose shard on this rank is ``local`` (differentiable; shares memory).

    Without ``shape`` the global shape is found from every rank's local shape (one small
    all_gather over the mesh), and ranks whose shapes do not fit the placements raise ValueError
    on every rank. With ``shape`` each rank checks only its own shard, without communication.
    """
    if not isinstance(local, torch.Tensor) or isinstance(local, ShardedTensor):
        raise TypeError(
            f"from_local: local must be a plain torch.Tensor, got {type(local).__name__}"
        )
    mesh = current_mesh() if mesh is None else mesh
    n = len(mesh.axis_names)
    pl = normalize_placements(
        mesh, [Replicate()] * n if placements is None else placements, local.dim()
    )
    if shape is None:
        shape = _global_shape(local, mesh, pl)
    else:
        shape = tuple(int(s) for s in shape)
        want = local_shape(shape, mesh, pl) if len(shape) == local.dim() else None
        if want != tuple(local.shape):
            raise ValueError(
                f"from_local: rank {mesh.rank} has a local shard of shape {tuple(local.shape)}, but "
                f"global shape {shape} under placements {pl} gives it {want}"
            )
    return _FromLocal.apply(local, mesh, pl, shape)


def _global_shape(local: torch.Tensor, mesh: Mesh, pl: Placements) -> tuple[int, ...]:
    """The global shape implied by every rank's local shape; ValueError where they disagree."""
    mine = torch.tensor([list(local.shape)], dtype=torch.int64, device=local.device)
    with torch.no_grad():
        rows = comm.all_gather(mine, mesh.axis_names, 0, mesh).tolist()  # one row per global rank
    shapes = [tuple(r) for r in rows]
    meshes = [Mesh(mesh.shape, r) for r in range(mesh.size)]
    # rank 0's group over the splitting axes tiles each split dim exactly once
    shape = list(shapes[0])
    for d in range(local.dim()):
        axes = [a for a, p in zip(mesh.axis_names, pl) if p == Shard(d)]
        if axes:
            shape[d] = sum(
                shapes[r][d]
                for r, m in enumerate(meshes)
                if all(c == 0 for a, c in m.coords.items() if a not in axes)
            )
    bad = [r for r, m in enumerate(meshes) if local_shape(shape, m, pl) != shapes[r]]
    if bad:
        raise ValueError(
            f"from_local: the local shapes do not fit placements {pl} on mesh {mesh.shape}: "
            + "; ".join(
                f"rank {r} has {shapes[r]}, expected {local_shape(shape, meshes[r], pl)}"
                for r in bad
            )
            + f" (global shape {tuple(shape)} from rank 0's group; all local shapes: "
            + f"{dict(enumerate(shapes))})"
        )
    return tuple(shape)
