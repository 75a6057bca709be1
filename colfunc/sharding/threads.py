"""The threads backend: one thread per rank in this process, collectives by rendezvous.

A collective is two barriers on its group. Each rank deposits its call and input and waits until
every member has arrived (phase 1); the last to arrive checks that all called the same thing.
Then each rank computes its own result from all inputs, in group order (so sums are
deterministic), and waits until every member has finished reading (phase 2), because a rank may
modify its input in place as soon as the collective returns.

Nothing hangs: a round whose members called different collectives raises
``CollectiveMismatchError`` on all of them at once; when every rank still running is stuck in a
round that cannot complete (ranks waiting in different groups, or a peer that returned), all of
them raise it at once as well; a round still incomplete after ``timeout`` seconds raises
``CollectiveTimeoutError``; a rank that raises aborts the world and releases everyone waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from colfunc import core
from colfunc.sharding.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from colfunc.sharding.ledger import Ledger
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.world import Call, combine

__all__ = ["ThreadWorld", "run_threads"]

_Error = tuple[type[BaseException], str, int | None]  # (class, message, failed rank)


class _Round:
    """One collective on one group: the members' calls, then how many have read the inputs."""

    __slots__ = ("calls", "complete", "error", "finished")

    def __init__(self) -> None:
        self.calls: dict[int, tuple[Call, torch.Tensor]] = {}
        self.complete = False
        self.error: _Error | None = None
        self.finished = 0


def _raise(error: _Error) -> None:
    cls, message, rank = error
    if cls is RankFailedError:
        raise RankFailedError(message, rank=rank)
    raise cls(message)


