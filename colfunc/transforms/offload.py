"""``offload``: heterogeneous memory, model states in chunks under a device budget (Gemini).

The parameters are cut into fixed-size chunks in layer order (:mod:`colfunc.memory.chunks`).
A *host-homed* chunk keeps its parameters (the fp32 masters), gradients and Adam moments in host
memory: :func:`colfunc.scan_layers` fetches a layer's chunks to the device just before the layer
runs, its backward pass fetches them again if they were evicted (saved-tensor hooks stand in for
the weights the backward pass keeps, as ZeRO-3's gathers do), its gradients go back to the host
as soon as the layer's backward pass ends, and the update runs there, by the C++ CPU Adam
(:func:`colfunc.ops.cpu_adamw_`). A *device-homed* chunk lives on the device for the whole run
and is updated there by the fused AdamW (:func:`colfunc.ops.adamw_`). The leaves outside the
stacked layers (group 0: embeddings, final norm) are fetched once, at the start of the step.
Under ``amp`` each fetched copy is cast to the compute dtype (device-homed masters too), so the
device holds compute-dtype weights and the fp32 masters stay where they live.

Policies:

``"device"``
    everything on the device: the in-memory step, with the account kept (the reference).
``"host"``
    every chunk host-homed, each layer streamed in and dropped after use (ZeRO-Offload).
``"static"``
    the first ``1 - offload_optim`` of the chunks (by bytes, in layer order) device-homed, and
    the parameter copies of the first ``1 - offload_params`` kept on the device for the whole
    step once fetched; the rest streamed.
``"auto"``
    the first step records which groups the step uses, in which order, and the non-model memory
    (activations, gradients in flight) the device needs between each use and the next
    (:class:`~colfunc.memory.placement.Trace`). From then on each fetch keeps the device within
    the budget by evicting the cached copies whose next use is farthest away, and fetches the
    next ``prefetch`` groups ahead when they fit; ``margin`` of the memory the warm-up left
    spare holds device-homed chunks, whose update then runs on the device.

On CUDA the host chunks are pinned, each copy to the device runs on a side stream (so a
prefetched layer arrives while the layers before it compute) and records an event, and the
compute stream waits for that event only when it first uses the chunk; the update waits for
the copies in flight before it writes the masters they read. Gradients go home synchronously.

On a machine without a GPU the CPU stands for the device: the same code runs, copies are copies
within one memory, and the account of device bytes is exact, so the budget can be checked: the
first step of each batch shape is measured by a dispatch mode that sees every allocation, and the
later ones, which allocate the same, are accounted from that trace and the pool's residency (on
CUDA the allocator's counters are read on every step).
Each step's metrics carry ``offload/device_peak_bytes`` (the device pool's peak, model states
included), ``offload/h2d_bytes`` and ``offload/d2h_bytes``.

Over data parallelism each rank offloads its own part of the model states:

- data-parallel ``shard`` (no tensor-parallel plan), or ``zero`` stage 0: each rank offloads its
  replica, steps on its rows of the batch (when ``shard`` splits it), and the gradients are
  averaged over the data-parallel axis in place, in host memory and in the device-homed
  mirrors, before the update;
- ``zero`` stages 1 and 2 (ZeRO-Offload): the parameters are streamed from each rank's replica
  as above (the whole parameters and gradients stay in its host memory), but the averaged
  gradients are reduce-scattered, so each rank keeps only its chunk of the Adam moments and
  updates (by the CPU Adam) only its chunk of the parameters; the new chunks are all-gathered
  into the replicas. Chunks cannot be device-homed here (their optimizer state is cut by rank):
  use ``margin=0`` and ``offload_optim=1``, or stage 3;
- ``zero`` stage 3 (Gemini over data parallelism): each rank's host holds only its ZeRO chunks
  of every parameter, offload chunks those, and a layer's fetched chunks are all-gathered on the
  device into the whole layer just before it runs (group 0 once per step); the gather's
  backward reduce-scatters the gradients, so each rank writes home only its chunks' gradients,
  and updates only them (device-homed chunks included). The backward pass keeps tokens instead
  of the gathered weights, and fetches and gathers a layer again when it needs it.

Over tensor-parallel ``shard`` (a 1D plan, with or without the above) each rank offloads its
local pieces: a fetched piece is wrapped back as the ShardedTensor it is a piece of, so the
propagation rules run as in memory, and its gradient comes home in the parameter's placement
(a Partial sum reduced first); the gradient norm adds the pieces' squares over the axes that
split them. Sequence parallelism and the 2D/2.5D/3D modes are refused.

The state is updated in place (an offloaded step donates its state, see
:func:`colfunc.train_step`): the state passed in must not be used again. The host rows of
device-homed chunks are stale while they live on the device; :func:`colfunc.full_state` writes
them back first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, ops, torch_private, tree
from colfunc.memory.chunks import ChunkLayout, chunk_layout
from colfunc.memory.placement import device_budget
from colfunc.memory.pool import DevicePool, Mirror
from colfunc.optim.adam import AdamState
from colfunc.optim.base import learning_rate
from colfunc.random import Abstract
from colfunc.sharding import Mesh, ShardedTensor, comm, current_mesh, from_local
from colfunc.step import Step, TrainState, check_loss
from colfunc.transforms.buckets import all_reduce_buckets
from colfunc.transforms.chunks import (
    Gathered,
    StartedGather,
    as_chunk,
    by_rank,
    cut_chunk,
    layer_of,
    mesh_axes,
    reduce_scatter_flat,
    whole,
)
from colfunc.transforms.composition import apply_transform
from colfunc.transforms.layer_gather import restored, saved_piece, start_gather
from colfunc.transforms.local import (
    as_full,
    axes_reduction,
    local_piece,
    rewrap,
    sharded_axes,
    to_local,
)
from colfunc.transforms.shard import split_batch

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition
    from colfunc.transforms.zero import ZeroLayout

__all__ = ["POLICIES", "OffloadConfig", "OffloadState", "offload"]

PyTree = Any
POLICIES = ("device", "host", "static", "auto")


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload: {name} must be a fraction in [0, 1], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """The arguments of :func:`offload`, checked."""

    policy: str = "auto"
    device_budget: int | float | str | None = None
    margin: float = 0.0
    prefetch: int = 1
    chunk_mb: float | None = None
    offload_params: float | None = None
    offload_optim: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"offload: unknown policy {self.policy!r}; use one of {POLICIES}")
        _fraction("margin", self.margin)
        if self.margin and self.policy != "auto":
            raise ValueError(f"offload: margin is for policy='auto', not {self.policy!r}")
        if (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or self.prefetch < 0
        ):
            raise ValueError(f"offload: prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.chunk_mb is not None and (
            isinstance(self.chunk_mb, bool)
            or not isinstance(self.chunk_mb, int | float)
            or not self.chunk_mb > 0
        ):
            raise ValueError(
                f"offload: chunk_mb must be a number > 0 or None, got {self.chunk_mb!r}"
            )
        given = {
            n: v for n in ("offload_params", "offload_optim") if (v := getattr(self, n)) is not None
        }
        if given and self.policy != "static":
            raise ValueError(
                f"offload: {', '.join(given)} are for policy='static', not {self.policy!r}"
            )
        for name, value in given.items():
            _fraction(name, value)
        if self.params_fraction > self.optim_fraction:
            raise ValueError(
                f"offload: offload_params={self.params_fraction} exceeds offload_optim="
                f"{self.optim_fraction}: a chunk whose optimizer runs on the device keeps its "
                f"master weights there, so at most offload_optim of the parameters can be offloaded"
            )
        # refuse a bad budget when built (a dry run names the budget it plans for)
        device_budget(
            self.device_budget, torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )

    @property
    def params_fraction(self) -> float:
        return 0.0 if self.offload_params is None else float(self.offload_params)

    @property
    def optim_fraction(self) -> float:
        return 0.0 if self.offload_optim is None else float(self.offload_optim)

    def build(self, step: Step, comp: Composition) -> Step:
        # amp, built around offload, computes in its dtype: the fetches cast each chunk to it
        compute = comp.amp.dtype if comp.amp is not None and comp.offload_fetches else None
        compute = compute if isinstance(compute, torch.dtype) else None
        # data parallel beneath: shard (without a plan) splits the batch, zero (if any) says how
        # the gradients are reduced and what each rank keeps
        axis = comp.zero.axis if comp.zero is not None else comp.batch_axis
        dp = None
        if axis is not None:
            stage = comp.zero.stage if comp.zero is not None else None
            dp = _DataParallel(comp.mesh, comp.batch_axis, axis, stage)
        # tensor parallel beneath: each rank offloads its local pieces, which the fetches wrap
        # back as the tensor-parallel parameters they are
        tp = comp.mesh if comp.shard is not None and comp.shard.plan else None
        return _build(step, self, compute, dp, tp)


@dataclasses.dataclass(frozen=True)
class _DataParallel:
    """The data parallelism beneath an offloaded step (see the module docs)."""

    bound: Mesh | None  # the mesh shard bound (None: the current mesh, inside cf.launch)
    split: str | None  # the axis shard splits the batch over (None: every rank the whole batch)
    axis: str  # the axis the gradients are averaged over
    stage: int | None  # the zero stage beneath (None: data-parallel shard alone)

    @property
    def mesh(self) -> Mesh:
        return self.bound if self.bound is not None else current_mesh()

    @property
    def cuts_optimizer(self) -> bool:
        """ZeRO stages 1-2: whole parameters, optimizer states in chunks by rank."""
        return self.stage in (1, 2)


def _device() -> torch.device:
    """The device the pool stands for: the GPU, else the CPU (meta in a dry run)."""
    if core.innermost(core.DryRun) is not None:
        return torch.device("meta")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host() -> torch.device:
    """Where host-homed chunks live: the CPU (meta in a dry run)."""
    return torch.device("meta") if core.innermost(core.DryRun) is not None else torch.device("cpu")


class OffloadState:
    """``state.extra["offload"]``: the chunks, where each lives, the host gradient buffers and
    the device pool. A :class:`~colfunc.step.StateLayout`: gathering writes the device-homed
    chunks back to their host rows."""

    def __init__(
        self,
        cfg: OffloadConfig,
        params: PyTree,
        layout: ChunkLayout,
        compute: torch.dtype | None = None,
    ) -> None:
        self.cfg, self.layout = cfg, layout
        self.device = _device()
        real = torch.device("cpu") if self.device.type == "meta" else self.device
        self.budget = device_budget(cfg.device_budget, real)
        flat, self.treedef = tree.flatten_with_paths(params)
        self.dtypes = [x.dtype for _, x in flat]  # the masters' (amp computes on copies)
        # the "device" policy's in-memory step makes its own gradients
        host = cfg.policy != "device"
        self.grads = [torch.zeros_like(x, device=_host()) for _, x in flat] if host else []
        if self.device.type == "cuda":
            self.grads = [g.pin_memory() for g in self.grads]
        sizes = [c.nbytes for c in layout.chunks]
        homed = (
            _first_fraction(sizes, 1.0 - cfg.optim_fraction) if cfg.policy == "static" else set()
        )
        pinned = (
            _first_fraction(sizes, 1.0 - cfg.params_fraction) if cfg.policy == "static" else set()
        )
        self.to_home: set[int] = homed  # chunks to keep on the device (mirrors made on first use)
        self.pool = DevicePool(
            layout,
            self.device,
            self.budget,
            streaming=cfg.policy != "auto",
            prefetch=cfg.prefetch,
            pinned=frozenset(pinned - homed),
            compute=compute,
        )
        self.block_leaves = [k for k, s in enumerate(layout.stacked) if s]
        # tensor parallel: each leaf's ShardedTensor (meta) the local piece in host memory is
        # of (None: a plain tensor); whether the optimizer states are shaped like the pieces
        self.templates: list[Any] = [None] * len(flat)
        self.states_like_params = True
        self._host: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
        self._written: set[tuple[int, int]] = set()  # (chunk, piece) gradients written this step
        self._needs_moments: set[int] = set()

    # --- StateLayout --------------------------------------------------------------------
    def sync_host(self) -> None:
        """Copy every device-homed chunk's parameters and moments back to its host rows."""
        if self._host is None:
            return
        with DevicePool.host(), torch.no_grad():
            for c, m in self.pool.mirrors.items():
                for p in self.layout.chunks[c].pieces:
                    for host, flat in zip(self._host, (m.param, m.exp_avg, m.exp_avg_sq)):
                        self._row(host, p).copy_(flat[p.offset : p.offset + p.numel].view(p.shape))

    def wrap(self, pieces: PyTree) -> PyTree:
        """A tree of local pieces (shaped like the parameters) as the tensor-parallel tensors
        they are pieces of."""
        if not any(t is not None for t in self.templates):
            return pieces
        leaves = tree.leaves(pieces)
        wrapped = [x if t is None else rewrap(t, x) for t, x in zip(self.templates, leaves)]
        return tree.unflatten(self.treedef, wrapped)

    def gather_params(self, params: PyTree) -> PyTree:
        self.sync_host()
        return self.wrap(params)

    def gather_opt(self, states: PyTree) -> PyTree:
        self.sync_host()
        return self.wrap(states) if self.states_like_params else states

    def place_opt(self, states: PyTree) -> PyTree:
        return states  # host rows are the layout; mirrors are made from them on first use

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this state owns (host gradients, device mirrors): pass them to
        :func:`colfunc.memory.track` as pre-existing to measure what a step allocates."""
        return self.grads + [t for m in self.pool.mirrors.values() for t in m.tensors()]

    # --- chunks ---------------------------------------------------------------------------
    @staticmethod
    def _row(leaves: list[torch.Tensor], piece: Any) -> torch.Tensor:
        x = leaves[piece.leaf]
        return x if piece.row is None else x[piece.row]

    def make_mirrors(self, leaves: list[torch.Tensor]) -> None:
        """Device-home the chunks chosen for the device and not yet homed: parameters copied now, moments at the
        next update (before the step's account starts, so they count as resident)."""
        for c in sorted(self.to_home - set(self.pool.mirrors)):
            chunk = self.layout.chunks[c]
            master = torch.float64 if chunk.dtype == torch.float64 else torch.float32
            m = Mirror(chunk, self.device, master)
            with torch.no_grad():
                for p in chunk.pieces:
                    m.param[p.offset : p.offset + p.numel].view(p.shape).copy_(self._row(leaves, p))
            self.pool.h2d += chunk.used * chunk.dtype.itemsize
            self.pool.mirrors[c] = m
            self.pool.cache.pop(c, None)
            self._needs_moments.add(c)

    def write_grad(self, c: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Layer gradients of chunk ``c`` (one per piece): to its host rows, or its mirror."""
        chunk = self.layout.chunks[c]
        mirror = self.pool.mirrors.get(c)
        for j, (p, g) in enumerate(zip(chunk.pieces, grads)):
            if g is None:
                continue
            first = (c, j) not in self._written
            self._written.add((c, j))
            if mirror is not None:
                dst = mirror.grad[p.offset : p.offset + p.numel].view(p.shape)
                dst.copy_(g) if first else dst.add_(g)
                continue
            with DevicePool.host():
                dst = self._row(self.grads, p)
                dst.copy_(g) if first else dst.add_(g.to(dst.device))
            self.pool.d2h += g.numel() * g.element_size()

    def zero_unwritten(self) -> None:
        """Zero the gradients no layer wrote this step (parameters the loss did not use)."""
        with DevicePool.host(), torch.no_grad():
            for chunk in self.layout.chunks:
                mirror = self.pool.mirrors.get(chunk.index)
                for j, p in enumerate(chunk.pieces):
                    if (chunk.index, j) in self._written:
                        continue
                    if mirror is not None:
                        mirror.grad[p.offset : p.offset + p.numel].zero_()
                    else:
                        self._row(self.grads, p).zero_()
        self._written.clear()

    def __repr__(self) -> str:
        return (
            f"OffloadState(policy={self.cfg.policy!r}, budget={self.budget}, "
            f"chunks={len(self.layout.chunks)}, device_homed={len(self.pool.mirrors)})"
        )


def _first_fraction(sizes: list[int], fraction: float) -> set[int]:
    """The leading indices of ``sizes`` whose total is at most ``fraction`` of the sum."""
    total, out, acc = sum(sizes), set(), 0
    for i, s in enumerate(sizes):
        if acc + s > fraction * total + 1e-9 * total:
            break
        acc += s
        out.add(i)
    return out


class _Holder:
    """A chunk's device buffer as the fetch node sees it (a non-tensor argument, so that the
    node's outputs are views of a tensor it did not receive)."""

    def __init__(self, state: OffloadState, c: int, buf: torch.Tensor) -> None:
        self.state, self.c = state, c
        self.buf: torch.Tensor | None = buf


class _Fetch(torch.autograd.Function):
    """A chunk's tensors, as views of its device buffer; the backward pass writes their
    gradients to the chunk's home and ends the layer's hold on the device."""

    @staticmethod
    def forward(
        holder: _Holder, frame: _Streaming, token: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        chunk = holder.state.layout.chunks[holder.c]
        buf, holder.buf = holder.buf, None  # the node must not keep the chunk alive
        assert buf is not None
        return tuple(buf[p.offset : p.offset + p.numel].view(p.shape) for p in chunk.pieces)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.holder, ctx.frame = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        holder: _Holder = ctx.holder
        holder.state.write_grad(holder.c, grads)
        ctx.frame.chunk_done(holder.state.layout.chunks[holder.c].group)
        return None, None, None


class _Regathered:
    """Group ``g``'s buffers, fetched again on first use in the backward pass (and, under ZeRO-3,
    gathered again into the layer's whole weights)."""

    def __init__(self, frame: _Streaming, group: int) -> None:
        self.frame, self.group = frame, group
        self.bufs: dict[int, torch.Tensor] | None = None
        self.flats: list[torch.Tensor] | None = None

    def get(self, c: int) -> torch.Tensor:
        if self.bufs is None:
            self.bufs = self.frame.require(self.group, backward=True)
            self.frame.regathered[self.group] = self
        return self.bufs[c]

    def flat(self, k: int) -> torch.Tensor:
        """The ``k``-th gathered flat of this layer (no autograd: the backward pass reads it)."""
        if self.flats is None:
            c0 = self.frame.state.layout.groups[self.group][0]
            self.get(c0)
            assert self.bufs is not None
            views = self.frame.plain_views(self.group, self.bufs)
            i = self.group - 1
            self.flats = self.frame.start(
                [views[(k, i)] for k in self.frame.state.block_leaves]
            ).wait()
        return self.flats[k]

    def drop(self) -> None:
        self.bufs = self.flats = None


def _where(t: torch.Tensor) -> tuple[int, int]:
    return id(t.untyped_storage()), int(t.storage_offset())


def _wrapped(template: Any, piece: torch.Tensor, row: bool) -> torch.Tensor:
    """``piece`` as the tensor-parallel tensor ``template`` (one layer of it if ``row``) it is
    this rank's piece of, differentiably; ``piece`` itself without a template."""
    if template is None:
        return piece
    if row:
        return layer_of(template, piece)
    return from_local(piece, template.mesh, template.placements, tuple(template.shape))


class _Streaming:
    """Context frame of an offloaded step: fetch each scanned layer's chunks (a
    :class:`~colfunc.core.ScanInterceptor`) and hold group 0 for the whole step. Under ZeRO-3
    (``zero``) the fetched chunks are this rank's ZeRO chunks, all-gathered into whole weights;
    under tensor parallelism they are local pieces, wrapped back as the ShardedTensors they are
    pieces of (differentiably: a Partial gradient is reduced to the parameter's placements)."""

    def __init__(
        self,
        state: OffloadState,
        leaves: list[torch.Tensor],
        token: torch.Tensor | None,
        zero: ZeroLayout | None = None,
    ) -> None:
        self.state, self.leaves, self.token, self.zero = state, leaves, token, zero
        self.metas = tree.leaves(zero.metas) if zero is not None else []
        self.pool = state.pool
        self.pending: dict[int, int] = {}  # group -> chunks whose gradients are still due
        self.held_backward: set[int] = set()
        self.regathered: dict[int, _Regathered] = {}
        first = state.block_leaves[0] if state.block_leaves else None
        rows = leaves[first].unbind(0) if first is not None else ()
        # rows are known by storage and offset, not address: meta tensors (a dry run) all have
        # address 0, and a storage keeps one Python object for its whole life
        self.layer_index = {_where(r): i for i, r in enumerate(rows)}

    def require(self, group: int, backward: bool) -> dict[int, torch.Tensor]:
        bufs = self.pool.require(group, backward)
        if backward:
            self.held_backward.add(group)
        return bufs

    def chunk_done(self, group: int) -> None:
        """One chunk of ``group`` has its gradients: at the last, release the backward hold."""
        left = self.pending.get(group, 0) - 1
        if left > 0:
            self.pending[group] = left
            return
        self.pending.pop(group, None)
        if group in self.held_backward:
            self.held_backward.discard(group)
            self.pool.release(group)
            holder = self.regathered.pop(group, None)
            if holder is not None:
                holder.drop()

    def plain_views(
        self, group: int, bufs: dict[int, torch.Tensor]
    ) -> dict[tuple[int, int | None], torch.Tensor]:
        """(leaf, row) -> a view of the fetched buffer (no autograd)."""
        out: dict[tuple[int, int | None], torch.Tensor] = {}
        for c in self.state.layout.groups[group]:
            for p in self.state.layout.chunks[c].pieces:
                out[(p.leaf, p.row)] = bufs[c][p.offset : p.offset + p.numel].view(p.shape)
        return out

    def views(
        self, group: int, bufs: dict[int, torch.Tensor]
    ) -> dict[tuple[int, int | None], torch.Tensor]:
        """(leaf, row) -> the tensor the model sees: fetch nodes when gradients are wanted."""
        grad = self.token is not None and torch.is_grad_enabled()
        if not grad:
            return self.plain_views(group, bufs)
        out: dict[tuple[int, int | None], torch.Tensor] = {}
        for c in self.state.layout.groups[group]:
            chunk = self.state.layout.chunks[c]
            ts = _Fetch.apply(_Holder(self.state, c, bufs[c]), self, self.token)
            for p, t in zip(chunk.pieces, ts):
                out[(p.leaf, p.row)] = t
        if not torch_private.in_backward():
            self.pending[group] = len(self.state.layout.groups[group])
        return out

    # --- ZeRO-3: gathering the fetched chunks ------------------------------------------------
    def start(self, chunks: list[torch.Tensor]) -> StartedGather:
        """All-gather ``chunks`` over the ZeRO axis, started as ZeRO-3's own gathers are."""
        z = self.zero
        assert z is not None
        return start_gather(chunks, z.axis, z.mesh)

    def gather(self, keys: list[int], chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flats of ``chunks`` (leaves ``keys``) gathered, differentiably when they need
        gradients: the backward pass reduce-scatters (sums) the gradients onto the chunks."""
        z = self.zero
        assert z is not None
        if torch.is_grad_enabled() and any(c.requires_grad for c in chunks):
            return list(Gathered.apply(self.start(chunks), z.axis, z.mesh, *chunks))
        return self.start(chunks).wait()

    def wrap(self, k: int, piece: torch.Tensor, row: bool) -> torch.Tensor:
        """Leaf ``k``'s fetched local piece (one layer's row of it if ``row``) as the
        tensor-parallel tensor it is a piece of."""
        return _wrapped(self.state.templates[k], piece, row)

    def whole(self, k: int, flat: torch.Tensor, row: bool) -> torch.Tensor:
        """Leaf ``k``'s gathered ZeRO-3 flat (one layer's if ``row``) as the parameter,
        differentiably (a tensor-parallel one wrapped back as its ShardedTensor)."""
        meta = self.metas[k]
        local = whole(flat, dataclasses.replace(meta, template=None), stacked_layer=row)
        return _wrapped(meta.template, local, row)

    def outer(self) -> dict[int, torch.Tensor]:
        """Group 0's leaves on the device, held until the step ends."""
        bufs = self.require(0, backward=False)
        views = {leaf: self.wrap(leaf, t, False) for (leaf, _), t in self.views(0, bufs).items()}
        if self.zero is None or not views:
            return views
        keys = sorted(views)
        flats = self.gather(keys, [views[k] for k in keys])
        return {k: self.whole(k, f, False) for k, f in zip(keys, flats)}

    def scan_layers(self, block: Any, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Any) -> Any:
        state = self.state

        def fetched(layer_rows: PyTree, c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            flat, treedef = tree.flatten_with_paths(layer_rows)
            i = self.layer_index.get(_where(flat[0][1])) if flat else None
            if i is None or len(flat) != len(state.block_leaves):
                raise ValueError(
                    "offload: scan_layers ran over a tree that is not the step's params['blocks']; "
                    "an offloaded loss must scan exactly its stacked layers (cf.layered)"
                )
            group, backward = 1 + i, torch_private.in_backward()
            bufs = self.require(group, backward)
            views = self.views(group, bufs)
            rows = [self.wrap(k, views[(k, i)], True) for k in state.block_leaves]
            flats: list[torch.Tensor] = []
            if self.zero is not None:
                flats = self.gather(state.block_leaves, rows)
                rows = [self.whole(k, f, True) for f, k in zip(flats, state.block_leaves)]
            layer = tree.unflatten(treedef, rows)
            try:
                if (
                    not torch.is_grad_enabled()
                    or self.token is None
                    or torch_private.saving_hooks_active()
                ):
                    # inference, or inside a checkpoint (remat): that drops the weights after the
                    # forward pass and fetches them again when it recomputes the layer
                    return block(layer, c, x)
                with torch.autograd.graph.saved_tensors_hooks(*self._hooks(group, bufs, flats)):
                    return block(layer, c, x)
            finally:
                if not backward:
                    self.pool.release(group)

        return inner(fetched, carry, blocks, xs)

    def _hooks(
        self, group: int, bufs: dict[int, torch.Tensor], flats: list[torch.Tensor]
    ) -> tuple[Any, Any]:
        # the backward pass keeps, instead of a cached chunk's views (or, under ZeRO-3, of the
        # layer's gathered weights), a token that fetches (and gathers) the chunk again; mirrors
        # stay on the device: kept as they are
        storages: dict[int, tuple[bool, int]] = {
            id(b.untyped_storage()): (False, c)
            for c, b in bufs.items()
            if c not in self.pool.mirrors or b is not self.pool.mirrors[c].param
        }
        storages.update({id(f.untyped_storage()): (True, k) for k, f in enumerate(flats)})
        again = _Regathered(self, group)

        def pack(t: torch.Tensor) -> Any:
            local, wrap = saved_piece(t)  # a tensor-parallel weight is known by its piece
            where = (
                storages.get(id(local.untyped_storage())) if type(local) is torch.Tensor else None
            )
            if where is None:
                return t
            return (again, where, local.size(), local.stride(), local.storage_offset(), wrap)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            holder, (gathered, k), size, stride, offset, wrap = packed
            src = holder.flat(k) if gathered else holder.get(k)
            return restored(src.as_strided(size, stride, offset), wrap)

        return pack, unpack


def _build(
    step: Step,
    cfg: OffloadConfig,
    compute: torch.dtype | None = None,
    dp: _DataParallel | None = None,
    tp: Mesh | None = None,
) -> Step:
    if cfg.policy == "device":
        return _build_device(step, cfg)
    loss_fn, optimizer = step.loss_fn, step.optimizer
    hyper = optimizer.adamw
    homes_device = cfg.margin > 0 or (cfg.policy == "static" and cfg.optim_fraction < 1.0)
    if homes_device and hyper is None:
        raise ValueError(
            "offload: chunks homed on the device (margin > 0, or static offload_optim < 1) are "
            "updated by the fused AdamW kernels, which need optim.adamw (plain, no amsgrad) as "
            f"the optimizer; got {optimizer!r:.80}; use margin=0 / offload_optim=1 otherwise"
        )
    if homes_device and dp is not None and dp.cuts_optimizer:
        raise ValueError(
            f"offload: chunks homed on the device (margin > 0, or static offload_optim < 1) keep "
            f"their whole optimizer state there, which zero stage {dp.stage} cuts by rank; use "
            f"margin=0 and offload_optim=1 with stages 1-2, or zero stage 3 (each rank homes its "
            f"own chunks)"
        )
    gathers = dp is not None and dp.stage == 3  # each rank's host holds its ZeRO-3 chunks
    inner_init_extra, inner_update, inner_layout = step.init_extra, step.update, step.layout
    chunk_size_of = None if cfg.chunk_mb is None else cfg.chunk_mb

    def init_extra(params: PyTree) -> dict[str, Any]:
        extra = dict(inner_init_extra(params))
        # what each rank keeps of each parameter (its tensor-parallel piece, or its ZeRO-3
        # chunk of that), from the layout beneath, on the meta device
        placed = inner_layout(_meta(params))
        templates = [x if isinstance(x, ShardedTensor) else None for x in tree.leaves(placed)]
        params = to_local(placed)
        size = None
        if chunk_size_of is not None:
            itemsize = max(x.element_size() for x in tree.tensors(params))
            size = int(chunk_size_of * 2**20) // itemsize
        layout = chunk_layout(params, size)
        state = OffloadState(cfg, params, layout, compute)
        state.templates = templates
        state.states_like_params = dp is None or not dp.cuts_optimizer
        _check_floor(state, extra["zero"].mesh.axis_size(extra["zero"].axis) if gathers else 1)
        extra["offload"] = state
        return extra

    def layout(params: PyTree) -> PyTree:
        where = _host()

        def home(x: Any) -> Any:  # an abstract parameter is made here, straight into host memory
            if isinstance(x, Abstract):
                meta = where.type == "meta"
                x = torch.empty(x.shape, dtype=x.dtype, device="meta") if meta else x.materialize()
            # a tensor-parallel parameter's local piece (the fetches wrap it back)
            return local_piece(x).detach().to(where) if isinstance(x, torch.Tensor) else x

        # the layout beneath (zero-3 keeps this rank's chunks; an abstract parameter is made
        # there, one at a time, and only its chunk kept) and each piece moved home
        host = tree.map(home, inner_layout(params))
        if _device().type == "cuda":  # pinned, so that copies to the GPU can be asynchronous
            host = tree.map(lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x, host)
        return host

    def run(
        params: PyTree, batch: PyTree, extra: dict[str, Any], grad: bool
    ) -> tuple[torch.Tensor, PyTree]:
        state: OffloadState = _state(extra)
        leaves = tree.leaves(params)
        if grad:
            state.pool.begin_step()
            state.make_mirrors(leaves)
        if dp is not None and dp.split is not None:
            batch = split_batch(batch, dp.split, dp.mesh)
        token = torch.zeros((), requires_grad=True) if grad else None
        frame = _Streaming(state, leaves, token, extra["zero"] if gathers else None)
        state.pool.select(tuple((tuple(x.shape), x.dtype) for x in tree.tensors(batch)))
        record = grad and state.pool.trace is None
        with state.pool.window(leaves, state.tensors(), record=record), core.context(frame):
            outer = frame.outer()
            given = [outer[k] if k in outer else x.detach() for k, x in enumerate(leaves)]
            with torch.enable_grad() if grad else torch.no_grad():
                loss = loss_fn(tree.unflatten(state.treedef, given), batch)
                check_loss(loss)
                if grad:
                    scale = core.loss_scale()
                    target = loss if scale == 1.0 else loss * scale
                    assert token is not None
                    torch.autograd.grad(target, [token], allow_unused=True)
            state.pool.release(0)
            if grad:
                state.zero_unwritten()
                if dp is not None:
                    _average(state, dp)
        if record:
            _check_warmup(state)
        loss = loss.detach()
        loss = as_full(loss)  # a tensor-parallel loss, replicated
        if dp is not None and dp.split is not None:
            loss = comm.all_reduce(loss, dp.split, op="avg", mesh=dp.mesh)
        return loss, (tree.unflatten(state.treedef, state.grads) if grad else None)

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        return run(params, batch, extra, grad=True)

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        return run(params, batch, extra, grad=False)[0]

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        off = _state(state.extra)
        off.pool.wait_copies()  # no copy in flight reads a master the update writes
        host = off.tensors() + tree.tensors(state.opt_state)
        with off.pool.window(tree.leaves(state.params), host, record=False, update=True):
            if core.innermost(core.DryRun) is not None:
                new_state, info = _dry_update(state)
            elif dp is not None and dp.cuts_optimizer:  # ZeRO 1-2: this rank's chunks
                new_state, info = _zero_update(state, dp, hyper, inner_update)
            elif hyper is not None:
                z = state.extra["zero"] if gathers else None
                new_state, info = _adamw_update(off, hyper, state, _norm_axes(off, z, tp))
            else:  # any other optimizer: the update on the host (no chunk is device-homed),
                # on tensor-parallel gradients, so that a clip sees their global norm
                with DevicePool.host():
                    new_state, info = inner_update(off.wrap(grads), state)
                new_state = _pieces(new_state)
        off.pool.invalidate()
        return new_state, {**info, **off.pool.metrics()}

    def sync(grads: PyTree) -> PyTree:
        return grads  # averaged over the data-parallel axis in the forward-backward pass

    return step.replace(
        layout=layout,
        init_extra=init_extra,
        forward=forward,
        forward_backward=forward_backward,
        sync=sync,
        update=update,
        donate=True,
    )


def _average(state: OffloadState, dp: _DataParallel) -> None:
    """Average the step's gradients over the data-parallel axis where they live, in place (host
    rows, device-homed mirrors). ZeRO-3's arrive summed over the ranks by the gathers'
    backward; ZeRO 1-2 reduce-scatter theirs in the update."""
    n = dp.mesh.axis_size(dp.axis)
    if n == 1:
        return
    homed = [m.grad for m in state.pool.mirrors.values()]
    xs = state.grads + homed
    with DevicePool.host(), torch.no_grad():
        if dp.stage == 3:
            for x in xs:
                x.div_(n)
        elif not dp.cuts_optimizer:
            for x, r in zip(xs, all_reduce_buckets(xs, dp.axis, dp.mesh), strict=True):
                x.copy_(r)


def _meta(params: PyTree) -> PyTree:
    """``params`` as meta tensors (shapes and dtypes, nothing made)."""
    return tree.map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, params
    )


def _zero_update(
    state: TrainState, dp: _DataParallel, hyper: Any, inner_update: Any
) -> tuple[TrainState, dict[str, Any]]:
    """ZeRO 1-2 under offload: the whole host gradients reduce-scattered, so each rank holds
    the averaged chunks it owns; the CPU Adam updates those chunks of the masters with this
    rank's chunks of the moments, and the new chunks are all-gathered into the host replicas
    (in place: the pool reads them). Another optimizer runs zero's own update, on the host."""
    off, z = _state(state.extra), state.extra["zero"]
    n, i = z.mesh.axis_size(z.axis), z.mesh.axis_index(z.axis)
    flat, treedef = tree.flatten_with_paths(state.params)
    metas = tree.leaves(z.metas)
    with DevicePool.host(), torch.no_grad():
        stacked = [m.stacked for m in metas]
        pieces = reduce_scatter_flat(
            [by_rank(g, st, n) for g, st in zip(off.grads, stacked)], z.axis, z.mesh, "avg"
        )
        grads = [as_chunk(p, g, st) for p, g, st in zip(pieces, off.grads, stacked)]
        if hyper is None:
            new_state, info = inner_update(tree.unflatten(treedef, grads), state)
            return _pieces(new_state), info
        opt = state.opt_state
        if not isinstance(opt, AdamState):
            raise TypeError(
                f"offload: expected the AdamState of optim.adamw, got {type(opt).__name__}"
            )
        chunks = [cut_chunk(x, n, i, st)[0] for (_, x), st in zip(flat, stacked)]
        t, lr = opt.step + 1, learning_rate(hyper.lr, opt.step)
        squares = [g.double().square().sum() for g in grads]
        norm = _reduced_norm(squares, _norm_axes(off, z, None))
        h = _adamw_hyper(hyper, t, lr)
        _host_adamw(chunks, grads, tree.leaves(opt.exp_avg), tree.leaves(opt.exp_avg_sq), h)
        new = tree.leaves(z.gather_chunks(tree.unflatten(treedef, chunks)))
        for (_, x), y in zip(flat, new, strict=True):
            x.copy_(local_piece(y))  # (a tensor-parallel piece comes back wrapped)
    new_opt = AdamState(t, opt.exp_avg, opt.exp_avg_sq, None)
    return state._replace(opt_state=new_opt), {"grad_norm": norm, "lr": lr}


def _adamw_hyper(hyper: Any, t: int, lr: float) -> ops.AdamWHyper:
    """Update ``t``'s hyperparameters, from the optimizer's (``optim.adamw``'s) and its rate."""
    return ops.AdamWHyper(
        step=t,
        lr=lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        eps=hyper.eps,
        weight_decay=hyper.weight_decay,
    )


def _host_adamw(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    h: ops.AdamWHyper,
) -> None:
    """AdamW on host tensors, in place: the C++ CPU Adam for fp32 masters, torch's fused kernel
    for fp64 ones (the C++ Adam is fp32)."""
    if not ps:
        return
    if all(x.dtype == torch.float32 for x in ps):
        ops.cpu_adamw_(ps, gs, ms, vs, h)
        return
    steps = [torch.tensor(float(h.step))] * len(ps)  # read only by the kernel
    torch_private.fused_adamw_(
        ps,
        gs,
        ms,
        vs,
        [],
        steps,
        amsgrad=False,
        maximize=False,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        eps=h.eps,
        weight_decay=h.weight_decay,
    )


def _dry_update(state: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """A dry run's update (cf.memory.predict): no values, so nothing to update."""
    return state, {"grad_norm": torch.zeros((), device="meta"), "lr": 0.0}


def _state(extra: dict[str, Any]) -> OffloadState:
    state = extra.get("offload")
    if not isinstance(state, OffloadState):
        raise ValueError(
            "offload: the state has no 'offload' entry; make it with this step's init (step.init)"
        )
    return state


def _check_floor(state: OffloadState, gathered: int = 1) -> None:
    """Refuse, before running, a budget that cannot hold group 0 and the largest layer with
    their gradients (the least any step needs, activations aside). Under ZeRO-3 over
    ``gathered`` ranks the chunks are this rank's pieces, and the layer's backward pass also
    holds group 0's and the layer's gathered weights and the layer's whole gradients."""
    layout, pool = state.layout, state.pool

    def copies(g: int) -> int:  # a group's copy on the device (in the compute dtype under amp)
        return sum(pool.copy_bytes(c) for c in layout.groups[g])

    largest = max((copies(g) for g in range(1, len(layout.groups))), default=0)
    outer = copies(0)
    if gathered > 1:
        floor = (1 + gathered) * outer + (1 + 2 * gathered) * largest
        what = "this rank's pieces and the gathered weights of the leaves outside the layers"
        what += " and of the largest layer, with that layer's gradients"
    else:
        floor = 2 * (outer + largest)
        what = "the parameters and gradients of the leaves outside the layers and of the largest"
        what += " layer"
    if state.budget < floor:
        raise ValueError(
            f"offload: device_budget {state.budget} B is below the smallest feasible budget: "
            f"at least {floor} B ({what}) plus the activations; raise it to >= {floor} B"
        )


def _check_warmup(state: OffloadState) -> None:
    """After the warm-up step: refuse a budget its streaming peak exceeded; home chunks on the
    device in ``margin`` of the room left."""
    pool = state.pool
    peak = pool.window_peak
    pool.end_warmup()
    if peak > state.budget:
        pool.forget()  # measure again next time
        raise ValueError(
            f"offload: device_budget {state.budget} B is below the smallest feasible budget "
            f"{peak} B for this step (measured: the largest layer's working set with its "
            f"activations, streamed one layer at a time); raise it to >= {peak} B, or add "
            f"cf.remat to shrink the activations"
        )
    if state.cfg.margin <= 0:
        return
    spare = state.cfg.margin * (state.budget - peak)
    used = 0
    # device-home layers from the first (the ones a cache cannot keep from the forward pass
    # to the backward pass), then group 0
    order = [c for g in [*range(1, len(state.layout.groups)), 0] for c in state.layout.groups[g]]
    for c in order:
        chunk = state.layout.chunks[c]
        master = 8 if chunk.dtype == torch.float64 else 4
        cost = chunk.capacity * (2 * chunk.dtype.itemsize + 2 * master)
        cost += pool.copy_bytes(c) if pool.copy_dtype(c) != chunk.dtype else 0  # amp's cast
        if used + cost > spare:
            break
        used += cost
        state.to_home.add(c)


def _pieces(state: TrainState) -> TrainState:
    """``state`` with its parameters and optimizer states as this rank's local pieces (an
    inner update may hand back tensor-parallel tensors)."""
    return state._replace(params=to_local(state.params), opt_state=to_local(state.opt_state))


NormAxes = tuple[list[tuple[str, ...]], Mesh] | None


def _norm_axes(off: OffloadState, z: ZeroLayout | None, tp: Mesh | None) -> NormAxes:
    """Per leaf, the mesh axes over which its pieces partition it (None: every rank holds the
    whole of every leaf): a ZeRO-3 chunk's axis and its tensor-parallel axes, or those alone."""
    if z is not None:
        metas = tree.leaves(z.metas)
        return [mesh_axes(z.mesh, {z.axis, *sharded_axes(m.template)}) for m in metas], z.mesh
    if tp is not None:
        return [sharded_axes(t) if t is not None else () for t in off.templates], tp
    return None


def _reduced_norm(squares: list[torch.Tensor], axes: NormAxes) -> torch.Tensor:
    """The global norm from per-leaf squared norms of this rank's pieces."""
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    if axes is None:
        total = torch.stack(squares).sum()
    else:
        total = axes_reduction(*axes).reduce(squares)
    return total.sqrt().to(torch.float32)


def _grad_norm(off: OffloadState, axes: NormAxes) -> torch.Tensor:
    """The global gradient norm, from this rank's gradients where they live (host rows,
    device-homed mirrors), in fp64."""
    groups: dict[bool, tuple[list[torch.Tensor], list[int]]] = {False: ([], []), True: ([], [])}
    for chunk in off.layout.chunks:
        mirror = off.pool.mirrors.get(chunk.index)
        parts, leaves = groups[mirror is not None]
        for p in chunk.pieces:
            g = (
                off._row(off.grads, p)
                if mirror is None
                else mirror.grad[p.offset : p.offset + p.numel]
            )
            parts.append(g)
            leaves.append(p.leaf)
    squares = [torch.zeros((), dtype=torch.float64) for _ in off.templates]
    for parts, leaves in groups.values():
        if parts:
            norms = torch_private.foreach_norm(parts, 2.0, dtype=torch.float64)
            for k, n in zip(leaves, norms):
                squares[k] = squares[k] + n.cpu().square()
    return _reduced_norm(squares, axes)


def _adamw_update(
    off: OffloadState, hyper: Any, state: TrainState, axes: NormAxes = None
) -> tuple[TrainState, dict[str, Any]]:
    """AdamW where each chunk lives: host chunks by the CPU Adam, mirrors by the fused one.
    ``axes``: how this rank's pieces add up to the global gradient norm (ZeRO-3 chunks,
    tensor-parallel pieces)."""
    opt = state.opt_state
    if not isinstance(opt, AdamState):
        raise TypeError(f"offload: expected the AdamState of optim.adamw, got {type(opt).__name__}")
    ps, ms, vs = tree.leaves(state.params), tree.leaves(opt.exp_avg), tree.leaves(opt.exp_avg_sq)
    off._host = (ps, ms, vs)
    t, lr = opt.step + 1, learning_rate(hyper.lr, opt.step)
    h = _adamw_hyper(hyper, t, lr)
    mirrors = off.pool.mirrors
    for c in sorted(off._needs_moments):  # moments of chunks just device-homed
        m = mirrors[c]
        for p in off.layout.chunks[c].pieces:
            for flat, host in ((m.exp_avg, ms), (m.exp_avg_sq, vs)):
                flat[p.offset : p.offset + p.numel].view(p.shape).copy_(off._row(host, p))
        off.pool.h2d += 2 * off.layout.chunks[c].used * m.exp_avg.element_size()
    off._needs_moments.clear()
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for chunk in off.layout.chunks:
        if chunk.index in mirrors:
            continue
        for p in chunk.pieces:
            for out, src in zip(lists, (ps, off.grads, ms, vs)):
                out.append(off._row(src, p))
    with DevicePool.host():
        norm = _grad_norm(off, axes)
        _host_adamw(lists[0], lists[1], lists[2], lists[3], h)
    if mirrors:
        order = sorted(mirrors)
        ops.adamw_(
            [mirrors[c].param for c in order],
            [mirrors[c].grad for c in order],
            [mirrors[c].exp_avg for c in order],
            [mirrors[c].exp_avg_sq for c in order],
            h,
        )
    new_opt = AdamState(t, opt.exp_avg, opt.exp_avg_sq, None)
    return state._replace(opt_state=new_opt), {"grad_norm": norm, "lr": lr}


def _cast_bytes(state: OffloadState, leaves: list[torch.Tensor]) -> int:
    """Bytes of the parameters handed to the "device" policy's pass that are not the masters
    but copies in another dtype (``amp``'s casts, made before the pass): resident through it."""
    return sum(
        local_piece(x).numel() * x.element_size()
        for x, d in zip(leaves, state.dtypes, strict=True)
        if isinstance(x, torch.Tensor) and x.dtype != d
    )


def _build_device(step: Step, cfg: OffloadConfig) -> Step:
    """The "device" policy: the in-memory step, its device bytes accounted."""
    inner_init_extra, inner_layout = step.init_extra, step.layout
    inner_fb, inner_fwd, inner_update = step.forward_backward, step.forward, step.update

    def layout(params: PyTree) -> PyTree:
        device = _device()
        placed = inner_layout(params)

        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

        return tree.map(move, placed)

    def init_extra(params: PyTree) -> dict[str, Any]:
        extra = dict(inner_init_extra(params))
        state = OffloadState(cfg, params, chunk_layout(params))
        # the model states resident for the whole run: the parameters as placed (a ZeRO-3
        # rank's chunks) and the optimizer's state (sized on the meta device, without making it)
        meta = to_local(inner_layout(_meta(params)))  # as placed on this rank
        state.pool.extra_baseline = tree.size_bytes(meta) + tree.size_bytes(step.init_opt(meta))
        extra["offload"] = state
        return extra

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        state = _state(extra)
        state.pool.begin_step()
        leaves = tree.leaves(params)
        with state.pool.window(leaves, [], record=False, carried=_cast_bytes(state, leaves)):
            return inner_fb(params, batch, extra)

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        state = _state(extra)
        leaves = tree.leaves(params)
        with state.pool.window(leaves, [], record=False, carried=_cast_bytes(state, leaves)):
            return inner_fwd(params, batch, extra)

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        pool = _state(state.extra).pool
        # the gradients (made in the step, perhaps widened since by amp) are held through the
        # update: counted once, whole storages, as carried, and not again when it reads them
        pieces = (local_piece(g).untyped_storage() for g in tree.tensors(grads))
        storages = {id(s): s.nbytes() for s in pieces}
        carried = sum(storages.values())
        held = tree.tensors(state.opt_state) + tree.tensors(grads)
        with pool.window(tree.leaves(state.params), held, record=False, carried=carried):
            if core.innermost(core.DryRun) is not None:
                new_state, info = _dry_update(state)
            else:
                new_state, info = inner_update(grads, state)
        return new_state, {**info, **pool.metrics()}

    return step.replace(
        layout=layout,
        init_extra=init_extra,
        forward_backward=forward_backward,
        forward=forward,
        update=update,
    )


def offload(
    step: Step,
    policy: str = "auto",
    device_budget: int | float | str | None = None,
    *,
    margin: float = 0.0,
    prefetch: int = 1,
    chunk_mb: float | None = None,
    offload_params: float | None = None,
    offload_optim: float | None = None,
) -> Step:
    """Keep ``step``'s model states in chunks that move between device and host memory within
    ``device_budget``; see the module docs for the policies.

    ``device_budget``: bytes, a string such as ``"2GiB"``, or a fraction of the device's memory
    (required without a GPU, where the CPU stands for the device). ``margin`` (``"auto"``): the
    fraction of the memory the warm-up step leaves spare that holds device-homed chunks
    (ColossalAI's ``gpu_margin_mem_ratio``). ``prefetch``: groups fetched ahead of their use.
    ``chunk_mb``: the chunk size (None: searched for the least waste). ``offload_params`` and
    ``offload_optim`` (``"static"``): the fractions of parameters and optimizer states in host
    memory.

    Example:
        >>> step = cf.offload(cf.train_step(loss, optim.adamw(3e-4)), "auto", "2GiB", margin=0.8)
    """
    if not isinstance(step, Step):
        raise TypeError(f"offload: expected a Step (from cf.train_step), got {type(step).__name__}")
    config = OffloadConfig(
        policy=policy,
        device_budget=device_budget,
        margin=margin,
        prefetch=prefetch,
        chunk_mb=chunk_mb,
        offload_params=offload_params,
        offload_optim=offload_optim,
    )
    return apply_transform(step, "offload", config)
