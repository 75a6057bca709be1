"""Long-context sequence parallelism: the sequence split over a mesh axis of its own.

``cf.shard(step, mesh, sequence_parallel=MODE)`` with ``MODE`` one of:

- ``"megatron"`` (or ``True``): Megatron-LM's, on the tensor-parallel axis (in :mod:`shard`).
- ``"ulysses"`` (DeepSpeed-Ulysses, Jacobs et al. 2023): around attention, one all-to-all turns
  the queries, keys and values from sequence shards into head shards, every rank attends over the
  whole sequence for its heads, and one all-to-all turns the output back: two all-to-alls per
  layer forward (q, k and v together; out), two backward; the axis must divide the heads and
  key/value heads.
- ``"ring"`` (Liu et al. 2023): each rank keeps its queries; the key/value blocks travel round
  the ring by ``ppermute``, each block's partial attention merged into the output by its
  log-sum-exp; the backward sends them round again with their gradients. The next block's
  transfer is started before the current block is computed, so on torch.distributed it overlaps.
- ``"zigzag"``: ring attention with the sequence cut into ``2P`` chunks, rank ``r`` holding
  chunks ``r`` and ``2P-1-r``, so that under a causal mask every rank has the same work
  (a contiguous split gives the last rank ``2P-1`` times the first one's).
- ``"usp"`` (Fang and Zhao 2024): Ulysses inside ring, over two axes (``sp = ring x ulysses``):
  for head counts Ulysses alone cannot split.

The batch's sequence dims are split over the axis (:attr:`colfunc.core.Layered.batch_sequence_dims`)
before the model runs, so the embedding, the norms, the MLPs and the loss all run on the local
shard: the model is the unchanged single-device one over ShardedTensors, and only attention (a
:class:`~colfunc.core.AttentionInterceptor` frame) talks across the axis. Positions
(:func:`colfunc.core.positions`) say which position each stored index holds, so position
embeddings, rotary tables and the label shift are right across shard boundaries and under zigzag's
reordering; the loss's mean counts the labels of every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from colfunc import tree
from colfunc.core import SplitSequence
from colfunc.ops import dispatch
from colfunc.sharding import Mesh, ShardedTensor, comm, distribute, from_local
from colfunc.sharding.placement import Placement, Replicate, Shard

__all__ = [
    "LONG_MODES",
    "MODES",
    "CarrySplitter",
    "LongSequence",
    "SequenceLayout",
    "attention_work",
    "ring_attention",
    "ulysses_attention",
    "zigzag_order",
]

PyTree = Any
MODES = ("megatron", "ulysses", "ring", "zigzag", "usp")
LONG_MODES = ("ulysses", "ring", "zigzag", "usp")  # the modes on a sequence axis of their own
_DEFAULT_AXES: dict[str, str | tuple[str, str]] = {
    "ulysses": "sp",
    "ring": "sp",
    "zigzag": "sp",
    "usp": ("sp_ring", "sp_ulysses"),
}


def default_axes(mode: str) -> str | tuple[str, str]:
    """The mesh axes a mode splits the sequence over unless told otherwise."""
    return _DEFAULT_AXES[mode]


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How a long-context mode splits the sequence: over ``ring_axis`` (ring, zigzag), over
    ``ulysses_axis`` (ulysses) or both (usp, the ring axis major)."""

    mode: str
    mesh: Mesh
    ring_axis: str | None = None
    ulysses_axis: str | None = None

    @classmethod
    def make(cls, mode: str, mesh: Mesh, axis: str | tuple[str, ...] | None) -> SequenceLayout:
        """The layout of ``mode`` on ``mesh``; ValueError for a missing or misordered axis."""
        if mode not in LONG_MODES:
            raise ValueError(
                f"shard: sequence_parallel={mode!r} is not one of {MODES} (or True for 'megatron')"
            )
        axes = default_axes(mode) if axis is None else axis
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        want = 2 if mode == "usp" else 1
        if len(names) != want or not all(isinstance(a, str) for a in names):
            form = "two axis names (ring, ulysses)" if mode == "usp" else "one axis name"
            raise ValueError(
                f"shard: sequence_parallel={mode!r} takes {form} as sequence_axis, got {axes!r}"
            )
        missing = [a for a in names if a not in mesh.axis_names]
        if missing:
            example = {"dp": 1, **{a: 2 for a in names}}
            raise ValueError(
                f"shard: sequence_parallel={mode!r} splits the sequence over the mesh axis "
                f"{missing[0]!r}, which the mesh {mesh.shape} lacks; add it (e.g. "
                f"mesh={example}) or name an existing axis with sequence_axis="
            )
        if mode == "usp":
            ring, uly = names
            if mesh.axis_names.index(ring) > mesh.axis_names.index(uly):
                raise ValueError(
                    f"shard: sequence_parallel='usp' needs the ring axis {ring!r} before the "
                    f"ulysses axis {uly!r} in the mesh (the ring splits the sequence first); the "
                    f"mesh's axes are {mesh.axis_names}"
                )
            return cls(mode, mesh, ring_axis=ring, ulysses_axis=uly)
        if mode == "ulysses":
            return cls(mode, mesh, ulysses_axis=names[0])
        return cls(mode, mesh, ring_axis=names[0])

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes that split the sequence, in mesh order (major first)."""
        return tuple(a for a in (self.ring_axis, self.ulysses_axis) if a is not None)

    @property
    def size(self) -> int:
        return math.prod(self.mesh.axis_size(a) for a in self.axes)

    @property
    def ring_size(self) -> int:
        return self.mesh.axis_size(self.ring_axis) if self.ring_axis else 1

    @property
    def ulysses_size(self) -> int:
        return self.mesh.axis_size(self.ulysses_axis) if self.ulysses_axis else 1

    @property
    def zigzag(self) -> bool:
        return self.mode == "zigzag"

    def placements(self, x: torch.Tensor, dim: int) -> tuple[Placement, ...]:
        """``x``'s placements with ``dim`` split over the sequence axes (others kept)."""
        names = self.mesh.axis_names
        old = x.placements if isinstance(x, ShardedTensor) else (Replicate(),) * len(names)
        return tuple(Shard(dim) if a in self.axes else p for a, p in zip(self.mesh.axis_names, old))

    def check_heads(self, n_head: int | None, n_kv_heads: int | None, tp: int = 1) -> None:
        """ValueError unless the Ulysses axis divides this rank's heads and key/value heads."""
        u = self.ulysses_size
        if self.ulysses_axis is None or u == 1:
            return
        for name, n in (("n_head", n_head), ("n_kv_heads", n_kv_heads)):
            if n is None:
                continue
            local = n // tp
            if n % tp or local % u:
                per = f" ({local} per tensor-parallel rank)" if tp > 1 else ""
                fix = (
                    "use sequence_parallel='ring' (or 'zigzag'), which splits no heads, or 'usp' "
                    "with a Ulysses size that divides them"
                    if self.mode == "ulysses"
                    else "choose a Ulysses axis size that divides them"
                )
                raise ValueError(
                    f"shard: sequence_parallel={self.mode!r} splits the heads over the "
                    f"{self.ulysses_axis!r} axis of size {u}, which does not divide {name}={n}"
                    f"{per}; {fix}"
                )

    def check_length(self, T: int, where: str) -> None:
        n = self.size * (2 if self.zigzag else 1)
        if T % n:
            what = f"2 x {self.size} = {n} (zigzag cuts it into 2P chunks)" if self.zigzag else n
            lower, upper = T // n * n, (T // n + 1) * n
            raise ValueError(
                f"shard: sequence_parallel={self.mode!r} splits {where}'s sequence length {T} "
                f"over {self.axes} (size {self.size}); it must be divisible by {what}: use "
                f"{lower or upper} or {upper}"
            )