class ThreadWorld:
    """The shared state of ``size`` rank threads: open rounds per group, failures, ledgers."""

    name = "threads"

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self._cond = threading.Condition()
        self._open: dict[tuple[int, ...], _Round] = {}  # keyed by the sorted member ranks
        self._waiting: dict[int, _Round] = {}  # rank -> the round it waits to complete
        self._returned: set[int] = set()
        self._first_return: tuple[int, float] | None = None  # (rank, time) of the first return
        self._ended: set[int] = set()
        self.failure: tuple[int | None, BaseException] | None = None
        self._ledgers = [Ledger() for _ in range(size)]
        self._mail: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # (src, dst, tag)

    def ledger(self, rank: int) -> Ledger:
        return self._ledgers[rank]

    # --- collectives -----------------------------------------------------------------------
    def collective(self, rank: int, call: Call, x: torch.Tensor) -> torch.Tensor:
        # Groups over the same ranks meet in one round whatever their order or axes, so that
        # ("dp", "tp") against ("tp", "dp") is reported as a mismatch rather than a timeout.
        key = tuple(sorted(call.group))
        with self._cond:
            self._raise_if_failed(rank, call, x)
            rnd = self._open.get(key)
            if rnd is None:
                rnd = self._open[key] = _Round()
            rnd.calls[rank] = (call, x)
            if len(rnd.calls) == len(key):
                del self._open[key]
                rnd.complete = True
                rnd.error = _mismatch(key, rnd.calls)
                self._cond.notify_all()
            else:
                self._wait_complete(rank, key, rnd)
            if rnd.error is not None:
                _raise(rnd.error)

        xs = [rnd.calls[r][1] for r in call.group]
        xs = [t if t.device == x.device else t.to(x.device) for t in xs]
        sends = [rnd.calls[r][0].sizes[0] for r in call.group]
        try:
            return combine(call, xs, call.group.index(rank), sends)
        finally:
            # no reference to another rank's input outlives the round on this thread, nor one
            # to this rank's in the round: each input is freed when its own rank drops it, so
            # what a rank's cf.memory.track sees does not depend on the other threads' timing
            xs.clear()
            with self._cond:
                rnd.finished += 1
                self._cond.notify_all()
                while rnd.finished < len(key) and self.failure is None:
                    self._cond.wait()
                if rnd.finished < len(key):
                    self._raise_if_failed(rank, call, x)
                rnd.calls.pop(rank, None)

    def start(self, rank: int, call: Call, x: torch.Tensor) -> _Deferred:
        # Run when waited for: every rank starts and waits in the same order, so the deferred
        # rounds meet just as the blocking ones do, and the numbers are the same.
        return _Deferred(self, rank, call, x)

    # --- point to point: a mailbox per (sender, receiver, tag) --------------------------------
    def send(self, rank: int, dst: int, x: torch.Tensor, tag: int) -> _Sent:
        message = x.clone(memory_format=torch.contiguous_format)  # the sender may reuse x
        with self._cond:
            self._mail.setdefault((rank, dst, tag), []).append(message)
            self._cond.notify_all()
        return _Sent()

    def recv(
        self,
        rank: int,
        src: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
        device: Any,
    ) -> _Receive:
        return _Receive(self, rank, src, shape, dtype, tag, device)

    def take(
        self, rank: int, src: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int
    ) -> torch.Tensor:
        """Wait for the message ``src`` sent to ``rank`` with ``tag`` and take it."""
        key = (src, rank, tag)
        what = f"recv(src=rank {src}, tag={tag}, shape={shape}, dtype={dtype})"
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not self._mail.get(key):
                if self.failure is not None:
                    failed, exc = self.failure
                    raise RankFailedError(
                        f"rank {rank}: {what} abandoned because rank {failed} failed: "
                        f"{type(exc).__name__}: {exc}",
                        rank=failed,
                    )
                left = deadline - time.monotonic()
                if src in self._ended or left <= 0:
                    why = "returned" if src in self._ended else f"sent nothing in {self.timeout} s"
                    raise CollectiveTimeoutError(f"rank {rank}: {what}: rank {src} {why}")
                self._cond.wait(left)
            queue = self._mail[key]
            x = queue.pop(0)
            if not queue:
                del self._mail[key]
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise CollectiveMismatchError(
                f"rank {rank}: {what}, but rank {src} sent shape {tuple(x.shape)}, dtype {x.dtype}"
            )
        return x

    def _wait_complete(self, rank: int, key: tuple[int, ...], rnd: _Round) -> None:
        self._waiting[rank] = rnd
        try:
            self._check_stuck()
            deadline = time.monotonic() + self.timeout
            while not rnd.complete:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail_round(key, rnd, self._timeout_error(key, rnd))
                    break
                self._cond.wait(left)
        finally:
            del self._waiting[rank]

    def _fail_round(self, key: tuple[int, ...], rnd: _Round, error: _Error) -> None:
        if self._open.get(key) is rnd:
            del self._open[key]
        rnd.complete, rnd.error = True, error
        self._cond.notify_all()

    def _raise_if_failed(self, rank: int, call: Call, x: torch.Tensor) -> None:
        if self.failure is not None:
            failed, exc = self.failure
            who = f"rank {failed}" if failed is not None else "the launching thread"
            _raise(
                (
                    RankFailedError,
                    f"rank {rank}: {call.describe(x)} abandoned because {who} failed: "
                    f"{type(exc).__name__}: {exc}",
                    failed,
                )
            )

    # --- diagnosis -------------------------------------------------------------------------
    def _state(self, rank: int) -> str:
        rnd = self._waiting.get(rank)
        if rnd is not None:
            call, x = rnd.calls[rank]
            return f"rank {rank} waits in {call.describe(x)} over ranks {call.group}"
        if rank in self._returned:
            return f"rank {rank} has returned from fn"
        return f"rank {rank} is running outside collectives"

    def _timeout_error(self, key: tuple[int, ...], rnd: _Round) -> _Error:
        missing = [r for r in key if r not in rnd.calls]
        call, x = next(iter(rnd.calls.values()))
        states = "; ".join(self._state(r) for r in missing)
        return (
            CollectiveTimeoutError,
            f"{call.describe(x)} over ranks {key}: ranks {missing} did not arrive within "
            f"{self.timeout} s ({states})",
            None,
        )

    def _check_stuck(self) -> None:
        # Every rank still running waits in a round that lacks a member: nothing can move.
        stuck = [r for r, rnd in self._waiting.items() if not rnd.complete]
        if not stuck or len(stuck) + len(self._returned) < self.size:
            return
        states = "; ".join(self._state(r) for r in range(self.size))
        error: _Error = (
            CollectiveMismatchError,
            f"ranks entered collectives that can never complete: {states}",
            None,
        )
        for key, rnd in list(self._open.items()):
            self._fail_round(key, rnd, error)

    # --- rank lifecycle (called by run_threads) --------------------------------------------
    def finish(self, rank: int) -> None:
        with self._cond:
            if not self._returned:
                self._first_return = (rank, time.monotonic())
            self._returned.add(rank)
            self._ended.add(rank)
            self._check_stuck()
            self._cond.notify_all()

    def abort(self, rank: int | None, exc: BaseException) -> None:
        """Record the first failure and release every rank waiting in a collective."""
        with self._cond:
            if rank is not None:
                self._ended.add(rank)
            if self.failure is None:
                self.failure = (rank, exc)
                who = f"rank {rank}" if rank is not None else "the launching thread"
                for key, rnd in list(self._open.items()):
                    call, x = next(iter(rnd.calls.values()))
                    message = (
                        f"{call.describe(x)} over ranks {key} abandoned because {who} failed: "
                        f"{type(exc).__name__}: {exc}"
                    )
                    self._fail_round(key, rnd, (RankFailedError, message, rank))
            self._cond.notify_all()

    def join(self, grace: float) -> list[int]:
        """Wait until every rank ended, or ``grace`` seconds after a failure, or ``grace``
        seconds after the first rank returned (the others then fail: a rank that loops without
        a collective cannot hold the launch forever); the ranks left."""
        with self._cond:
            deadline = None
            while len(self._ended) < self.size:
                if self.failure is not None and deadline is None:
                    deadline = time.monotonic() + grace
                first = self._first_return
                if self.failure is None and first is not None:
                    late = first[1] + grace - time.monotonic()
                    if late <= 0:
                        left = [r for r in range(self.size) if r not in self._ended]
                        self.failure = (
                            left[0],
                            TimeoutError(
                                f"ranks {left} were still running {grace} s after rank "
                                f"{first[0]} returned (the launch's timeout); a rank that "
                                f"loops without calling a collective never meets the others"
                            ),
                        )
                        return left
                    self._cond.wait(late)
                    continue
                left_s = None if deadline is None else deadline - time.monotonic()
                if left_s is not None and left_s <= 0:
                    break
                self._cond.wait(left_s)
            return [r for r in range(self.size) if r not in self._ended]


