"""The one context stack, and the primitives that transforms intercept through it.

Everything ambient in colfunc lives on a thread-local stack of *frames* entered with ``with``: the
current mesh, the active transforms. Model code never reads it; it only calls the primitives below,
and a transform that wants to change how they run pushes a frame for the duration of a call.

``scan_layers`` is the hook point for pipeline (run only this stage's layers), remat (checkpoint
each layer) and ZeRO-3 (gather each layer's parameters on use): a frame that defines
``scan_layers(block, h, blocks, inner)`` sees the call first and may delegate to ``inner``, the
next frame's version (finally the plain loop).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from colfunc import tree

__all__ = [
    "LayerGrads",
    "Layered",
    "LossScale",
    "NormReduction",
    "P",
    "SplitBackward",
    "WidenGrads",
    "context",
    "frames",
    "innermost",
    "layered",
    "loss_scale",
    "num_layers",
    "scan_layers",
]

PyTree = Any
Block = Callable[[PyTree, torch.Tensor], torch.Tensor]
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


def innermost(kind: type[T]) -> T | None:
    """The innermost frame that is an instance of ``kind``, or None."""
    for f in reversed(_STACK.frames):
        if isinstance(f, kind):
            return f
    return None


@runtime_checkable
class ScanInterceptor(Protocol):
    def scan_layers(
        self, block: Block, h: torch.Tensor, blocks: PyTree, inner: Callable[..., torch.Tensor]
    ) -> torch.Tensor: ...


class LossScale:
    """A frame that multiplies the loss by ``value`` before it is differentiated (loss scaling)."""

    def __init__(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"loss scale must be > 0, got {value!r}")
        self.value = float(value)


def loss_scale() -> float:
    """The product of the active :class:`LossScale` frames (1.0 when there is none).

    Whatever differentiates a loss (the plain step, a pipeline schedule) multiplies by this first.
    """
    value = 1.0
    for f in _STACK.frames:
        if isinstance(f, LossScale):
            value *= f.value
    return value


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
    """

    def __init__(
        self, on_layer: Callable[[int, dict[str, Any], dict[str, torch.Tensor]], None]
    ) -> None:
        self.on_layer = on_layer
        self.paths: dict[int, str] = {}
        self.handed: dict[str, torch.Tensor] = {}

    def track(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Name the differentiated leaves (path -> tensor) whose layers' gradients to take."""
        self.paths = {id(x): path for path, x in leaves.items() if x.requires_grad}


class WidenGrads:
    """A frame saying that the gradients computed inside it are widened to ``dtype`` afterwards
    (``amp``'s fp32 master weights), so a reduction running inside may widen them first."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Unstack(torch.autograd.Function):
    """``unbind(0)`` of tracked stacked leaves; the backward hands back zeros (see LayerGrads)."""

    @staticmethod
    def forward(frame: LayerGrads, paths: tuple[str, ...], *xs: torch.Tensor) -> tuple[Any, ...]:
        return tuple(r for x in xs for r in x.unbind(0))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.frame, ctx.paths = inputs[0], inputs[1]
        ctx.xs = [x.detach() for x in inputs[2:]]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        zeros = []
        for path, x in zip(ctx.paths, ctx.xs):
            # one zero seen through a stride-0 view costs no memory; a distributed tensor's
            # zeros must carry its placements
            if type(x) is torch.Tensor:
                z = torch.zeros((), dtype=x.dtype, device=x.device).expand(x.shape)
            else:
                z = torch.zeros_like(x)
            ctx.frame.handed[path] = z
            zeros.append(z)
        return (None, None, *zeros)


class _Tap(torch.autograd.Function):
    """Identity on a layer's tracked slices whose backward hands their gradients to the frame."""

    @staticmethod
    def forward(
        frame: LayerGrads, i: int, paths: tuple[str, ...], *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.frame, ctx.i, ctx.paths = inputs[0], inputs[1], inputs[2]
        ctx.params = [x.detach() for x in inputs[3:]]
        ctx.set_materialize_grads(False)

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


def _plain_scan(block: Block, h: torch.Tensor, blocks: PyTree) -> torch.Tensor:
    n = num_layers(blocks)
    # unbind once per leaf (its backward is a single stack), not x[i] per layer (whose backward
    # would materialise a full-size zero gradient per layer).
    flat, treedef = tree.flatten_with_paths(blocks)
    xs = [x for _, x in flat]
    taps = innermost(LayerGrads)
    tracked = (
        []
        if taps is None or not torch.is_grad_enabled()
        else [k for k, x in enumerate(xs) if id(x) in taps.paths]
    )
    taken: dict[int, Any] = {}  # leaf index -> its rows, through the node that takes grads
    if tracked:
        assert taps is not None
        paths = tuple(taps.paths[id(xs[k])] for k in tracked)
        rows = _Unstack.apply(taps, paths, *(xs[k] for k in tracked))
        taken = {k: rows[m * n : (m + 1) * n] for m, k in enumerate(tracked)}
    per_leaf = [taken[k] if k in taken else x.unbind(0) for k, x in enumerate(xs)]
    for i in range(n):
        layer = [r[i] for r in per_leaf]
        if tracked:
            tapped = _Tap.apply(taps, i, paths, *(layer[k] for k in tracked))
            for k, t in zip(tracked, tapped):
                layer[k] = t
        h = block(tree.unflatten(treedef, layer), h)
    return h


def scan_layers(block: Block, h: torch.Tensor, blocks: PyTree) -> torch.Tensor:
    """Run ``h = block(layer_params, h)`` over the leading layer axis of ``blocks``.

    Semantically a loop; transforms on the context stack may change *how* it runs (checkpointed,
    gathered per layer, only a pipeline stage's layers) but never what it computes.
    """
    chain = [f for f in _STACK.frames if isinstance(f, ScanInterceptor)]

    def run(i: int, block: Block, h: torch.Tensor, blocks: PyTree) -> torch.Tensor:
        if i < 0:
            return _plain_scan(block, h, blocks)
        return chain[i].scan_layers(block, h, blocks, lambda b, x, bl: run(i - 1, b, x, bl))

    return run(len(chain) - 1, block, h, blocks)


class Layered:
    """A loss made of three pure parts; see :func:`layered`."""

    def __init__(
        self,
        pre: Callable[[PyTree, PyTree], torch.Tensor],
        block: Block,
        post: Callable[[PyTree, torch.Tensor, PyTree], torch.Tensor],
        *,
        name: str = "layered",
        divisors: Mapping[str, int | None] | None = None,
    ) -> None:
        for label, fn in (("pre", pre), ("block", block), ("post", post)):
            if not callable(fn):
                raise TypeError(f"layered: {label} must be callable, got {fn!r}")
        self.pre, self.block, self.post, self.name = pre, block, post, name
        self.divisors = dict(divisors or {})

    def __call__(self, params: PyTree, batch: PyTree) -> torch.Tensor:
        if not isinstance(params, dict) or "blocks" not in params:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"{self.name}: params must be a dict with the stacked layers under 'blocks'; got {keys}"
            )
        h = self.pre(params, batch)
        h = scan_layers(self.block, h, params["blocks"])
        return self.post(params, h, batch)

    def __repr__(self) -> str:
        return f"Layered({self.name})"


def layered(
    pre: Callable[[PyTree, PyTree], torch.Tensor],
    block: Block,
    post: Callable[[PyTree, torch.Tensor, PyTree], torch.Tensor],
    *,
    name: str = "layered",
    divisors: Mapping[str, int | None] | None = None,
) -> Layered:
    """A loss function ``(params, batch) -> loss`` made of three pure parts.

    ``pre(params, batch) -> h``; ``block(layer_params, h) -> h`` scanned over ``params["blocks"]``
    by :func:`scan_layers`; ``post(params, h, batch) -> loss``. ``pipeline`` needs this form, since
    it tells where a model may be cut into stages.

    ``divisors`` names the sizes that a tensor-parallel axis must divide for the model's plan to
    split it cleanly, e.g. ``{"n_head": 12}``: ``shard`` checks them against its mesh.
    """
    return Layered(pre, block, post, name=name, divisors=divisors)


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
