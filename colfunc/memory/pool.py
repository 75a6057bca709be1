"""The device pool of an offloaded step: what is resident, what moved, and the exact peak.

Host-homed chunks (their master weights and Adam moments in host memory) are fetched to the
device as one flat buffer per chunk when a step needs their group, kept in a cache, and dropped
when evicted: a parameter copy is never dirty, since the master is on the host (gradients are
written back to the host as soon as their layer's backward pass ends, outside the cache).
Device-homed chunks live on the device for the whole run, as flat *mirrors* of parameters,
gradients and moments; the host rows of those chunks are then stale until gathered.

The account is exact. Every tensor a step allocates is seen by a dispatch mode (the one of
:func:`colfunc.memory.track`) unless it is host work, which runs out of sight of every dispatch
mode (:meth:`DevicePool.host`); so on a machine without a GPU, where the CPU stands for the
device, the pool's peak is the peak of device tensors as the budget sees them. On CUDA the
allocator's own counters are read instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from colfunc import torch_private
from colfunc.memory.chunks import Chunk, ChunkLayout, piece_of
from colfunc.memory.placement import Event, Trace, next_uses
from colfunc.memory.track import track

__all__ = ["DevicePool", "Mirror"]


class Mirror:
    """A device-homed chunk: flat parameter, gradient and Adam moment buffers on the device."""

    def __init__(self, chunk: Chunk, device: torch.device, master: torch.dtype) -> None:
        self.param = torch.zeros(chunk.capacity, dtype=chunk.dtype, device=device)
        self.grad = torch.zeros(chunk.capacity, dtype=chunk.dtype, device=device)
        self.exp_avg = torch.zeros(chunk.capacity, dtype=master, device=device)
        self.exp_avg_sq = torch.zeros(chunk.capacity, dtype=master, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.param, self.grad, self.exp_avg, self.exp_avg_sq]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class _CudaMeter:
    """Live and peak bytes from the CUDA allocator, relative to the start of the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    @property
    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class DevicePool:
    """Residency, traffic and placement of one offloaded run's chunks (see the module docs).

    ``streaming``: keep only the groups in use (and the next ``prefetch``), as ZeRO-Offload
    streams layers; otherwise cache copies under the budget and evict by Belady's rule over the
    trace recorded in the warm-up step. ``pinned``: chunks whose copy is kept for the whole step
    once fetched (a static placement).
    """

    def __init__(
        self,
        layout: ChunkLayout,
        device: torch.device,
        budget: int,
        *,
        streaming: bool,
        prefetch: int,
        pinned: frozenset[int] = frozenset(),
        compute: torch.dtype | None = None,
    ) -> None:
        self.layout, self.device, self.budget = layout, device, budget
        self.compute = compute  # amp's dtype: copies are cast to it (mirrors' too)
        self.streaming, self.prefetch, self.pinned = streaming, prefetch, pinned
        self.cache: dict[int, torch.Tensor] = {}  # chunk -> its parameter copy on the device
        self.mirrors: dict[int, Mirror] = {}
        self.in_use: dict[int, int] = {}  # group -> holders
        self.traces: dict[Any, Trace] = {}  # batch signature -> the trace its warm-up recorded
        self.trace: Trace | None = None  # the current batch signature's
        self.measuring = True  # whether this step's bytes are measured (else accounted)
        self._signature: Any = None
        # on CUDA, copies to the device run on a side stream, overlapping the compute stream;
        # a chunk's event says when its copy is done, and the compute stream waits for it
        # only when it uses the chunk
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, Any] = {}  # chunk -> the event of its copy still in flight
        self._accounted = 0
        self.extra_baseline = 0  # device bytes held outside chunks (the "device" policy's state)
        self._recording: Trace | None = None
        self._uses: list[dict[int, int]] = []
        self._cursor = 0
        self._meter: Any = None
        self._leaves: list[torch.Tensor] = []
        self.h2d = self.d2h = 0
        self.step_peak = self.window_peak = self._window_max = 0

    # --- accounting -----------------------------------------------------------------------
    @property
    def baseline(self) -> int:
        """Device bytes resident for the whole run: the mirrors (and the "device" policy's state)."""
        return self.extra_baseline + sum(m.nbytes for m in self.mirrors.values())

    @property
    def cached_bytes(self) -> int:
        return sum(self.copy_bytes(c) for c in self.cache)

    def copy_dtype(self, c: int) -> torch.dtype:
        """The dtype of chunk ``c``'s copy on the device: the compute dtype under amp."""
        dtype = self.layout.chunks[c].dtype
        return self.compute if self.compute is not None and dtype.is_floating_point else dtype

    def copy_bytes(self, c: int) -> int:
        return self.layout.chunks[c].capacity * self.copy_dtype(c).itemsize

    def select(self, signature: Any) -> None:
        """Place this step by the trace of its batch ``signature`` (shapes and dtypes); a new
        signature is recorded afresh, as a warm-up. On the CPU the step's bytes are measured
        (a dispatch mode sees every allocation) only while recording: later steps of the same
        signature allocate the same, so their peak is accounted from the trace and the pool's
        own residency, at no cost per op. On CUDA the allocator's counters are always read."""
        self._signature = signature
        self.trace = self.traces.get(signature)
        self._uses = next_uses(self.trace.groups()) if self.trace is not None else []
        self.measuring = self.trace is None or self.device.type != "cpu"

    def begin_step(self) -> None:
        """Start a step's figures (its windows add to them)."""
        self.h2d = self.d2h = 0
        self.step_peak = 0

    def metrics(self) -> dict[str, int]:
        """The step's figures, as the step reports them."""
        return {
            "offload/device_peak_bytes": self.step_peak,
            "offload/h2d_bytes": self.h2d,
            "offload/d2h_bytes": self.d2h,
        }

    @contextlib.contextmanager
    def window(
        self,
        leaves: list[torch.Tensor],
        host_tensors: list[torch.Tensor],
        *,
        record: bool,
        carried: int = 0,
        update: bool = False,
    ) -> Iterator[None]:
        """Account a part of a step (the forward-backward pass, the update): ``leaves`` are the
        parameters' host tensors (flat, in layout order), ``host_tensors`` everything else the
        step writes in place (never counted). ``record``: record the trace (the warm-up step).
        ``carried``: device bytes made before the window and alive through it (the in-memory
        step's gradients, during its update). ``update``: this window is the update."""
        self._leaves = leaves
        self._cursor = 0
        self._window_max = 0
        self._recording = Trace() if record else None
        trace = self.trace
        self._accounted = (trace.update if update else trace.head) if trace is not None else 0
        with contextlib.ExitStack() as stack:
            if not self.measuring:
                self._meter = None
            elif self.device.type == "cuda":
                self._meter = _CudaMeter(self.device)
            else:
                mirrors = [t for m in self.mirrors.values() for t in m.tensors()]
                meta = self.device.type == "meta"  # a dry run: count what it would allocate
                self._meter = stack.enter_context(track(leaves, host_tensors, mirrors, meta=meta))
            try:
                yield
            finally:
                self._close_interval()
                if self._meter is None:  # accounted: the trace's non-model peaks on top of
                    peak = self._accounted  # what the pool held at each event
                else:
                    peak = max(self._window_max, self._meter.peak)
                    if update and trace is not None and trace.update < peak:
                        trace.update = peak  # kept for the accounted steps
                self.window_peak = self.baseline + carried + peak
                self.step_peak = max(self.step_peak, self.window_peak)
                self._meter = None
                self._leaves = []

    def end_warmup(self) -> Trace | None:
        """The trace just recorded, kept for placing later steps (None if none was recording)."""
        rec, self._recording = self._recording, None
        if rec is not None:
            self.trace = self.traces[self._signature] = rec
            self._uses = next_uses(rec.groups())
        return rec

    def forget(self) -> None:
        """Drop the current signature's trace (a warm-up that did not fit: measure again)."""
        self.traces.pop(self._signature, None)
        self.trace = None

    def _close_interval(self) -> None:
        """End the interval since the last event: its non-model peak goes to the trace."""
        rec = self._recording
        if rec is None or self._meter is None:
            return
        self._window_max = max(self._window_max, self._meter.peak)
        nonmodel = max(0, self._meter.peak - self.cached_bytes)
        if rec.events:
            rec.events[-1].nonmodel = max(rec.events[-1].nonmodel, nonmodel)
        else:
            rec.head = max(rec.head, nonmodel)
        self._meter.reset_peak()

    @staticmethod
    @contextlib.contextmanager
    def host() -> Iterator[None]:
        """Run host work (writes to host memory) out of sight of every dispatch mode."""
        with torch_private.disable_current_modes():
            yield

    # --- placement ------------------------------------------------------------------------
    def _position(self, group: int, backward: bool) -> int | None:
        """This event's position in the recorded trace (resynchronising if the step diverged)."""
        if self.trace is None:
            return None
        events = self.trace.events
        n = len(events)
        for d in range(n):
            k = (self._cursor + d) % n
            if events[k].group == group and events[k].backward == backward:
                self._cursor = k + 1
                return k
        return None

    def _capacity(self, k: int | None) -> int:
        """Device bytes the cache may hold from event ``k`` to the next."""
        if k is None or self.trace is None:
            return 0  # warm-up: stream
        return self.budget - self.baseline - self.trace.events[k].nonmodel

    def _chunks(self, group: int) -> tuple[int, ...]:
        """The chunks of ``group`` that the step uses through a copy whenever it uses the group
        (its experts' are fetched apart, :meth:`require_experts`): host-homed ones, and
        device-homed ones too when amp computes in another dtype than their masters'."""
        return self._copied(self.layout.eager(group))

    def _copied(self, chunks: Sequence[int]) -> tuple[int, ...]:
        return tuple(
            c
            for c in chunks
            if c not in self.mirrors or self.copy_dtype(c) != self.mirrors[c].param.dtype
        )

    def _protected(self, group: int) -> set[int]:
        """Chunks that must stay: the groups in use, this one, the pinned ones."""
        chunks = {c for g in set(self.in_use) | {group} for c in self._chunks(g)}
        return chunks | (self.pinned & set(self.cache))

    def _soon(self, k: int | None) -> set[int]:
        """Chunks of the next ``prefetch`` groups of the trace after event ``k``."""
        if k is None or self.trace is None:
            return set()
        events = self.trace.events
        groups = {events[(k + d) % len(events)].group for d in range(1, self.prefetch + 1)}
        return {c for g in groups for c in self._chunks(g)}

    def _fetch(self, c: int) -> None:
        chunk = self.layout.chunks[c]
        dtype = self.copy_dtype(c)
        mirror = self.mirrors.get(c)
        if mirror is not None:  # a device-homed master, cast for amp: no transfer
            self.cache[c] = mirror.param.to(dtype)
            return
        with contextlib.ExitStack() as stack:
            if self.copy_stream is not None:
                stack.enter_context(torch.cuda.stream(self.copy_stream))
            buf = torch.empty(chunk.capacity, dtype=dtype, device=self.device)
            for p in chunk.pieces:
                src = piece_of(self._leaves, p)
                buf[p.offset : p.offset + p.numel].view(p.shape).copy_(src, non_blocking=True)
            if self.copy_stream is not None:
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                self.ready[c] = event
        self.h2d += chunk.used * dtype.itemsize
        self.cache[c] = buf

    def _arrived(self, c: int) -> torch.Tensor:
        """Chunk ``c``'s copy, once the compute stream has waited for it to arrive (on CUDA);
        the allocator learns that the compute stream uses it, so that freeing it waits too."""
        buf = self.cache[c]
        event = self.ready.pop(c, None)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            buf.record_stream(compute)
        return buf

    def wait_copies(self) -> None:
        """Wait for every copy in flight (before the update writes the masters they read)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.ready.clear()

    def require(self, group: int, backward: bool) -> dict[int, torch.Tensor]:
        """Make ``group`` resident (an event of the trace) and hold it; returns its chunks'
        device buffers (parameters), mirrors included."""
        self._close_interval()
        k = self._position(group, backward)
        if self._recording is not None:
            self._recording.events.append(Event(group, backward))
        keep, soon = self._protected(group), self._soon(k)
        missing = [c for c in self._chunks(group) if c not in self.cache]
        need = sum(self.copy_bytes(c) for c in missing)
        uses = self._uses[k] if k is not None else {}

        def farthest_first(cs: list[int]) -> list[int]:
            return sorted(
                cs, key=lambda c: uses.get(self.layout.chunks[c].group, 1 << 60), reverse=True
            )

        evictable = [c for c in self.cache if c not in keep]
        if self.streaming or k is None:  # drop all but what is about to be used
            for c in evictable:
                if c not in soon:
                    del self.cache[c]
            evictable = [c for c in evictable if c in soon]
        # then, while over the capacity, the copies used farthest ahead (Belady); prefetched
        # ones too, if the activations grew since they came
        capacity = self._capacity(k)
        for c in farthest_first(evictable):
            if self.cached_bytes + need <= capacity:
                break
            del self.cache[c]
        for c in missing:
            self._fetch(c)
        if k is not None and self.trace is not None:
            self._prefetch(k)
            self._accounted = max(
                self._accounted, self.cached_bytes + self.trace.events[k].nonmodel
            )
        self.in_use[group] = self.in_use.get(group, 0) + 1
        return {
            c: self._arrived(c) if c in self.cache else self.mirrors[c].param
            for c in self.layout.eager(group)
        }

    def require_experts(self, chunks: Sequence[int]) -> dict[int, torch.Tensor]:
        """Copies of ``chunks`` (some experts' of the layer in use, those its tokens are routed
        to) for the moment: fetched now, never cached (the caller copies them out), so their
        bytes are the interval's non-model memory, which the warm-up's trace records and the
        capacity of each later event leaves room for. Device-homed ones are their mirrors."""
        copied = set(self._copied(chunks))
        out: dict[int, torch.Tensor] = {}
        for c in chunks:
            if c not in copied:
                out[c] = self.mirrors[c].param
                continue
            self._fetch(c)
            out[c] = self._arrived(c)
            del self.cache[c]
        return out

    def _prefetch(self, k: int) -> None:
        assert self.trace is not None
        events = self.trace.events
        capacity = self._capacity(k)
        for d in range(1, self.prefetch + 1):
            group = events[(k + d) % len(events)].group
            for c in self._chunks(group):
                size = self.copy_bytes(c)
                if c not in self.cache and self.cached_bytes + size <= capacity:
                    self._fetch(c)

    def release(self, group: int) -> None:
        """Stop holding ``group`` (its chunks become evictable)."""
        n = self.in_use.get(group, 0) - 1
        if n > 0:
            self.in_use[group] = n
        else:
            self.in_use.pop(group, None)

    def invalidate(self) -> None:
        """Drop every cached copy (the update changed the masters they copy)."""
        self.ready.clear()
        self.cache.clear()
        self.in_use.clear()
