"""The errors that distributed code raises: each names the ranks, the axis and the collective."""

from __future__ import annotations

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "PeerLostError", "RankFailedError"]


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group entered different collectives, axes, shapes, dtypes or arguments.

    Raised on every rank of the group, with what each rank called, instead of hanging.
    """


class CollectiveTimeoutError(RuntimeError):
    """Some ranks of a group did not reach a collective within the timeout; names them."""


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank of its group is gone (it crashed or was killed);
    names this rank and the collective. The rank that stopped first says why."""


class RankFailedError(RuntimeError):
    """A rank raised; ``rank`` is the rank that failed first and ``__cause__`` its exception.

    :func:`colfunc.sharding.launch` raises it in the caller, and ranks waiting in a collective when
    another rank fails are released with it rather than left hanging.
    """

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):  # keep `rank` when the error crosses a process boundary
        return (_rebuild_rank_failed, (str(self), self.rank))


def _rebuild_rank_failed(message: str, rank: int | None) -> RankFailedError:
    return RankFailedError(message, rank=rank)
