"""The one context stack: thread-local frames entered with ``with`` (see :mod:`colfunc.core`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[Any] = []


_STACK = _Stack()


@contextmanager
def context(frame: Any) -> Iterator[Any]:
    """Push ``frame`` on this thread's context stack for the ``with`` block."""
    frames_ = _STACK.frames
    frames_.append(frame)
    try:
        yield frame
    finally:
        if frames_ and frames_[-1] is frame:
            frames_.pop()
        else:  # a frame leaked past its `with`: remove this one anyway, and say so
            for i in range(len(frames_) - 1, -1, -1):
                if frames_[i] is frame:
                    del frames_[i]
                    break
            raise RuntimeError(
                f"context stack corrupted: {frame!r} was not the innermost frame when its "
                f"`with` block ended; frames are {frames_!r}"
            )


def frames() -> tuple[Any, ...]:
    """This thread's frames, outermost first."""
    return tuple(_STACK.frames)


# (frame class, interceptor protocol) -> whether the class implements it: a runtime protocol's
# isinstance walks the protocol's members every time, and the scan, every attention and every
# linear ask it of each frame on the stack
_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def _implements(frame: Any, protocol: type) -> bool:
    """``isinstance(frame, protocol)`` for an interceptor protocol, decided once per frame
    class (a frame intercepts by the methods of its class)."""
    key = (type(frame), protocol)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(frame, protocol)
    return known


def innermost(kind: type[T]) -> T | None:
    """The innermost frame that is an instance of ``kind``, or None."""
    for f in reversed(_STACK.frames):
        if isinstance(f, kind):
            return f
    return None
