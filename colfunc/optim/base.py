"""The optimizer shape: a pair of pure functions in a small named tuple (as in optax).

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``; the new
parameters are ``apply_updates(params, updates)``. Nothing is modified in place: the step that owns
the state decides what to keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from colfunc import tree

__all__ = ["GradientTransformation", "Schedule", "apply_updates", "chain", "learning_rate"]

PyTree = Any
Schedule = Callable[[int], float]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (updates, state)``.

    ``lr(state) -> float | None`` reports the learning rate the *next* update will use (for
    metrics); transformations without one report None.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    lr: Callable[[PyTree], float | None] = lambda state: None


def learning_rate(lr: float | Schedule, count: int) -> float:
    """The value of a constant or scheduled learning rate at update number ``count`` (from 0)."""
    return float(lr(count)) if callable(lr) else float(lr)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leafwise, as new tensors (in the parameters' dtype)."""
    flat, treedef = tree.flatten_with_paths(params)
    ups = treedef.flatten_up_to(updates)
    ps = [p for _, p in flat]
    new = torch._foreach_add(ps, [u.to(p.dtype) for p, u in zip(ps, ups)])
    return tree.unflatten(treedef, new)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order, each to the updates of the one before."""
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

    return GradientTransformation(init, update, lr)
