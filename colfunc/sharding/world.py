"""What ``comm`` asks of a backend: one ``Call`` description and one ``collective`` method.

A backend world (threads, torch.distributed) implements only the forward maths of each
collective over an ordered group of global ranks; ``comm`` owns validation, autograd and the
ledger, so every backend gets them once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from colfunc import torch_private
from colfunc.sharding.ledger import Ledger

__all__ = ["Call", "World", "combine"]


# the arguments that matter to each op, in the order error messages show them
_ARGS = {
    "all_reduce": ("reduce",),
    "reduce": ("reduce", "root"),
    "all_gather": ("dim",),
    "reduce_scatter": ("reduce", "dim"),
    "all_to_all": ("split_dim", "concat_dim"),
    "all_to_all_v": (),
    "ppermute": ("perm",),
    "broadcast": ("root",),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """One collective as a rank calls it.

    ``group`` is the ordered tuple of global ranks (group index = position); ``reduce`` is
    ``"sum"|"max"|"min"`` (``avg`` is a sum divided in ``comm``); ``dim``, ``split_dim`` and
    ``concat_dim`` are non-negative tensor dims; ``perm`` holds ``(src_index, dst_index)`` pairs;
    ``root`` is the group index of broadcast's source or reduce's destination; ``sizes`` is
    ``all_to_all_v``'s ``(send, recv)`` row counts per member, which differ from rank to rank and
    so take no part in comparing calls. Fields an op does not use keep their defaults, so two
    calls agree exactly when they are equal.
    """

    op: str
    axis: tuple[str, ...]
    group: tuple[int, ...]
    reduce: str = "sum"
    dim: int = 0
    split_dim: int = 0
    concat_dim: int = 0
    perm: tuple[tuple[int, int], ...] = ()
    root: int = 0
    sizes: tuple[tuple[int, ...], tuple[int, ...]] = dataclasses.field(
        default=((), ()), compare=False
    )

    def describe(self, x: torch.Tensor | None = None) -> str:
        """``all_gather(axis='tp', dim=0, shape=(2, 3), dtype=float32)``, for error messages."""
        axis = self.axis[0] if len(self.axis) == 1 else self.axis
        args = [f"axis={axis!r}"]
        for f in _ARGS.get(self.op, ()):
            args.append(f"{'op' if f == 'reduce' else f}={getattr(self, f)!r}")
        if x is not None and self.op == "all_to_all_v":  # (the rows differ from rank to rank)
            args.append(
                f"row shape={tuple(x.shape[1:])}, dtype={str(x.dtype).removeprefix('torch.')}"
            )
        elif x is not None:
            args.append(f"shape={tuple(x.shape)}, dtype={str(x.dtype).removeprefix('torch.')}")
        return f"{self.op}({', '.join(args)})"


class World(Protocol):
    """The communicators behind a mesh: ``size`` ranks, one ledger per rank."""

    name: str
    size: int

    def ledger(self, rank: int) -> Ledger: ...

    def collective(self, rank: int, call: Call, x: torch.Tensor) -> torch.Tensor:
        """Run ``call`` with this rank's input ``x``; return a new tensor (never ``x`` itself)."""
        ...

    def start(self, rank: int, call: Call, x: torch.Tensor) -> Any:
        """Start ``call`` (an ``all_reduce``, or an ``all_gather`` or ``reduce_scatter`` along
        dim 0) with this rank's
        ``x``, which the backend may reduce in place; a request whose ``wait()`` returns the
        result."""
        ...

    def send(self, rank: int, dst: int, x: torch.Tensor, tag: int) -> Any:
        """Start sending ``x`` to global rank ``dst``; a request with ``wait()``."""
        ...

    def recv(
        self,
        rank: int,
        src: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
        device: Any,
    ) -> Any:
        """Start receiving what global rank ``src`` sends with ``tag``; ``wait()`` returns it."""
        ...


def _pieces(xs: Sequence[torch.Tensor], dim: int, start: int, size: int) -> list[torch.Tensor]:
    """Views of every member's input, taken out of sight of this thread's dispatch modes: on the
    threads backend the other members' inputs are other ranks' memory, which a rank's
    :func:`colfunc.memory.track` must not count as its own (on a real backend what arrives is a
    fresh buffer, which the op's result here is too)."""
    with torch_private.get("disable_current_modes")():
        return [x.narrow(dim, start, size) for x in xs]


def combine(
    call: Call,
    xs: Sequence[torch.Tensor],
    index: int,
    sends: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The result of ``call`` on group member ``index``, from every member's input in group order
    (and for ``all_to_all_v`` every member's send sizes, its own call's for a group of one).

    The plain definition of each collective, reducing in group order (so the result does not
    depend on timing); the threads backend runs it, and ``comm`` runs it for groups of one.
    """
    op, n = call.op, len(xs)
    if op in ("all_reduce", "reduce"):
        if op == "reduce" and index != call.root:
            return torch.zeros_like(xs[index], memory_format=torch.contiguous_format)
        acc = xs[0].clone(memory_format=torch.contiguous_format)
        for x in xs[1:]:
            if call.reduce == "sum":
                acc.add_(x)
            elif call.reduce == "max":
                torch.maximum(acc, x, out=acc)
            else:
                torch.minimum(acc, x, out=acc)
        return acc
    if op == "all_gather":
        return torch.cat(list(xs), call.dim)
    if op == "reduce_scatter":
        c = xs[0].shape[call.dim] // n
        pieces = _pieces(xs, call.dim, index * c, c)
        acc = pieces[0].clone(memory_format=torch.contiguous_format)
        for x in pieces[1:]:
            acc.add_(x)
        return acc
    if op == "all_to_all":
        c = xs[0].shape[call.split_dim] // n
        return torch.cat(_pieces(xs, call.split_dim, index * c, c), call.concat_dim)
    if op == "all_to_all_v":
        sends = sends if sends is not None else [call.sizes[0]]
        rows = []
        for x, sent in zip(xs, sends):
            start = sum(sent[:index])
            rows.extend(_pieces([x], 0, start, sent[index]))
        return torch.cat(rows).clone(memory_format=torch.contiguous_format)
    if op == "ppermute":
        for s, d in call.perm:
            if d == index:
                return xs[s].clone(memory_format=torch.contiguous_format)
        return torch.zeros_like(xs[index], memory_format=torch.contiguous_format)
    if op == "broadcast":
        return xs[call.root].clone(memory_format=torch.contiguous_format)
    raise ValueError(f"unknown collective {op!r}")
