"""Point to point: ``send`` and ``recv`` by mesh axis and group index (re-exported by
:mod:`colfunc.sharding.comm`). Not differentiable: a pipeline schedule drives its own backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from colfunc.sharding.mesh import Axes, Mesh, current_mesh

__all__ = ["recv", "send"]


def _peer(mesh: Mesh, axes: tuple[str, ...], index: Any, name: str, what: str) -> int:
    group = mesh.group_ranks(axes)
    if mesh.world is None:
        raise RuntimeError(
            f"{name} on {mesh!r}: this mesh has no backend world; run the code under "
            "colfunc.sharding.launch(fn, mesh=...)"
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(group):
        raise ValueError(
            f"{name}: {what}={index!r} is not a group index in [0, {len(group)}) of axis {axes!r}"
        )
    if group[index] == mesh.rank:
        raise ValueError(f"{name}: {what}={index} is this rank itself; keep the tensor instead")
    return group[index]


def _tag(tag: Any, name: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"{name}: tag must be an int >= 0, got {tag!r}")
    return tag


def send(x: torch.Tensor, axis: Axes, dst: int, *, tag: int = 0, mesh: Mesh | None = None) -> Any:
    """Send ``x`` to group index ``dst`` of ``axis`` without waiting for the receiver.

    Returns a request whose ``wait()`` returns once ``x`` may be modified again (on the threads
    backend at once: the message is a copy). The receiver calls :func:`recv` with the same
    ``tag``; messages between two ranks are matched by tag, so each (sender, receiver, tag) is
    used once at a time. The ledger counts the tensor's bytes as op ``"send"``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"send: x must be a torch.Tensor; got {type(x).__name__}")
    mesh = mesh if mesh is not None else current_mesh()
    axes = mesh.axes(axis)
    peer = _peer(mesh, axes, dst, "send", "dst")
    tag = _tag(tag, "send")
    if mesh.ledger.enabled:
        mesh.ledger.record(
            "send", axes[0] if len(axes) == 1 else axes, x.numel() * x.element_size()
        )
    return mesh.world.send(mesh.rank, peer, x.detach(), tag)


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    axis: Axes,
    src: int,
    *,
    tag: int = 0,
    device: torch.device | str | None = None,
    mesh: Mesh | None = None,
) -> Any:
    """Start receiving the tensor that group index ``src`` of ``axis`` sends with ``tag``.

    Returns a request whose ``wait()`` returns the tensor, a new one. Posting the receive early
    lets the transfer run while this rank computes. ``shape`` and ``dtype`` must be those sent:
    a different one raises on the threads backend (``CollectiveMismatchError`` naming both ranks)
    and is undefined on the others.
    """
    mesh = mesh if mesh is not None else current_mesh()
    axes = mesh.axes(axis)
    peer = _peer(mesh, axes, src, "recv", "src")
    shape = tuple(int(n) for n in shape)
    return mesh.world.recv(mesh.rank, peer, shape, dtype, _tag(tag, "recv"), device)