def zigzag_order(T: int, P: int, device: Any = None) -> torch.Tensor:
    """The positions in the order zigzag stores them: chunks ``r, 2P-1-r`` for ``r = 0..P-1``
    of ``2P`` equal chunks, so that a contiguous split gives rank ``r`` those two."""
    c = T // (2 * P)
    chunks = torch.arange(T, device=device).view(2 * P, c)
    order = [i for r in range(P) for i in (r, 2 * P - 1 - r)]
    return chunks[order].reshape(T)


def _ring_chunks(layout: SequenceLayout, index: int) -> list[int]:
    """The global chunk numbers ring rank ``index`` holds (chunks of equal size, in order)."""
    P = layout.ring_size
    return [index, 2 * P - 1 - index] if layout.zigzag else [index]


def attention_work(T: int, P: int, zigzag: bool, causal: bool = True) -> list[int]:
    """Each ring rank's attention work: the number of (query, key) score entries it computes
    unmasked, over the whole ring. A contiguous causal split has max/min ``2P-1``; zigzag 1."""
    n_chunks = 2 * P if zigzag else P
    c = T // n_chunks
    work = []
    for r in range(P):
        mine = [r, 2 * P - 1 - r] if zigzag else [r]
        total = 0
        for a in mine:
            for b in range(n_chunks):
                kind = _kind(a, b, causal)
                total += {"full": c * c, "diag": c * (c + 1) // 2, "skip": 0}[kind]
        work.append(total)
    return work


def _kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diag" if k_chunk == q_chunk else "skip"


# --- the attention algorithms, on this rank's local tensors -------------------------------------


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    mesh: Mesh,
    inner: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """All-to-all ``q, k, v [B, H, T/P, E]`` (sequence shards) into ``[B, H/P, T, E]`` (head
    shards), ``inner`` attention, and the output back: differentiable (the all-to-all's backward
    is the reverse all-to-all). The queries, keys and values travel in one all-to-all (each
    member's heads of all three side by side), so a layer makes two all-to-alls each way."""
    n = mesh.axis_size(axis)
    for name, t in (("query", q), ("key/value", k)):
        if t.shape[1] % n:
            raise ValueError(
                f"ulysses attention: the {t.shape[1]} {name} heads on this rank are not "
                f"divisible by the {axis!r} axis size {n}; use ring attention or usp"
            )
    B, H, Tl, E = q.shape
    K = k.shape[1]
    # [B, P, heads/P, Tl, E] per tensor, member j's heads of q, k, v together in row j
    packed = torch.cat([t.reshape(B, n, -1, Tl, E) for t in (q, k, v)], dim=2)
    whole = comm.all_to_all(packed, axis, 1, 3, mesh)  # [B, 1, (H + 2K)/P, T, E]
    q, k, v = whole[:, 0].split([H // n, K // n, K // n], dim=1)
    out = inner(q, k, v)
    return comm.all_to_all(out, axis, 2, 1, mesh)


@dataclasses.dataclass(frozen=True)
class _Ring:
    layout: SequenceLayout
    causal: bool
    scale: float | None

    @property
    def axis(self) -> str:
        assert self.layout.ring_axis is not None
        return self.layout.ring_axis

    def _shift(self) -> list[tuple[int, int]]:
        P = self.layout.ring_size
        return [(i, (i + 1) % P) for i in range(P)]

    def _pairs(self, src: int) -> list[tuple[int, int, str]]:
        """(query chunk, key chunk, kind) of this rank against ``src``'s key/value chunks."""
        mine = _ring_chunks(self.layout, self.layout.mesh.coords[self.axis])
        theirs = _ring_chunks(self.layout, src)
        out = []
        for a, qa in enumerate(mine):
            for b, kb in enumerate(theirs):
                kind = _kind(qa, kb, self.causal)
                if kind != "skip":
                    out.append((a, b, kind))
        return out

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mesh, P = self.layout.mesh, self.layout.ring_size
        r = mesh.coords[self.axis]
        n_chunks = len(_ring_chunks(self.layout, r))
        qs = q.chunk(n_chunks, dim=2)
        K = k.shape[1]
        kv = torch.cat([k, v], dim=1)
        outs: list[torch.Tensor | None] = [None] * n_chunks
        lses: list[torch.Tensor | None] = [None] * n_chunks
        for s in range(P):
            src = (r - s) % P
            pending = comm.ppermute_async(kv, self.axis, self._shift(), mesh) if s < P - 1 else None
            ks, vs = kv[:, :K].chunk(n_chunks, dim=2), kv[:, K:].chunk(n_chunks, dim=2)
            for a, b, kind in self._pairs(src):
                o, lse = dispatch.attention_block(qs[a], ks[b], vs[b], kind == "diag", self.scale)
                o = o.to(lse.dtype)
                if outs[a] is None:
                    outs[a], lses[a] = o, lse
                else:
                    prev_o, prev_lse = outs[a], lses[a]
                    assert prev_o is not None and prev_lse is not None
                    new = torch.logaddexp(prev_lse, lse)
                    outs[a] = (
                        prev_o * torch.exp(prev_lse - new)[..., None]
                        + o * torch.exp(lse - new)[..., None]
                    )
                    lses[a] = new
            if pending is not None:
                kv = pending.wait()
        assert all(o is not None for o in outs)
        out = torch.cat(outs, dim=2).to(q.dtype)  # type: ignore[arg-type]
        return out, torch.cat(lses, dim=2)  # type: ignore[arg-type]

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mesh, P = self.layout.mesh, self.layout.ring_size
        r = mesh.coords[self.axis]
        n_chunks = len(_ring_chunks(self.layout, r))
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        qs, dos, outs = (t.chunk(n_chunks, dim=2) for t in (q, dout, out))
        lses, deltas = lse.chunk(n_chunks, dim=2), delta.chunk(n_chunks, dim=2)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dqs = dq.chunk(n_chunks, dim=2)
        K = k.shape[1]
        kv = torch.cat([k, v], dim=1)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for s in range(P):
            src = (r - s) % P
            pending = comm.ppermute_async(kv, self.axis, self._shift(), mesh) if s < P - 1 else None
            ks, vs = kv[:, :K].chunk(n_chunks, dim=2), kv[:, K:].chunk(n_chunks, dim=2)
            dks, dvs = dkv[:, :K].chunk(n_chunks, dim=2), dkv[:, K:].chunk(n_chunks, dim=2)
            for a, b, kind in self._pairs(src):
                gq, gk, gv = dispatch.attention_block_backward(
                    qs[a],
                    ks[b],
                    vs[b],
                    dos[a],
                    lses[a],
                    deltas[a],
                    kind == "diag",
                    self.scale,
                    outs[a],
                )
                dqs[a].add_(gq)
                dks[b].add_(gk)
                dvs[b].add_(gv)
            # the gradient of the block just used goes on with it; the owner gets it last
            dkv = comm.ppermute(dkv, self.axis, self._shift(), mesh)
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), dkv[:, :K].to(k.dtype), dkv[:, K:].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ring.forward(q, k, v)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, ring = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(q, k, v, out, lse, dout.contiguous())
        return dq, dk, dv, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries ``[B, H, T/P, E]`` over the keys and values of every rank
    of ``layout.ring_axis`` (``[B, Hkv, T/P, E]`` each), which travel round the ring; saves only
    the local q, k, v, output and log-sum-exp for the backward, which sends the blocks round
    again with their gradients. Chunks a causal mask hides entirely are skipped."""
    if layout.ring_axis is None:
        raise ValueError(f"ring_attention: layout {layout.mode!r} has no ring axis")
    out, _ = _RingAttention.apply(q, k, v, _Ring(layout, bool(causal), scale))
    return out


# --- the frame ----------------------------------------------------------------------------------


def _default_batch_dims(batch: PyTree) -> dict[str, int]:
    return {
        p: 1
        for p, x in tree.flatten_with_paths(batch)[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2
    }


class CarrySplitter:
    """Base of the frames that keep the declared carry leaves (``dims``: path -> sequence dim)
    split over a sequence axis between layers: a :class:`~colfunc.core.ScanInterceptor` that
    splits the carry before the first layer and after each one (``_split_leaf`` says how)."""

    dims: dict[str, int]

    def _split_leaf(self, path: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def split(self, carry: PyTree) -> PyTree:
        flat, treedef = tree.flatten_with_paths(carry)
        paths = {p for p, _ in flat}
        missing = sorted(set(self.dims) - paths)
        if missing:
            raise ValueError(
                f"shard: sequence_dims names the carry leaf {missing[0]!r}, which the carry "
                f"lacks; its leaves are {sorted(paths)} (declare them in cf.layered(..., "
                "sequence_dims=...))"
            )
        leaves = [self._split_leaf(p, x, self.dims[p]) if p in self.dims else x for p, x in flat]
        return tree.unflatten(treedef, leaves)

    def scan_layers(
        self, block: Any, carry: PyTree, blocks: PyTree, xs: PyTree, inner: Any
    ) -> tuple[PyTree, PyTree]:
        def split_block(layer: PyTree, c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            c, y = block(layer, c, x)
            return self.split(c), y

        return inner(split_block, self.split(carry), blocks, xs)


class LongSequence(SplitSequence, CarrySplitter):
    """The frame of a long-context mode for one step call on a batch of sequence length ``T``:
    splits the declared carry leaves between layers, runs attention across the sequence axes
    (:class:`~colfunc.core.AttentionInterceptor`) and says which position each stored index holds
    (:class:`~colfunc.core.PositionsInterceptor`)."""

    def __init__(self, layout: SequenceLayout, T: int, carry_dims: dict[str, int]) -> None:
        self.layout, self.T, self.dims = layout, T, carry_dims
        self._order: torch.Tensor | None = None

    def order(self, device: Any = None) -> torch.Tensor:
        if self._order is None or (
            device is not None and self._order.device != torch.device(device)
        ):
            self._order = zigzag_order(self.T, self.layout.ring_size, device)
        return self._order

    # PositionsInterceptor
    def positions(self, n: int, device: Any) -> torch.Tensor | None:
        if not self.layout.zigzag or n != self.T:
            return None
        return self.order(device)

    # AttentionInterceptor
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor | None:
        lay = self.layout
        if not isinstance(q, ShardedTensor):
            return None
        names = lay.mesh.axis_names
        if not all(q.placements[names.index(a)] == Shard(2) for a in lay.axes):
            return None  # not split over the sequence: the propagation rules run it
        if not (isinstance(k, ShardedTensor) and isinstance(v, ShardedTensor)):
            raise TypeError("sequence-parallel attention: k and v must be sharded like q")
        if k.placements != q.placements or v.placements != q.placements:
            k = k.redistribute(q.placements)
            v = v.redistribute(q.placements)
        ql, kl, vl = q.to_local(), k.to_local(), v.to_local()

        def local(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
            if lay.ring_axis is None:
                return dispatch._attention(qq, kk, vv, causal, scale)
            return ring_attention(qq, kk, vv, lay, causal, scale)

        if lay.ulysses_axis is not None:
            out = ulysses_attention(ql, kl, vl, lay.ulysses_axis, lay.mesh, local)
        else:
            out = local(ql, kl, vl)
        return from_local(out, lay.mesh, q.placements, tuple(q.shape))

    # ScanInterceptor (CarrySplitter)
    def _split_leaf(self, path: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != self.T:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"shard: the carry leaf {path!r} (shape {shape}) has no sequence dim "
                f"{dim} of the batch's length {self.T}; fix cf.layered(..., sequence_dims=...)"
            )
        want = self.layout.placements(x, dim)
        if not isinstance(x, ShardedTensor):
            return distribute(x, self.layout.mesh, want)
        return x if x.placements == want else x.redistribute(want)


def split_sequence(
    batch: PyTree, layout: SequenceLayout, dims: dict[str, int] | None
) -> tuple[PyTree, int]:
    """The batch with its sequence dims split over the layout's axes (zigzag: reordered first),
    and the sequence length."""
    flat, treedef = tree.flatten_with_paths(batch)
    dims = _default_batch_dims(batch) if dims is None else dims
    missing = sorted(set(dims) - {p for p, _ in flat})
    if missing:
        raise ValueError(
            f"shard: batch_sequence_dims names the batch entry {missing[0]!r}, which the batch "
            f"lacks; its entries are {[p for p, _ in flat]}"
        )
    lengths = {p: x.shape[dims[p]] for p, x in flat if p in dims and isinstance(x, torch.Tensor)}
    if not lengths:
        raise ValueError(
            "shard: sequence parallelism found no batch entry with a sequence dim; declare them "
            "with cf.layered(..., batch_sequence_dims={'input_ids': 1, ...})"
        )
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"shard: the batch entries' sequence lengths differ: {lengths}; sequence parallelism "
            "splits one sequence length"
        )
    T = next(iter(lengths.values()))
    layout.check_length(T, "the batch")
    out = []
    order = None
    for p, x in flat:
        if p in lengths:
            d = dims[p]
            if layout.zigzag:
                order = zigzag_order(T, layout.ring_size, x.device) if order is None else order
                x = x.index_select(d, order.to(x.device))
            x = distribute(x, layout.mesh, layout.placements(x, d))
        out.append(x)
    return tree.unflatten(treedef, out), T
