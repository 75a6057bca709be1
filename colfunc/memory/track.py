"""Peak live tensor bytes, tracked per storage through a dispatch mode.

Every op that runs inside :func:`track` reports its outputs (a ShardedTensor's: the local piece
it holds on this rank); a storage not seen before is counted
live until its last reference dies (storages keep one Python object for their whole life, so a
finaliser on it fires exactly when the memory is released). Views share their base's storage and
are counted once. Storages that existed before the context are not counted: the figure is what
the tracked code allocated, e.g. a step's activations and gradients, not the parameters it was
handed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from colfunc import torch_private
from colfunc.torch_private import pytree_module

TorchDispatchMode: Any = torch_private.get("TorchDispatchMode")
tree_leaves = pytree_module.tree_leaves

__all__ = ["Tracker", "track"]


class Tracker:
    """The figures of one :func:`track` context (bytes)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocated = 0  # total bytes of every new storage, freed or not
        self._ids: set[int] = set()
        self._lock = threading.Lock()  # finalisers may run on another thread

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        with self._lock:
            if key in self._ids:
                return
            self._ids.add(key)
            n = storage.nbytes()
            self.live += n
            self.allocated += n
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (to take the peaks of parts of a block)."""
        with self._lock:
            self.peak = self.live

    def _free(self, key: int, n: int) -> None:
        with self._lock:
            if key in self._ids:
                self._ids.discard(key)
                self.live -= n

    def __repr__(self) -> str:
        return f"Tracker(peak={self.peak}, live={self.live}, allocated={self.allocated})"


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: Tracker, preexisting: set[int], meta: bool) -> None:
        super().__init__()
        self.tracker = tracker
        self.preexisting = preexisting
        self.meta = meta

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # the common results first (one tensor, a tuple of them), without flattening a pytree
        outs = (out,) if type(out) is torch.Tensor else out if type(out) is tuple else None
        for t in tree_leaves(out) if outs is None else outs:
            if isinstance(t, torch.Tensor) and (self.meta or not t.is_meta):
                for storage in _storages(t):
                    key = id(storage)
                    if key not in self.preexisting and key not in self.tracker._ids:
                        self.tracker._add(storage)
        return out


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding ``t``'s data: its own, or for a wrapper subclass (a ShardedTensor,
    whose own storage stands for the global shape) those of the tensors inside it, this rank's
    local pieces."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
    else:
        yield t.untyped_storage()


@contextmanager
def track(*preexisting: Any, meta: bool = False) -> Iterator[Tracker]:
    """Record the peak of live tensor bytes allocated inside the ``with`` block on this thread.

    Tensors passed as ``preexisting`` (any pytrees) are never counted, even when an op returns them
    (in-place ops do). ``meta=True`` counts meta tensors too (a dry run's allocations).

    Example:
        >>> with cf.memory.track() as t:
        ...     state, metrics = step(state, batch)
        >>> t.peak  # bytes
    """
    known = {
        id(s) for x in tree_leaves(preexisting) if isinstance(x, torch.Tensor) for s in _storages(x)
    }
    tracker = Tracker()
    with _Mode(tracker, known, meta):
        yield tracker
