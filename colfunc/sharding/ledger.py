"""The per-rank ledger of bytes sent by collectives, with ring-algorithm accounting.

Each rank counts what *it* sends, per (op, axis), where ``n`` is the group size and ``S`` the bytes
of the tensor the formula names:

================  ====================================================================
all_gather        ``(n-1)/n * S``, S = the gathered (output) tensor: each rank forwards
                  the n-1 chunks it does not own once around the ring.
reduce_scatter    ``(n-1)/n * S``, S = the input tensor (n chunks, n-1 of them sent).
all_reduce        ``2 * (n-1)/n * S`` (a reduce_scatter then an all_gather), floored.
all_to_all        ``(n-1)/n * S``, S = the input: every chunk but the one kept goes out.
all_to_all_v      the bytes of the rows sent to the other members (each rank's own sizes).
broadcast         ``S`` on every rank but the one just before ``src`` on the ring: the
                  pipelined chain broadcast src -> src+1 -> ... (total (n-1) * S).
reduce            ``S`` on every rank but ``dst``: the chain reduce towards dst, each rank
                  adding its tensor to what it received and passing it on (total (n-1) * S).
ppermute          ``S`` on a rank that sends to another rank, else 0 (self-pairs are free).
================  ====================================================================

Recording is off by default and costs one boolean check per collective when off. Axis keys are
the axis name for one axis and the tuple of names for several.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colfunc.sharding.mesh import Mesh

__all__ = ["Ledger", "ledger", "recording", "ring_bytes"]

AxisKey = str | tuple[str, ...]


class Ledger:
    """Bytes this rank sent, per (op, axis). ``enabled`` is the on/off flag."""

    __slots__ = ("_counts", "enabled")

    def __init__(self) -> None:
        self.enabled = False
        self._counts: dict[tuple[str, AxisKey], int] = {}

    def record(self, op: str, axis: AxisKey, nbytes: int) -> None:
        """Add ``nbytes`` to the (op, axis) entry."""
        key = (op, axis)
        self._counts[key] = self._counts.get(key, 0) + nbytes

    def bytes(self, op: str | None = None, axis: AxisKey | None = None) -> int:
        """Total bytes sent, optionally only for one op and/or one axis key."""
        return sum(
            v
            for (o, a), v in self._counts.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def as_dict(self) -> dict[tuple[str, AxisKey], int]:
        """A copy of the counts, ``{(op, axis): bytes}``."""
        return dict(self._counts)

    def reset(self) -> None:
        """Forget every count (the on/off flag is kept)."""
        self._counts.clear()

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"Ledger({state}, {self._counts})"


def ring_bytes(op: str, nbytes: int, n: int, *, sends: bool = True) -> int:
    """Bytes one rank sends in ``op`` over a group of ``n``, for a tensor of ``nbytes``.

    ``nbytes`` is the size the module docstring's formula names (the gathered output for
    all_gather, the input otherwise); ``sends`` says, for broadcast and ppermute, whether this
    rank forwards the tensor at all.
    """
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes // n
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("broadcast", "reduce", "ppermute"):
        return nbytes if sends else 0
    raise ValueError(f"ring_bytes: unknown collective {op!r}")


def ledger(mesh: Mesh | None = None) -> Ledger:
    """This rank's ledger (of ``mesh``, default the current mesh)."""
    from colfunc.sharding.mesh import current_mesh

    return (mesh if mesh is not None else current_mesh()).ledger


@contextmanager
def recording(mesh: Mesh | None = None) -> Iterator[Ledger]:
    """Turn this rank's ledger on for the ``with`` block and yield it.

    >>> with recording() as led:
    ...     y = comm.all_gather(x, "tp")
    >>> led.bytes("all_gather", "tp")
    """
    led = ledger(mesh)
    before = led.enabled
    led.enabled = True
    try:
        yield led
    finally:
        led.enabled = before
