"""An offloaded step's state on one rank: its chunks in host memory, the device pool that
holds what is fetched or homed, and the gradients written home (see :mod:`colfunc.transforms.offload`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, tree
from colfunc.memory.chunks import ChunkLayout, piece_of
from colfunc.memory.placement import device_budget
from colfunc.memory.pool import DevicePool, Mirror
from colfunc.transforms.local import (
    rewrap,
)

if TYPE_CHECKING:
    from colfunc.transforms.offload.transform import OffloadConfig

    pass

PyTree = Any


def pool_device() -> torch.device:
    """The device the pool stands for: the GPU, else the CPU (meta in a dry run)."""
    if core.innermost(core.DryRun) is not None:
        return torch.device("meta")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_device() -> torch.device:
    """Where host-homed chunks live: the CPU (meta in a dry run)."""
    return torch.device("meta") if core.innermost(core.DryRun) is not None else torch.device("cpu")


def _first_fraction(sizes: list[int], fraction: float) -> set[int]:
    """The leading indices of ``sizes`` whose total is at most ``fraction`` of the sum."""
    total, out, acc = sum(sizes), set(), 0
    for i, s in enumerate(sizes):
        if acc + s > fraction * total + 1e-9 * total:
            break
        acc += s
        out.add(i)
    return out


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
        trainable: Callable[[str], bool] | None = None,
    ) -> None:
        self.cfg, self.layout = cfg, layout
        self.device = pool_device()
        real = torch.device("cpu") if self.device.type == "meta" else self.device
        self.budget = device_budget(cfg.device_budget, real, whole=cfg.policy == "device")
        flat, self.treedef = tree.flatten_with_paths(params)
        self.paths = [path for path, _ in flat]
        self.dtypes = [x.dtype for _, x in flat]  # the masters' (amp computes on copies)
        # which leaves train (``train_step(trainable=...)``): a frozen one is fetched for the
        # passes, but its views need no gradient, it has no host gradient row and no update
        self.trains = [
            x.is_floating_point() and (trainable is None or trainable(path)) for path, x in flat
        ]
        self.frozen = trainable is not None
        # the "device" policy's in-memory step makes its own gradients
        host = cfg.policy != "device"
        self.grads: list[torch.Tensor | None] = (
            [
                torch.zeros_like(x, device=host_device(), memory_format=torch.contiguous_format)
                if t
                else None
                for (_, x), t in zip(flat, self.trains)
            ]
            if host
            else []
        )
        if self.device.type == "cuda":
            self.grads = [g.pin_memory() if g is not None else None for g in self.grads]
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
        # the expert weights fetched when routed to (chunked per expert; see offload.experts)
        self.routed = frozenset(
            p.leaf for c in layout.chunks if c.expert is not None for p in c.pieces
        )
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
        """A tree of local pieces (shaped like the parameters, or like the trainable ones) as
        the tensor-parallel tensors they are pieces of."""
        if not any(t is not None for t in self.templates):
            return pieces
        template = dict(zip(self.paths, self.templates))
        return tree.map_with_path(
            lambda path, x: x if template[path] is None else rewrap(template[path], x), pieces
        )

    def by_leaf(self, states: PyTree) -> list[Any]:
        """The leaves of a tree shaped like the trainable parameters (an optimizer's moments),
        one per parameter leaf: None for a frozen one."""
        got = dict(tree.flatten_with_paths(states)[0])
        return [got.get(path) for path in self.paths]

    def grad_rows(self) -> list[torch.Tensor]:
        """This step's gradients where they live: the host rows of the trained leaves, then
        the device-homed chunks' mirrors (a frozen leaf has none)."""
        homed = [m.grad for m in self.pool.mirrors.values()]
        return [g for g in self.grads if g is not None] + homed

    def grad_pieces(self) -> tuple[list[torch.Tensor], list[int]]:
        """:meth:`grad_rows` with each device-homed mirror cut into its pieces, and the leaf
        each belongs to (expert parallelism reduces expert weights apart)."""
        rows = [(g, k) for k, g in enumerate(self.grads) if g is not None]
        for c, m in self.pool.mirrors.items():
            for p in self.layout.chunks[c].pieces:
                rows.append((m.grad[p.offset : p.offset + p.numel], p.leaf))
        return [g for g, _ in rows], [k for _, k in rows]

    def trained_grads(self) -> PyTree:
        """The host gradients as a tree: every leaf's, or the trainable leaves' only."""
        if not self.frozen:
            return tree.unflatten(self.treedef, self.grads)
        got = {p: g for p, g in zip(self.paths, self.grads) if g is not None}
        part = tree.subset(tree.unflatten(self.treedef, self.paths), got.__contains__)
        return tree.map_with_path(lambda path, _: got[path], part)

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
        grads = [g for g in self.grads if g is not None]
        return grads + [t for m in self.pool.mirrors.values() for t in m.tensors()]

    # --- chunks ---------------------------------------------------------------------------
    @staticmethod
    def _row(leaves: list[Any], piece: Any) -> torch.Tensor:
        return piece_of(leaves, piece)

    def chunk_trains(self, c: int) -> bool:
        """Whether chunk ``c`` holds a piece of a trainable leaf (its fetch has a backward)."""
        return any(self.trains[p.leaf] for p in self.layout.chunks[c].pieces)

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
                    if (chunk.index, j) in self._written or not self.trains[p.leaf]:
                        continue
                    if mirror is not None:
                        mirror.grad[p.offset : p.offset + p.numel].zero_()
                    else:
                        self._row(self.grads, p).zero_()
        self._written.clear()

    def unscale(self, scale: float) -> None:
        """Divide this step's gradients (host rows, device-homed mirrors) by ``scale``: the loss
        scale the backward pass was seeded with (``amp``'s), in the masters' dtype."""
        with DevicePool.host(), torch.no_grad():
            for g in self.grads:
                if g is not None:
                    g.div_(scale)
        with torch.no_grad():
            for m in self.pool.mirrors.values():
                m.grad.div_(scale)

    def __repr__(self) -> str:
        return (
            f"OffloadState(policy={self.cfg.policy!r}, budget={self.budget}, "
            f"chunks={len(self.layout.chunks)}, device_homed={len(self.pool.mirrors)})"
        )


def offload_state(extra: dict[str, Any]) -> OffloadState:
    state = extra.get("offload")
    if not isinstance(state, OffloadState):
        raise ValueError(
            "offload: the state has no 'offload' entry; make it with this step's init (step.init)"
        )
    return state
