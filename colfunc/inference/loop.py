"""The engine's loop beside the HTTP server: one thread steps the engine while requests come
and go (:class:`EngineLoop`), its Prometheus metrics, and the command queue that a
tensor-parallel server's other ranks follow (:func:`follow`)."""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import prometheus_client

from colfunc.inference.engine import Engine, RequestOutput
from colfunc.inference.sampling import SamplingParams

__all__ = ["EngineLoop", "EngineStopped", "QueueFull", "apply", "follow"]


class QueueFull(Exception):
    """The waiting queue holds ``max_waiting`` requests already."""


class EngineStopped(RuntimeError):
    """The engine has failed or stopped: the server answers 500 with an OpenAI error body."""


class _Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        gauge = lambda name, doc: prometheus_client.Gauge(f"colfunc_{name}", doc, registry=r)  # noqa: E731
        count = lambda name, doc: prometheus_client.Counter(f"colfunc_{name}", doc, registry=r)  # noqa: E731
        self.running = gauge("requests_running", "Sequences being generated")
        self.waiting = gauge("requests_waiting", "Requests waiting to start")
        self.kv_usage = gauge("kv_cache_usage", "Fraction of the KV cache blocks in use")
        self.tokens = count("generation_tokens", "Tokens generated")
        self.tokens_per_s = gauge("generation_tokens_per_second", "Tokens/s over the last 5 s")
        self.ttft = prometheus_client.Histogram(
            "colfunc_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.drafts = count("spec_decode_draft_tokens", "Draft tokens proposed (speculation)")
        self.accepted = count("spec_decode_accepted_tokens", "Draft tokens accepted")
        self.acceptance = gauge("spec_decode_acceptance_rate", "Accepted over proposed drafts")
        self.seen = (0, 0)  # the engine's draft and accepted totals the counters hold
        self.recent: collections.deque[tuple[float, int]] = collections.deque()
        self.recent_sum = 0  # the tokens in `recent` (kept, not summed at every token)

    def count(self, s: dict[str, int], pending: int) -> None:
        """The gauges and counters from the engine's :meth:`~Engine.stats` (``pending``:
        requests submitted that the engine has not taken yet)."""
        self.running.set(s["running"])
        self.waiting.set(s["waiting"] + pending)
        self.kv_usage.set(s["blocks_used"] / s["blocks_total"])
        self.drafts.inc(s["draft_tokens"] - self.seen[0])  # (the engine's totals: by what is new)
        self.accepted.inc(s["accepted_tokens"] - self.seen[1])
        self.seen = (s["draft_tokens"], s["accepted_tokens"])
        if s["draft_tokens"]:
            self.acceptance.set(s["accepted_tokens"] / s["draft_tokens"])

    def deliver(self, streams: dict[str, _Stream], out: RequestOutput) -> None:
        """``out`` to its request's queue (if it is still there), counted."""
        stream = streams.get(out.request_id)
        if stream is None:
            return
        n = sum(len(o.token_ids) for o in out.outputs)
        if n > stream.tokens:
            if stream.tokens == 0:
                self.ttft.observe(time.monotonic() - stream.arrival)
            self.generated(n - stream.tokens)
            stream.tokens = n
        if out.finished:
            streams.pop(out.request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def generated(self, n: int) -> None:
        now = time.monotonic()
        self.tokens.inc(n)
        self.recent.append((now, n))
        self.recent_sum += n
        while self.recent and self.recent[0][0] < now - 5:
            self.recent_sum -= self.recent.popleft()[1]
        self.tokens_per_s.set(self.recent_sum / 5)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float) -> None:
        self.loop, self.arrival = loop, arrival
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.tokens = 0


class EngineLoop:
    """Runs ``engine``: :meth:`submit` and :meth:`abort` from any thread, outputs pushed to each
    request's asyncio queue after every step.

    It runs on a thread of its own, or (``thread=False``) on whichever thread calls :meth:`run`:
    rank 0 of a tensor-parallel engine, whose other ranks :func:`follow` it through the
    ``followers`` queues, taking the same requests in the same order and stepping with it.
    """

    def __init__(
        self,
        engine: Engine,
        max_waiting: int = 256,
        *,
        followers: Sequence[queue.SimpleQueue[Any]] = (),
        thread: bool = True,
    ) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self.followers = list(followers)
        self.metrics = _Metrics()
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()
        self.pending = 0  # submitted, not yet taken by the engine
        self.wake = threading.Event()
        self.stopping = False
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self.own = threading.Thread(target=self.run, name="colfunc-engine", daemon=True)
        if thread:
            self.own.start()

    def alive(self) -> bool:
        return self.failure is None and not self.done.is_set()

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request (token ids); its id and the queue its outputs arrive on."""
        with self.lock:
            waiting = self.pending + len(self.engine.scheduler.waiting)
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting already")
            self.pending += 1
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = _Stream(asyncio.get_running_loop(), time.monotonic())
        self.streams[rid] = stream
        self.inbox.put(("add", rid, ids, params))
        self.wake.set()
        return rid, stream.queue

    def abort(self, rid: str) -> None:
        self.streams.pop(rid, None)
        self.inbox.put(("abort", rid))
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.done.wait(timeout=30)

    def run(self) -> None:
        """The loop: take new requests and aborts, step while there is work."""
        try:
            while not self.stopping:
                msgs = []
                while True:
                    try:
                        msgs.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for msg in msgs:
                    if msg[0] == "add":
                        with self.lock:
                            self.pending -= 1
                    apply(self.engine, msg)
                busy = self.engine.has_unfinished()
                if msgs or busy:
                    for f in self.followers:
                        f.put((msgs, busy))
                if not busy:
                    self._gauges()
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
                    continue
                outs = self.engine.step()
                self._gauges()
                for out in outs:
                    self._deliver(out)
        except BaseException as e:  # the server reports it on every request from now on
            self.failure = e
            for rid, stream in list(self.streams.items()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
                self.streams.pop(rid, None)
        finally:
            for f in self.followers:
                f.put(None)
            self.done.set()

    def _gauges(self) -> None:
        self.metrics.count(self.engine.stats(), self.pending)

    def _deliver(self, out: RequestOutput) -> None:
        self.metrics.deliver(self.streams, out)


def apply(engine: Engine, msg: tuple[Any, ...]) -> None:
    """Carry out one command of the loop: ``("add", id, ids, params)`` or ``("abort", id)``."""
    if msg[0] == "add":
        engine.add_request(msg[2], msg[3], request_id=msg[1])
    else:
        engine.abort(msg[1])


def follow(engine: Engine, commands: queue.SimpleQueue[Any]) -> None:
    """Mirror rank 0's :class:`EngineLoop` on another rank of a tensor-parallel engine: the same
    commands, and a step whenever rank 0 steps (its collectives meet theirs), until None."""
    while (item := commands.get()) is not None:
        msgs, step = item
        for msg in msgs:
            apply(engine, msg)
        if step:
            engine.step()


# --- the OpenAI API ---------------------------------------------------------------------------
