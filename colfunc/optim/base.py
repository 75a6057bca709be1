"""The optimizer shape: a pair of pure functions in a small named tuple (as in optax).

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``; the new
parameters are ``apply_updates(params, updates)``. Nothing is modified in place: the step that owns
the state decides what to keep.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from colfunc import torch_private, tree

__all__ = [
    "GradientTransformation",
    "LearningRate",
    "apply_updates",
    "by_rows",
    "chain",
    "contiguous_pieces",
    "dense",
    "flat_runs",
    "learning_rate",
    "packed",
    "packed_view",
    "rows_alike",
]

PyTree = Any
LearningRate = Callable[[int], float]
# what the torch._foreach_* ops take and return
Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (updates, state)``.

    ``lr(state) -> float | None`` reports the learning rate the *next* update will use (for
    metrics); transformations without one report None.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    lr: Callable[[PyTree], float | None] = lambda state: None
    # Optional fast path, ``apply(grads, state, params, donate=False) -> (new_params, state)``:
    # the same result as ``update`` then ``apply_updates``, in fewer passes over memory. With
    # ``donate`` it may write the new values into the buffers of ``params`` and ``state``. It may
    # return None where it does not apply (then the caller takes the two-step path).
    apply: Callable[..., tuple[PyTree, PyTree] | None] | None = None
    # Plain AdamW's hyperparameters (an ``optim.AdamWHyper``), for a transform that runs the
    # update with kernels of its own where the tensors live (``offload``: the CPU Adam on host
    # chunks, the fused device AdamW on device chunks); None for every other optimizer.
    adamw: Any = None
    # Whether ``apply`` takes ``arrival=`` (a :class:`colfunc.core.GradArrival`: gradients of
    # which parts are still being reduced) and updates each part as it arrives: only an update
    # that is elementwise (no global norm, no per-tensor statistics) can.
    in_parts: bool = False


def learning_rate(lr: float | LearningRate, count: int) -> float:
    """The value of a constant learning rate or a LearningRate at update number ``count`` (from 0)."""
    return float(lr(count)) if callable(lr) else float(lr)


def check_lr(owner: str, lr: float | LearningRate) -> float | LearningRate:
    """``lr`` if it is a LearningRate or a finite number >= 0, else a TypeError/ValueError."""
    if callable(lr):
        return lr
    return check_number(owner, "lr", lr, low=0.0)


def check_number(
    owner: str, name: str, value: float, *, low: float, high: float | None = None
) -> float:
    """``value`` as a float if it is finite and in ``[low, high)`` (no upper bound when None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    in_range = low <= value and (high is None or value < high)
    if not (math.isfinite(value) and in_range):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{owner}: {name} must be finite and {bound}, got {value}")
    return float(value)


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """Optimizer arithmetic and state are fp32, or fp64 for fp64 values (never narrower)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def wide_leaves(treedef: Any, t: PyTree) -> list[torch.Tensor]:
    """The leaves of ``t`` (of structure ``treedef``) in :func:`state_dtype`, copied only if cast."""
    return [x.to(state_dtype(x)) for x in treedef.flatten_up_to(t)]


def state_zeros(params: PyTree) -> PyTree:
    """A zero tensor in :func:`state_dtype` shaped like each leaf of ``params`` (state slots)."""
    return tree.map(lambda p: torch.zeros_like(p, dtype=state_dtype(p)), params)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leafwise, as new tensors (in the parameters' dtype).

    Leaves that are not floating-point tensors (integer buffers, counters) are kept as they are:
    no optimizer trains them.
    """
    treedef = tree.structure(params)
    ps, ups = tree.leaves(params), treedef.flatten_up_to(updates)
    floats = [i for i, p in enumerate(ps) if isinstance(p, torch.Tensor) and p.is_floating_point()]
    new = torch_private.foreach_add(
        [ps[i] for i in floats], [ups[i].to(ps[i].dtype) for i in floats]
    )
    out = list(ps)
    for i, p in zip(floats, new):
        out[i] = p
    return tree.unflatten(treedef, out)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order, each to the updates of the one before.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), adamw(3e-4))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} is {t!r}, not a GradientTransformation")

    def init(params: PyTree) -> tuple[PyTree, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: PyTree, state: tuple[PyTree, ...], params: PyTree) -> tuple[PyTree, Any]:
        new_state = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    def lr(state: tuple[PyTree, ...]) -> float | None:
        for t, s in zip(transforms, state):
            value = t.lr(s)
            if value is not None:
                return value
        return None

    last = transforms[-1] if transforms else None

    def apply(
        grads: PyTree, state: tuple[PyTree, ...], params: PyTree, donate: bool = False
    ) -> Any:
        assert last is not None and last.apply is not None
        new_state = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        out = last.apply(grads, state[-1], params, donate=donate)
        if out is None:
            return None
        new_params, s = out
        return new_params, (*new_state, s)

    has_apply = last is not None and last.apply is not None
    return GradientTransformation(init, update, lr, apply if has_apply else None)


def dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` is contiguous (row-major, size-1 dims aside),
    read off its geometry alone."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def packed(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` covers a block of memory exactly once, in
    some order of its dims: contiguous, or a permutation of contiguous (a transposed view of a
    contiguous tensor). Two tensors of one shape, both packed with the same strides, hold
    matching elements at matching offsets, so an elementwise kernel that reads raw memory
    pairs them right."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def contiguous_pieces(*xs: torch.Tensor, at: int = 1) -> tuple[list[torch.Tensor], ...]:
    """``xs``, alike in shape, as lists of matching contiguous pieces, for kernels that read
    every tensor as contiguous (the fused AdamW, a norm): whole if ``xs[at]`` is contiguous,
    else row by row (views) if its rows are, else with ``xs[at]`` copied contiguous. The others
    are contiguous already. ``xs[at]`` is the one that may be strided: a gradient that is a
    stacked leaf's view into data parallelism's flat buffer (``(param, grad, m, v)``: 1)."""
    g = xs[at]
    if g.is_contiguous():
        return tuple([x] for x in xs)
    if by_rows(g) and all(x.is_contiguous() for x in xs if x is not g):
        return tuple(list(x.unbind(0)) for x in xs)
    return tuple([x.contiguous() if x is g else x] for x in xs)


def by_rows(g: torch.Tensor) -> bool:
    """Whether ``g`` (not contiguous) is a stack of contiguous rows that
    :func:`contiguous_pieces` cuts it into."""
    return g.dim() > 1 and dense(tuple(g.shape[1:]), g.stride()[1:])


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """The 1-d contiguous view of the memory that ``t``, :func:`packed`, covers, in memory order
    (``t`` itself flattened when contiguous): what a kernel reading raw memory sees of it."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def rows_alike(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether ``p`` and ``g`` (alike in shape) are stacks of rows that each cover their memory
    once, laid out in the same order: their rows pair element by element in memory, as an
    elementwise kernel that reads raw memory needs."""
    inner = tuple(p.shape[1:])
    return p.dim() > 1 and p.stride()[1:] == g.stride()[1:] and packed(inner, p.stride()[1:])


def flat_runs(ts: Tensors) -> list[torch.Tensor] | None:
    """The memory that ``ts`` cover together as the fewest 1-d contiguous views (runs), if they
    are plain tensors of one dtype and device that tile ranges of shared storage without
    overlapping, each packed (:func:`packed`) or a stack of packed rows: data parallelism's gradients,
    views into one flat buffer per dtype. None otherwise, and for no tensors.

    A kernel over the runs (a norm) then makes a few large calls instead of one per row. Where
    the runs lie follows from the tensors' geometry alone (storage, offset, shape, strides),
    so it is worked out once per geometry (the same buffers step after step).
    """
    if not ts:
        return None
    first = ts[0]
    owner: dict[int, torch.Tensor] = {}  # storage -> a tensor on it to cut the runs from
    geometry = []
    for t in ts:
        if type(t) is not torch.Tensor or t.dtype != first.dtype or t.device != first.device:
            return None
        key = t.untyped_storage().data_ptr()
        owner.setdefault(key, t)
        geometry.append((key, t.storage_offset(), tuple(t.shape), t.stride()))
    spans = _spans(tuple(geometry))
    if not spans:
        return None
    return [owner[key].as_strided((n,), (1,), start) for key, start, n in spans]


@functools.lru_cache(maxsize=64)
def _spans(
    geometry: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...],
) -> tuple[tuple[int, int, int], ...] | None:
    """The runs (storage, start, length) that tensors of ``geometry`` (storage, offset, shape,
    stride each) cover, or None where one is neither packed (:func:`packed`) nor a stack of
    packed rows, or two overlap."""
    segments: dict[int, list[tuple[int, int]]] = {}
    for key, at, shape, stride in geometry:
        numel = math.prod(shape)
        if numel == 0:
            continue
        # a norm reads every element once in any order: a block covered in another order of
        # its dims (a column-major weight's rows) is a run as well as a row-major one
        if packed(shape, stride):
            own = [(at, numel)]
        elif len(shape) > 1 and stride[0] > 0 and packed(shape[1:], stride[1:]):
            n = numel // shape[0]
            own = [(at + i * stride[0], n) for i in range(shape[0])]
        else:
            return None
        segments.setdefault(key, []).extend(own)
    runs = []
    for key, segs in segments.items():
        segs.sort()
        start, end = segs[0][0], segs[0][0] + segs[0][1]
        for at, n in segs[1:]:
            if at < end:  # overlapping tensors: their union is not what a norm of each sees
                return None
            if at > end:
                runs.append((key, start, end - start))
                start = at
            end = at + n
        runs.append((key, start, end - start))
    return tuple(runs)
