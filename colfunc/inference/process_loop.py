"""The engine in a process of its own beside the HTTP server (:class:`ProcessLoop`).

:class:`~colfunc.inference.loop.EngineLoop` steps the engine on a thread of the server's
process, where the scheduler, the sampler and the detokenizer share one GIL with the HTTP
parsing, the JSON and the streamed chunks of every request in flight: under load each waits for
the other. Here the engine runs in a child process (started by ``spawn``, which builds it from a
picklable ``build`` function: a model loaded from its folder there, not sent over), as vLLM's
engine core does. Requests go to it over a pipe, and each step's outputs, the engine's counters
and the requests it has taken come back in one message, which a reader thread of the server
hands to each request's asyncio queue. The server sees the same interface as the thread's loop:
:meth:`submit`, :meth:`abort`, :meth:`stop`, :meth:`alive`, ``failure``, ``metrics`` and
``engine``, here a :class:`Front` holding what the API needs of the engine (its tokenizer,
vocabulary, context and adapters' names, sent by the child once it is built).

A child that fails (an exception, or killed) fails every request in flight and every one after,
as the thread's loop does; :meth:`stop` asks the child to end and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from colfunc.inference.engine import Engine, encode_prompt
from colfunc.inference.loop import QueueFull, _Metrics, _Stream, apply
from colfunc.inference.sampling import SamplingParams

__all__ = ["Front", "ProcessLoop"]

BAD_INPUT = ("ValueError", "TypeError", "FileNotFoundError", "OSError", "KVMemoryError")
READY_TIMEOUT_S = 1800.0  # building the engine (a large folder read from disk) may take long


class _Config:
    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len


class Front:
    """What the API side needs of an engine that runs elsewhere: ``tokenizer``, ``vocab``,
    ``cfg.max_seq_len``, ``loras`` and :meth:`encode_prompt` (the engine's check)."""

    def __init__(self, tokenizer: Any, vocab: int, max_seq_len: int, loras: list[str]) -> None:
        self.tokenizer, self.vocab, self.loras = tokenizer, vocab, loras
        self.cfg = _Config(max_seq_len)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.vocab, self.cfg.max_seq_len, prompt)


def _child(build: Callable[[], Engine], inbox: Connection, outbox: Connection) -> None:
    """The child's loop: build the engine, say what the front needs, then take commands and
    step while there is work, sending each step's outputs back."""
    try:
        engine = build()
    except (EOFError, BrokenPipeError):  # the server is gone
        return
    except BaseException as e:  # (said by the server: bad input in one line)
        outbox.send(("failed", type(e).__name__, str(e)))
        if type(e).__name__ not in BAD_INPUT:
            traceback.print_exc()
        sys.exit(1)
    try:
        front = (engine.tokenizer, engine.vocab, engine.cfg.max_seq_len, engine.loras)
        outbox.send(("ready", front))
        while True:
            busy = engine.has_unfinished()
            taken = 0
            if inbox.poll(0 if busy else 0.5):
                while inbox.poll():
                    msg = inbox.recv()
                    if msg is None:
                        return
                    apply(engine, msg)
                    taken += msg[0] == "add"
            if engine.has_unfinished():
                outbox.send(("step", engine.step(), engine.stats(), taken))
            elif taken or busy:  # (aborted to nothing: the counters and the takings still told)
                outbox.send(("step", [], engine.stats(), taken))
    except (EOFError, BrokenPipeError):  # the server is gone
        return
    except BaseException as e:  # reported to every request from now on, and in the log
        outbox.send(("failed", type(e).__name__, str(e)))
        traceback.print_exc()
        sys.exit(1)


class ProcessLoop:
    """Runs the engine ``build()`` returns in a child process; the interface of
    :class:`~colfunc.inference.loop.EngineLoop` (``max_waiting``: a request submitted while that
    many wait gets :class:`~colfunc.inference.loop.QueueFull`). Blocks until the engine is built
    (a failure to build raises ``RuntimeError`` with the child's error)."""

    def __init__(self, build: Callable[[], Engine], max_waiting: int = 256) -> None:
        self.max_waiting = max_waiting
        self.metrics = _Metrics()
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()  # the pipe's sending end and the counts below
        self.pending = 0  # submitted, not yet taken by the engine
        self.waiting = 0  # the engine's waiting requests, at its last step
        self.failure: BaseException | None = None
        self.done = threading.Event()
        ctx = multiprocessing.get_context("spawn")
        self._to_child, inbox = ctx.Pipe(duplex=False)[::-1]
        outbox, self._from_child = ctx.Pipe(duplex=False)[::-1]
        self.process = ctx.Process(
            target=_child, args=(build, inbox, outbox), name="colfunc-engine", daemon=True
        )
        self.process.start()
        inbox.close()
        outbox.close()
        self.engine = self._ready()
        self.reader = threading.Thread(target=self._read, name="colfunc-engine-out", daemon=True)
        self.reader.start()

    def _ready(self) -> Front:
        if not self._from_child.poll(READY_TIMEOUT_S):
            self.process.kill()
            raise RuntimeError(f"the engine process was not ready in {READY_TIMEOUT_S:.0f} s")
        try:
            msg = self._from_child.recv()
        except EOFError:
            msg = ("failed", "", f"it ended (exit code {self.process.exitcode})")
        if msg[0] == "ready":
            return Front(*msg[1])
        self.process.join(timeout=10)
        if msg[1] in BAD_INPUT:
            raise ValueError(msg[2])  # bad input, named by the engine: said as it said it
        raise RuntimeError(f"the engine process failed to start: {msg[1]}: {msg[2]}")

    def alive(self) -> bool:
        return self.failure is None and not self.done.is_set() and self.process.is_alive()

    def _send(self, msg: Any) -> None:
        with self.lock:
            self._to_child.send(msg)

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request (token ids); its id and the queue its outputs arrive on."""
        if self.failure is not None:
            raise RuntimeError(f"the engine stopped: {self.failure!r}")
        with self.lock:
            if self.pending + self.waiting >= self.max_waiting:
                raise QueueFull(f"{self.pending + self.waiting} requests are waiting already")
            self.pending += 1
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = _Stream(asyncio.get_running_loop(), time.monotonic())
        self.streams[rid] = stream
        self._send(("add", rid, ids, params))
        return rid, stream.queue

    def abort(self, rid: str) -> None:
        self.streams.pop(rid, None)
        if self.alive():
            with contextlib.suppress(BrokenPipeError, OSError):  # (the child is ending)
                self._send(("abort", rid))

    def stop(self) -> None:
        """Ask the child to end (the requests in flight are dropped) and wait for it."""
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._send(None)
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
        self.done.set()

    def _read(self) -> None:
        """The reader thread: each step's outputs to their requests' queues."""
        try:
            while True:
                msg = self._from_child.recv()
                if msg[0] == "failed":
                    raise RuntimeError(f"the engine failed: {msg[1]}: {msg[2]}")
                _, outs, stats, taken = msg
                with self.lock:
                    self.pending -= taken
                    self.waiting = stats["waiting"]
                self.metrics.count(stats, self.pending)
                for out in outs:
                    self.metrics.deliver(self.streams, out)
        except EOFError:
            if not self.done.is_set() and self.failure is None:
                code = self.process.exitcode
                self.failure = RuntimeError(f"the engine process ended (exit code {code})")
        except BaseException as e:
            self.failure = e
        finally:
            error = self.failure or RuntimeError("the engine process stopped")
            for rid, stream in list(self.streams.items()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
                self.streams.pop(rid, None)
            self.done.set()