class _Deferred:
    """A collective started on the threads backend: it runs when first waited for."""

    def __init__(self, world: ThreadWorld, rank: int, call: Call, x: torch.Tensor) -> None:
        self.world, self.rank, self.call, self.x = world, rank, call, x

    def wait(self) -> torch.Tensor:
        return self.world.collective(self.rank, self.call, self.x)


class _Sent:
    """A completed send: the threads backend copies the message when it is sent."""

    def wait(self) -> None:
        return None


class _Receive:
    """A posted receive: the message is taken from the mailbox when waited for."""

    def __init__(self, world: ThreadWorld, rank: int, src: int, *args: Any) -> None:
        self.world, self.rank, self.src, self.args = world, rank, src, args

    def wait(self) -> torch.Tensor:
        shape, dtype, tag, device = self.args
        x = self.world.take(self.rank, self.src, shape, dtype, tag)
        return x if device is None else x.to(device)


def _mismatch(
    key: tuple[int, ...], calls: Mapping[int, tuple[Call, torch.Tensor]]
) -> _Error | None:
    # (all_to_all_v's rows differ from rank to rank: only the shape of a row must agree)
    sigs = {(c, tuple(x.shape[c.op == "all_to_all_v" :]), x.dtype) for c, x in calls.values()}
    if len(sigs) == 1:
        return None
    lines = "; ".join(f"rank {r} called {c.describe(x)}" for r, (c, x) in sorted(calls.items()))
    return (
        CollectiveMismatchError,
        f"ranks {key} entered different collectives: {lines}",
        None,
    )


def run_threads(fn: Callable[[Mesh], Any], shape: Mapping[str, int], timeout: float) -> list[Any]:
    """Run ``fn(mesh)`` on one thread per rank; the results in rank order."""
    size = Mesh(shape).size
    world = ThreadWorld(size, timeout)
    results: list[Any] = [None] * size

    def body(rank: int) -> None:
        mesh = Mesh(shape, rank, world=world)
        try:
            with core.context(mesh):
                results[rank] = fn(mesh)
        except BaseException as e:
            world.abort(rank, e)
        else:
            world.finish(rank)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"colfunc-rank-{r}", daemon=True)
        for r in range(size)
    ]
    try:
        for t in threads:
            t.start()
        left = world.join(grace=timeout)
    except BaseException as e:  # e.g. KeyboardInterrupt: release the ranks, then re-raise
        world.abort(None, e)
        raise
    # a rank has ended once it reported, but its thread still unwinds (frames, tensors freed in
    # C++): wait for that, so that a process exiting right after the launch (a CLI error) never
    # tears down the runtime under a rank thread still inside torch (an abort, exit 134)
    for r, t in enumerate(threads):
        if r not in left:
            t.join(timeout=max(timeout, 1.0))
    if world.failure is not None:
        rank, exc = world.failure
        hung = (
            f"; ranks {left} did not stop within {timeout} s and were left running" if left else ""
        )
        raise RankFailedError(
            f"rank {rank} failed: {type(exc).__name__}: {exc}{hung}", rank=rank
        ) from exc
    return results
