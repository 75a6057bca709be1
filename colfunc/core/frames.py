"""The frames that transforms push and the primitives read, and the interceptor protocols
(see the frame table in :mod:`colfunc.core`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from colfunc import torch_private
from colfunc.core.stack import _STACK, _implements, innermost

PyTree = Any
ScanBlock = Callable[
    [PyTree, PyTree, PyTree], tuple[PyTree, PyTree]
]  # (layer, carry, x) -> (carry, y)


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

    ``wants``: the paths of the leaves to take (None: every differentiated one); expert
    parallelism reduces its experts' gradients over other axes than the rest, apart.

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
        wants: Collection[str] | None = None,
    ) -> None:
        if not scale > 0:
            raise ValueError(f"LayerGrads: scale must be > 0, got {scale!r}")
        self.wants = None if wants is None else frozenset(wants)
        self.on_layer = on_layer
        self.scale = float(scale)
        self.early = early
        self.paths: dict[int, str] = {}
        self.handed: dict[str, torch.Tensor] = {}

    def track(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Name the differentiated leaves (path -> tensor) whose layers' gradients to take
        (those of ``wants``, when the receiver named some: the others' gradients are left to
        the backward pass)."""
        self.paths = {
            id(x): path
            for path, x in leaves.items()
            if x.requires_grad and (self.wants is None or path in self.wants)
        }

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


class Sown:
    """A frame that collects what model code reports with :func:`sow` while a training step's
    forward pass runs: per name, the values in call order (one per layer, for a report inside
    :func:`scan_layers`), for the step's metrics. The transforms that split the batch make each
    value whole and sum it over their ranks (:meth:`map`), and a pipeline sums each stage's over
    its microbatches and hands every stage's to every rank, so a reported value is a *sum*, such
    as how many tokens each expert ran."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = {}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], stacked: bool = False) -> None:
        """Replace every value collected so far by ``fn`` of it (in name, then call order);
        ``stacked``: ``fn`` of each name's values stacked (one call per name: a collective)."""
        if not stacked:
            self.values = {k: [fn(v) for v in vs] for k, vs in self.values.items()}
            return
        self.values = {k: list(fn(torch.stack(vs)).unbind()) for k, vs in self.values.items() if vs}

    def stacked(self) -> dict[str, torch.Tensor]:
        """Per name, the values stacked in call order (``[calls, *shape]``)."""
        return {k: torch.stack(vs) for k, vs in self.values.items() if vs}


def sow(name: str, value: torch.Tensor) -> None:
    """Report ``value`` (a sum, such as a count) under ``name`` to the training step's metrics
    (flax's ``sow``): nothing outside a step, and nothing while autograd recomputes a forward
    pass inside the backward pass (remat), so each value is reported once per step and call."""
    frame = innermost(Sown)
    if frame is None or torch_private.in_backward():
        return
    frame.values.setdefault(name, []).append(value.detach())
