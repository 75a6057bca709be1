"""The one context stack, and the primitives that transforms intercept through it.

Everything ambient in colfunc lives on a thread-local stack of *frames* entered with ``with``: the
current mesh, the active transforms. Model code never reads it; it only calls the primitives below,
and a transform that wants to change how they run pushes a frame for the duration of a call.

``scan_layers`` is the hook point for pipeline (run only this stage's layers), remat (checkpoint
each layer), ZeRO-3 (gather each layer's parameters on use), offload (fetch each layer's chunks
from host memory) and sequence parallelism (split the
carry's sequence dim between layers): a :class:`ScanInterceptor` frame defines
``scan_layers(block, carry, blocks, xs, inner)``, sees the call first and may delegate to
``inner``, the next frame's version (finally the plain loop).

Every frame, who pushes it, who reads it, and when it is read (*call*: while a step runs; no
frame is read when a step is built, since transforms learn of each other through
:class:`~colfunc.transforms.composition.Composition`, not the stack):

===================== ============================================ ============================================ =====
frame                 pushed by                                    read by                                      when
===================== ============================================ ============================================ =====
``Mesh``              ``launch`` (each rank's thread or process)   ``current_mesh``, amp's overflow check,      call
                                                                   zero and pipeline without ``shard``
``LossScale``         ``amp``'s forward-backward                   :func:`loss_scale`: the step's               call
                                                                   forward-backward, the pipeline runner
``WidenGrads``        ``amp``'s forward-backward                   gradient buckets (reduce in the masters'     call
                                                                   dtype)
``LayerGrads``        ``shard`` and ``zero`` 0-2 forward-backward  the step's forward-backward (``track``),     call
                      (their gradient buckets)                     :func:`scan_layers` (take each layer's
                                                                   gradients during the backward pass),
                                                                   :func:`loss_scale` (its ``scale``)
``StepRun``           ``Step.__call__`` (around its pieces)        ``shard`` and ``zero`` 0 forward-backward    call
                                                                   (hand gradients in flight), the step's
                                                                   update (update each part as it arrives)
``NormReduction``     ``shard`` (local update), ``zero`` 1-3       ``optim.clip_by_global_norm``, the step's    call
                      update, ``pipeline`` update                  gradient norm; ``pipeline`` nests it
``SplitBackward``     ``pipeline`` with ``"zero_bubble"``          remat (full checkpoints), ZeRO-3 gathers     call
``_KnownNorm``        the step's update                            ``clip_by_global_norm`` (reuse the norm)     call
``_Remat``            ``remat``'s forward-backward                 :func:`scan_layers` (an interceptor)         call
``LayerGather``       ``zero`` stage 3 forward(-backward)          :func:`scan_layers` (an interceptor)         call
``_SequenceParallel`` ``shard(sequence_parallel=True)``            :func:`scan_layers` (an interceptor)         call
``LongSequence``      ``shard(sequence_parallel="ulysses"`` and    :func:`scan_layers`, ``ops.attention``       call
                      the other sequence-axis modes)               (an ``AttentionInterceptor``),
                                                                   :func:`positions`
``GridLinear``        ``shard(tensor_mode="2d"`` and ``"2.5d"``,     ``nn.linear`` (a ``LinearInterceptor``:      call
                      ``"3d"``)                                    the mode's matmul on the grid)
``_Streaming``        ``offload``'s forward(-backward)             :func:`scan_layers` (an interceptor: fetch   call
                                                                   each layer's chunks)
``DryRun``            :func:`colfunc.memory.predict`               ``offload`` (its state, pool and update:     call
                                                                   meta tensors, no kernels)
``Trace``             the user, around a step                      the pipeline runner (records its actions)    call
===================== ============================================ ============================================ =====
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from colfunc import tree

__all__ = [
    "DryRun",
    "GradArrival",
    "LayerGrads",
    "Layered",
    "LinearInterceptor",
    "LossScale",
    "NormReduction",
    "P",
    "SplitBackward",
    "SplitSequence",
    "StepRun",
    "WidenGrads",
    "context",
    "frames",
    "innermost",
    "layered",
    "linear_frames",
    "loss_scale",
    "num_layers",
    "positions",
    "scan_layers",
    "sequence_split",
]

PyTree = Any
Block = Callable[[PyTree, PyTree], PyTree]  # (layer params, carry) -> carry
ScanBlock = Callable[
    [PyTree, PyTree, PyTree], tuple[PyTree, PyTree]
]  # (layer, carry, x) -> (carry, y)
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


@runtime_checkable
class ScanInterceptor(Protocol):
    """A frame that changes how :func:`scan_layers` runs.

    ``block`` is always in the ``xs`` form, ``block(layer, carry, x) -> (carry, y)`` (``x`` and
    ``y`` are None for a scan without ``xs``), and so is ``inner(block, carry, blocks, xs) ->
    (carry, ys)``, the next frame's version (finally the plain loop).
    """

    def scan_layers(
        self,
        block: ScanBlock,
        carry: PyTree,
        blocks: PyTree,
        xs: PyTree,
        inner: Callable[[ScanBlock, PyTree, PyTree, PyTree], tuple[PyTree, PyTree]],
    ) -> tuple[PyTree, PyTree]: ...


@runtime_checkable
class AttentionInterceptor(Protocol):
    """A frame that runs :func:`colfunc.ops.attention` itself (sequence parallelism).

    ``attention(q, k, v, causal, scale)`` returns the output, or None to let the op run as usual
    (the frame takes only what it was made for, e.g. queries split over its sequence axis).
    """

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor | None: ...


@runtime_checkable
class LinearInterceptor(Protocol):
    """A frame that runs :func:`colfunc.nn.linear` itself (2D, 2.5D and 3D tensor parallelism).

    ``linear(x, w, b)`` returns ``x @ w + b``, or None to let the layer run as usual (the frame
    takes only the weights laid out for it).
    """

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
    ) -> torch.Tensor | None: ...


@runtime_checkable
class PositionsInterceptor(Protocol):
    """A frame that says which sequence position each index of a sequence dim holds."""

    def positions(self, n: int, device: Any) -> torch.Tensor | None: ...


class SplitSequence:
    """Base of the frames under which activations are split over a sequence axis of their own
    (the long-context sequence parallelism): :func:`colfunc.nn.linear` then keeps the batch and
    sequence dims apart (a ``bmm``) rather than folding them, which such a split cannot follow."""


def sequence_split() -> bool:
    """Whether a :class:`SplitSequence` frame is active on this thread."""
    return innermost(SplitSequence) is not None


def positions(n: int, device: Any = None) -> torch.Tensor:
    """The position (``[n]`` long) that each index ``0..n-1`` of a sequence dim holds.

    ``arange(n)``, unless a frame reorders the sequence: zigzag ring attention stores the
    sequence in the order that balances causal work over the ranks, and says here which position
    each stored index is. Models take their position embeddings and rotary tables from this, and
    the next-token targets use it to find each position's successor.
    """
    for frame in reversed(_STACK.frames):
        if _implements(frame, PositionsInterceptor):
            p = frame.positions(n, device)
            if p is not None:
                return p
    return torch.arange(n, device=device)


def attention_frames() -> list[AttentionInterceptor]:
    """The :class:`AttentionInterceptor` frames, innermost first."""
    return [f for f in reversed(_STACK.frames) if _implements(f, AttentionInterceptor)]


def linear_frames() -> list[LinearInterceptor]:
    """The :class:`LinearInterceptor` frames, innermost first."""
    return [f for f in reversed(_STACK.frames) if _implements(f, LinearInterceptor)]


class LossScale:
    """A frame that multiplies the loss by ``value`` before it is differentiated (loss scaling)."""

    def __init__(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"loss scale must be > 0, got {value!r}")
        self.value = float(value)


def loss_scale() -> float:
    """The product of the active :class:`LossScale` frames and of the ``scale`` of the active
    :class:`LayerGrads` frames (1.0 when there is none).

    Whatever differentiates a loss (the plain step, a pipeline schedule) multiplies by this first.
    """
    value = 1.0
    for f in _STACK.frames:
        if isinstance(f, LossScale):
            value *= f.value
        elif isinstance(f, LayerGrads):
            value *= f.scale
    return value


class DryRun:
    """A frame saying that what runs inside is a dry run on the meta device: tensors have
    shapes, dtypes and lifetimes but no values (:func:`colfunc.memory.predict` predicts memory
    and traffic this way), so no kernel that needs values may run."""


class SplitBackward:
    """A frame saying that the backward pass of what runs inside is taken in two parts (input
    gradients first, weight gradients later, as zero-bubble pipelines do), so the graph is
    differentiated twice: regions that allow only one backward pass must not be used."""


class NormReduction:
    """A frame saying how per-tensor squared norms of this rank's pieces make the global one.

    ``reduce(squares) -> total`` receives one 0-d squared L2 norm per tensor leaf (in leaf order)
    of the local pieces and returns the squared norm of the whole, distributed, tree (adding the
    pieces that other ranks hold, counting replicated ones once). Transforms that hand the
    optimizer local shards push one, so that ``clip_by_global_norm`` clips by the true norm.
    """

    def __init__(self, reduce: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self.reduce = reduce


@runtime_checkable
class GradArrival(Protocol):
    """Gradients handed over while parts of them are still being reduced.

    ``grads`` is the tree handed over; its tensors lie in ``parts`` ranges of memory (data
    parallelism's buckets), numbered in the order their collectives started. A reader waits
    for the parts holding what it reads: ``part_of(t)`` is the last part that ``t``'s memory
    touches (-1: none, ready now), ``wait(k)`` waits for parts ``0..k`` in order (every rank
    waits in the same order), ``wait_for(t)`` for what ``t`` touches, ``wait_all()`` for the
    rest (and settles what the step still owes: its loss, its buffers). Waiting again is free.
    """

    grads: PyTree
    parts: int

    def part_of(self, t: torch.Tensor) -> int: ...

    def wait(self, part: int) -> None: ...

    def wait_for(self, t: torch.Tensor) -> None: ...

    def wait_all(self) -> None: ...


class StepRun:
    """The frame a :class:`~colfunc.step.Step` call pushes around its pieces (forward-backward,
    sync, update), which it runs one after another.

    With ``overlap`` (the step's ``overlap_update``: its composition reads no gradient between
    the backward pass and the optimizer), data parallelism's forward-backward may hand its
    gradients over before the last buckets are reduced (:meth:`hand`, a :class:`GradArrival`),
    and the step's update may update each part as it arrives. Whatever is still in flight when
    the update is done, or fails, is waited for by :meth:`complete`, which the call runs last.
    """

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.arrival: GradArrival | None = None

    def hand(self, arrival: GradArrival) -> None:
        """Take gradients in flight; only with ``overlap``, once per call."""
        if not self.overlap or self.arrival is not None:
            raise RuntimeError(
                "StepRun: gradients in flight were handed to a step call that does not take "
                "them (overlap off, or handed twice)"
            )
        self.arrival = arrival

    def arrival_for(self, grads: PyTree) -> GradArrival | None:
        """The gradients in flight if they are ``grads`` (the tree handed over, unchanged);
        otherwise everything in flight is waited for first and None is returned."""
        arrival = self.arrival
        if arrival is not None and arrival.grads is not grads:
            self.complete()
            return None
        return arrival

    def complete(self) -> None:
        """Wait for whatever is still in flight."""
        arrival, self.arrival = self.arrival, None
        if arrival is not None:
            arrival.wait_all()


class LayerGrads:
    """A frame that takes each scanned layer's parameter gradients as soon as they exist.

    Whoever differentiates the loss inside it (the training step's forward-backward) first calls
    :meth:`track` with its leaves by path. :func:`scan_layers` then unstacks each tracked stacked
    leaf so that the backward pass calls ``on_layer(i, grads, layer_params)`` right after the
    gradients of layer ``i`` have been computed, before it goes on to layer ``i - 1``: ``grads``
    maps the tracked leaves' paths to that layer's gradient (None where there is none) and
    ``layer_params`` to the layer's slices. Those gradients are *taken*: the stacked leaf receives
    zeros from the scan instead (a read-only stride-0 view where it can), the tensor kept in
    ``handed[path]``, so the final gradient of a leaf is exactly that tensor unless something
    outside the scan also contributed to it.

    Data parallelism uses it to start reducing a layer's gradients while the earlier layers are
    still being differentiated, and to drop each one once it is packed for sending.

    ``scale`` is a factor the receiver wants every gradient computed inside the frame multiplied
    by (data parallelism's ``1/n`` of an average): :func:`loss_scale` includes it, so the
    backward pass is seeded with it and no pass over the gradients divides them afterwards.

    ``early(paths, n)``, called by a scan over ``n`` layers of the tracked leaves ``paths``,
    names the layers whose gradients the receiver wants the moment they exist (the default:
    all). Each of those gets a node of its own in the backward pass; the others are handed over
    together, last layer first, once the scan's backward pass is through (after layer 0), which
    costs no node per layer: data parallelism wants early only the layers whose buckets start
    before the backward pass ends.
    """

    def __init__(
        self,
        on_layer: Callable[[int, dict[str, Any], Mapping[str, torch.Tensor]], None],
        scale: float = 1.0,
        early: Callable[[tuple[str, ...], int], Collection[int]] | None = None,
    ) -> None:
        if not scale > 0:
            raise ValueError(f"LayerGrads: scale must be > 0, got {scale!r}")
        self.on_layer = on_layer
        self.scale = float(scale)
        self.early = early
        self.paths: dict[int, str] = {}
        self.handed: dict[str, torch.Tensor] = {}

    def track(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Name the differentiated leaves (path -> tensor) whose layers' gradients to take."""
        self.paths = {id(x): path for path, x in leaves.items() if x.requires_grad}

    def close(self) -> None:
        """Forget the receiver and what was handed. A receiver that keeps this frame (a bound
        method of its owner) makes a reference cycle that only the garbage collector would
        free, with whatever the owner still holds (a backend's reduced buffers)."""
        self.on_layer = _closed
        self.early = None
        self.handed = {}
        self.paths = {}

    def early_layers(self, paths: tuple[str, ...], n: int) -> Collection[int]:
        """The layers of a scan over ``paths`` whose gradients go to the receiver as soon as
        they are computed (see ``early``)."""
        return range(n) if self.early is None else self.early(paths, n)


def _closed(i: int, grads: dict[str, Any], params: Mapping[str, torch.Tensor]) -> None:
    raise RuntimeError("LayerGrads: the frame was closed; gradients arrived after the step")


class WidenGrads:
    """A frame saying that the gradients computed inside it are widened to ``dtype`` afterwards
    (``amp``'s fp32 master weights), so a reduction running inside may widen them first."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Unstack(torch.autograd.Function):
    """``unbind(0)`` of tracked stacked leaves; the backward hands the rows of the layers in
    ``late`` (those without a :class:`_Tap`) to the frame, last layer first, and hands back
    zeros (see LayerGrads).

    (Written with ``forward(ctx, ...)``: ``apply`` then skips binding the signature of
    ``forward``, which costs more than the node itself; this node and :class:`_Tap` run only
    under data parallelism, never under ``torch.func`` transforms.)"""

    @staticmethod
    def forward(
        ctx: Any,
        frame: LayerGrads,
        paths: tuple[str, ...],
        late: tuple[int, ...],
        *xs: torch.Tensor,
    ) -> Any:
        ctx.frame, ctx.paths, ctx.late = frame, paths, late
        ctx.xs = [x.detach() for x in xs]
        ctx.set_materialize_grads(False)
        return tuple(r for x in xs for r in x.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        # the layers that had no node of their own (see LayerGrads.early), last layer first
        n = len(grads) // len(ctx.paths) if ctx.paths else 0
        for i in sorted(ctx.late, reverse=True):
            layer = dict(zip(ctx.paths, grads[i::n]))
            ctx.frame.on_layer(i, layer, _LayerSlices(ctx.paths, ctx.xs, i))
        zeros = []
        zero: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for path, x in zip(ctx.paths, ctx.xs):
            # one zero seen through a stride-0 view costs no memory; a distributed tensor's
            # zeros must carry its placements
            if type(x) is torch.Tensor:
                key = (x.dtype, x.device)
                if key not in zero:
                    zero[key] = torch.zeros((), dtype=x.dtype, device=x.device)
                z = zero[key].expand(x.shape)
            else:
                z = torch.zeros_like(x)
            ctx.frame.handed[path] = z
            zeros.append(z)
        return (None, None, None, *zeros)


class _LayerSlices(Mapping[str, torch.Tensor]):
    """Layer ``i``'s slice of each stacked leaf, by path, cut when asked for (a receiver reads
    one only for a gradient that is not a plain tensor)."""

    def __init__(self, paths: tuple[str, ...], xs: list[torch.Tensor], i: int) -> None:
        self.paths, self.xs, self.i = paths, xs, i

    def __getitem__(self, path: str) -> torch.Tensor:
        return self.xs[self.paths.index(path)][self.i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


class _Tap(torch.autograd.Function):
    """Identity on a layer's tracked slices whose backward hands their gradients to the frame."""

    @staticmethod
    def forward(
        ctx: Any, frame: LayerGrads, i: int, paths: tuple[str, ...], *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.frame, ctx.i, ctx.paths = frame, i, paths
        ctx.params = [x.detach() for x in xs]
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.frame.on_layer(ctx.i, dict(zip(ctx.paths, grads)), dict(zip(ctx.paths, ctx.params)))
        return (None, None, None, *(None for _ in grads))


def num_layers(blocks: PyTree) -> int:
    """The size of the leading (layer) axis shared by every leaf of ``blocks``."""
    sizes = {x.shape[0] if x.dim() else None for x in tree.tensors(blocks)}
    if len(sizes) != 1 or None in sizes:
        shapes = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(blocks)[0]}
        raise ValueError(
            f"stacked blocks must share one leading layer axis; got leaf shapes {shapes}"
        )
    (n,) = sizes
    assert n is not None
    return n


def _plain_scan(
    block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree
) -> tuple[PyTree, PyTree]:
    n = num_layers(blocks)
    # unbind once per leaf (its backward is a single stack), not x[i] per layer (whose backward
    # would materialise a full-size zero gradient per layer).
    flat, treedef = tree.flatten_with_paths(blocks)
    leaves = [x for _, x in flat]
    taps = innermost(LayerGrads)
    tracked = (
        []
        if taps is None or not torch.is_grad_enabled()
        else [k for k, x in enumerate(leaves) if id(x) in taps.paths]
    )
    taken: dict[int, Any] = {}  # leaf index -> its rows, through the node that takes grads
    early: Collection[int] = ()
    if tracked:
        assert taps is not None
        paths = tuple(taps.paths[id(leaves[k])] for k in tracked)
        early = taps.early_layers(paths, n)
        late = tuple(i for i in range(n) if i not in early)
        rows = _Unstack.apply(taps, paths, late, *(leaves[k] for k in tracked))
        taken = {k: rows[m * n : (m + 1) * n] for m, k in enumerate(tracked)}
    per_leaf = [taken[k] if k in taken else x.unbind(0) for k, x in enumerate(leaves)]
    x_rows = _rows(xs, n)
    ys: list[PyTree] = []
    for i in range(n):
        layer = [r[i] for r in per_leaf]
        if i in early:
            tapped = _Tap.apply(taps, i, paths, *(layer[k] for k in tracked))
            for k, t in zip(tracked, tapped):
                layer[k] = t
        carry, y = block(tree.unflatten(treedef, layer), carry, x_rows[i])
        ys.append(y)
    return carry, _stack(ys)


def _rows(xs: PyTree, n: int) -> list[PyTree]:
    """``xs`` cut along its leading layer axis: one pytree per layer (``None`` without xs)."""
    if xs is None:
        return [None] * n
    flat, treedef = tree.flatten_with_paths(xs)
    for path, x in flat:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"scan_layers: xs.{path} must be a tensor stacked on a leading layer axis of "
                f"size {n} (the number of layers), got {shape}"
            )
    per_leaf = [x.unbind(0) for _, x in flat]
    return [tree.unflatten(treedef, [r[i] for r in per_leaf]) for i in range(n)]


def _stack(ys: list[PyTree]) -> PyTree:
    """The per-layer outputs stacked on a new leading layer axis (``None`` if every one is)."""
    if not ys or all(y is None for y in ys):
        return None
    structures = {tree.structure(y) for y in ys}
    if len(structures) != 1:
        raise ValueError(
            f"scan_layers: every layer's y must have one structure; got {sorted(map(str, structures))}"
        )
    per_layer = [tree.leaves(y) for y in ys]
    return tree.unflatten(
        tree.structure(ys[0]), [torch.stack(list(col)) for col in zip(*per_layer)]
    )


def _run_scan(block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree) -> tuple[PyTree, PyTree]:
    """Run the scan through every :class:`ScanInterceptor` on the stack, innermost first."""
    chain = [f for f in _STACK.frames if _implements(f, ScanInterceptor)]

    def run(i: int, block: ScanBlock, carry: PyTree, blocks: PyTree, xs: PyTree) -> Any:
        if i < 0:
            return _plain_scan(block, carry, blocks, xs)
        return chain[i].scan_layers(
            block, carry, blocks, xs, lambda b, c, bl, x: run(i - 1, b, c, bl, x)
        )

    return run(len(chain) - 1, block, carry, blocks, xs)


def scan_layers(block: Callable[..., Any], carry: PyTree, blocks: PyTree, xs: PyTree = None) -> Any:
    """``jax.lax.scan`` over the leading layer axis of ``blocks``.

    Without ``xs``: ``carry = block(layer_params, carry)`` for each layer, and the final carry is
    returned. With ``xs`` (a pytree of tensors stacked on the same leading layer axis, e.g. this
    layer's KV cache): ``carry, y = block(layer_params, carry, x)`` with ``x`` the layer's slice
    of ``xs``, and the scan returns ``(carry, ys)``, the ``y``\\ s stacked per layer (``None``
    where every ``y`` is None). ``carry`` is any pytree: hidden state, conditioning, positions.

    Semantically a loop; transforms on the context stack may change *how* it runs (checkpointed,
    gathered per layer, only a pipeline stage's layers) but never what it computes.

    Example:
        >>> h = cf.scan_layers(lambda layer, h: h @ layer["w"], h, {"w": torch.randn(4, 8, 8)})
        >>> (h, c), ys = cf.scan_layers(lambda l, hc, kv: (hc, kv + 1), (h, c), blocks, xs=kv)
    """
    if xs is None:
        carry, _ = _run_scan(lambda layer, c, x: (block(layer, c), None), carry, blocks, None)
        return carry
    return _run_scan(block, carry, blocks, xs)


class Layered:
    """A loss made of three pure parts; see :func:`layered`."""

    def __init__(
        self,
        pre: Callable[[PyTree, PyTree], PyTree],
        block: Block,
        post: Callable[[PyTree, PyTree, PyTree], torch.Tensor],
        *,
        name: str = "layered",
        divisors: Mapping[str, int | None] | None = None,
        sequence_dims: Mapping[str, int] | None = None,
        batch_sequence_dims: Mapping[str, int] | None = None,
        xs: Callable[[PyTree, PyTree], PyTree] | None = None,
    ) -> None:
        for label, fn in (("pre", pre), ("block", block), ("post", post)):
            if not callable(fn):
                raise TypeError(f"layered: {label} must be callable, got {fn!r}")
        if xs is not None and not callable(xs):
            raise TypeError(f"layered: xs must be callable (params, batch) -> pytree, got {xs!r}")
        self.xs = xs
        dims = {"": 1} if sequence_dims is None else dict(sequence_dims)
        for path, dim in dims.items():
            if not isinstance(path, str) or isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"layered: sequence_dims maps carry leaf paths (str) to dims (int), got "
                    f"{path!r}: {dim!r}"
                )
        self.pre, self.block, self.post, self.name = pre, block, post, name
        self.divisors = dict(divisors or {})
        self.sequence_dims = dims
        bdims = None if batch_sequence_dims is None else dict(batch_sequence_dims)
        for path, dim in (bdims or {}).items():
            if not isinstance(path, str) or isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"layered: batch_sequence_dims maps batch entry paths (str) to dims (int), "
                    f"got {path!r}: {dim!r}"
                )
        self.batch_sequence_dims = bdims

    def __call__(self, params: PyTree, batch: PyTree) -> torch.Tensor:
        if self.xs is None:
            return self.post(params, self.carry(params, batch), batch)
        carry, ys = self.run(params, batch)
        return self.post(params, carry, batch, ys)  # type: ignore[call-arg]

    def _check(self, params: PyTree) -> None:
        if not isinstance(params, dict) or "blocks" not in params:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"{self.name}: params must be a dict with the stacked layers under 'blocks'; got {keys}"
            )

    def carry(self, params: PyTree, batch: PyTree) -> PyTree:
        """The carry after the last layer: ``pre``, then the scan of ``block``."""
        self._check(params)
        if self.xs is not None:
            return self.run(params, batch)[0]
        return scan_layers(self.block, self.pre(params, batch), params["blocks"])

    def run(self, params: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        """``(carry, ys)`` after the last layer of a loss with per-layer ``xs``."""
        self._check(params)
        if self.xs is None:
            raise ValueError(f"{self.name}: run() is for a layered loss with xs; use carry()")
        xs = self.xs(params, batch)
        return scan_layers(self.block, self.pre(params, batch), params["blocks"], xs=xs)

    def __repr__(self) -> str:
        return f"Layered({self.name})"


def layered(
    pre: Callable[[PyTree, PyTree], PyTree],
    block: Block,
    post: Callable[[PyTree, PyTree, PyTree], torch.Tensor],
    *,
    name: str = "layered",
    divisors: Mapping[str, int | None] | None = None,
    sequence_dims: Mapping[str, int] | None = None,
    batch_sequence_dims: Mapping[str, int] | None = None,
    xs: Callable[[PyTree, PyTree], PyTree] | None = None,
) -> Layered:
    """A loss function ``(params, batch) -> loss`` made of three pure parts.

    ``pre(params, batch) -> carry`` (any pytree of tensors: hidden state, conditioning,
    positions); ``block(layer_params, carry) -> carry`` scanned over ``params["blocks"]`` by
    :func:`scan_layers`; ``post(params, carry, batch) -> loss``. ``pipeline`` needs this form,
    since it tells where a model may be cut into stages (every tensor leaf of the carry crosses
    between stages).

    ``divisors`` names the sizes that a tensor-parallel axis must divide for the model's plan to
    split it cleanly, e.g. ``{"n_head": 12}``: ``shard`` checks them against its mesh.
    ``sequence_dims`` maps the paths of the carry leaves that have a sequence dim to that dim,
    which sequence parallelism splits (default ``{"": 1}``: the carry is one ``[B, T, ...]``
    tensor); leaves not named (conditioning, rotary tables) stay whole.
    ``batch_sequence_dims`` does the same for the batch, which the long-context modes
    (``shard(sequence_parallel="ulysses" | "ring" | "zigzag" | "usp")``) split before the model
    runs (default None: every batch tensor of two or more dims, on dim 1, as ``[B, T]`` token ids
    and labels are).

    With ``xs(params, batch)`` (a pytree stacked on a leading layer axis: per-layer noise,
    conditioning, a cache), the scan runs with those ``xs``: ``block(layer_params, carry, x) ->
    (carry, y)`` and ``post(params, carry, batch, ys)`` gets the ``y``\\ s stacked per layer
    (per-layer auxiliary losses, say). Under ``pipeline`` each stage takes its layers' rows of
    ``xs``, and the ``ys`` so far travel with the carry to the last stage.

    Example:
        >>> loss = cf.layered(pre, block, post, sequence_dims={"h": 1})  # carry {"h", "cond"}
    """
    return Layered(
        pre,
        block,
        post,
        name=name,
        divisors=divisors,
        sequence_dims=sequence_dims,
        batch_sequence_dims=batch_sequence_dims,
        xs=xs,
    )


class P(tuple):
    """A partition spec: for each tensor dim, the mesh axis (or tuple of axes) it is split over.

    ``P(None, "tp")`` keeps dim 0 whole and splits dim 1 over the ``tp`` axis;
    ``P(("dp", "tp"))`` splits dim 0 over both axes (``dp`` major). Trailing dims not named are
    whole. It lives on the ground floor so that models can state plans without importing the
    distributed core.
    """

    def __new__(cls, *entries: str | tuple[str, ...] | None) -> P:
        seen: set[str] = set()
        for dim, e in enumerate(entries):
            names = e if isinstance(e, tuple) else (e,)
            for name in names:
                if name is None and not isinstance(e, tuple):
                    continue
                if not isinstance(name, str) or not name:
                    raise TypeError(
                        f"P: entry for dim {dim} must be None, an axis name or a tuple of axis "
                        f"names; got {e!r}"
                    )
                if name in seen:
                    raise ValueError(f"P{entries!r}: mesh axis {name!r} is used for two dims")
                seen.add(name)
        return super().__new__(cls, entries)

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis named, in dim order."""
        out: list[str] = []
        for e in self:
            if isinstance(e, tuple):
                out.extend(e)
            elif e is not None:
                out.append(e)
        return tuple(out)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"
