"""Optimizers over parts of the parameters, as optax's ``masked`` and ``multi_transform``.

Parts are named by the parameters' dotted paths, in colfunc's one vocabulary of path patterns
(see :mod:`colfunc.tree`):

- :func:`masked` runs an optimizer on the leaves a mask selects (its state holds only those);
  the other leaves' updates pass through unchanged, as in optax, so it is the piece for a
  chain (weight decay on the weights, not the norms and biases).
- :func:`multi_transform` gives each leaf the optimizer of its label: per-group optimizers and
  learning rates, as ``torch.optim``'s parameter groups. With :func:`set_to_zero` as a group's
  optimizer the group is frozen: no state, no update.

A mask is a path pattern (``"blocks.*.w?"``), a list of them (any matching), a predicate on
the dotted path, or a pytree of bools shaped like the parameters. Labels are a callable from the
dotted path to a label, a dict of path patterns to labels (the first matching pattern wins), or
a pytree of labels shaped like the parameters.

Example:
    >>> opt = optim.multi_transform(
    ...     {"fast": optim.adamw(1e-3), "slow": optim.adamw(1e-4), "frozen": optim.set_to_zero()},
    ...     {"blocks.*": "fast", "embed.*": "frozen", "*": "slow"},
    ... )
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from colfunc import tree
from colfunc.optim.base import GradientTransformation

__all__ = ["masked", "multi_transform", "path_predicate", "set_to_zero"]

PyTree = Any


def _by_path(owner: str, spec: PyTree, params: PyTree, kind: type | tuple[type, ...]) -> dict:
    """``{path: value}`` of a pytree ``spec`` shaped like ``params`` (each value of ``kind``)."""
    want = tree.paths(params)
    got = dict(tree.flatten_with_paths(spec)[0])
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3]
        raise ValueError(
            f"{owner}: the tree given is not shaped like the parameters: missing {missing}, "
            f"unexpected {extra}"
        )
    for path, value in got.items():
        if not isinstance(value, kind) or (kind is bool and type(value) is not bool):
            raise TypeError(f"{owner}: the entry at {path!r} is {value!r}, not a {kind}")
    return got


def path_predicate(owner: str, mask: Any) -> Callable[[str], bool] | None:
    """A predicate on dotted paths from a pattern, a list of patterns or a predicate; None for
    a pytree of bools (read against the parameters when they are known)."""
    if isinstance(mask, str):
        return lambda path: tree.match(mask, path)
    if isinstance(mask, Sequence) and mask and all(isinstance(m, str) for m in mask):
        patterns = tuple(mask)
        return lambda path: any(tree.match(p, path) for p in patterns)
    if callable(mask):
        return lambda path: bool(mask(path))
    if isinstance(mask, (dict, list, tuple)):
        return None
    raise TypeError(
        f"{owner}: the mask must be a path pattern, a list of them, a predicate on dotted "
        f"paths or a pytree of bools shaped like the parameters, got {mask!r}"
    )


def _mask_of(owner: str, mask: Any, params: PyTree) -> Callable[[str], bool]:
    keep = path_predicate(owner, mask)
    if keep is None:
        chosen = _by_path(owner, mask, params, bool)
        return lambda path: chosen[path]
    return keep


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """``inner`` on the leaves that ``mask`` selects; the others' updates pass through as they
    come (optax's ``masked``). ``inner``'s state holds the selected leaves only. A mask that
    selects no parameter is a ValueError naming it.

    Example:
        >>> opt = optim.chain(optim.masked(weight_decay, "blocks.*.w*"), optim.adam(1e-3))
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked: inner must be a GradientTransformation, got {inner!r}")
    path_predicate("masked", mask)  # refuse a malformed mask now, not at init

    def split(params: PyTree) -> Callable[[str], bool]:
        keep = _mask_of("masked", mask, params)
        if not any(keep(p) for p in tree.paths(params)):
            raise ValueError(
                f"masked: the mask {mask!r} selects none of the parameters; their paths look "
                f"like {tree.paths(params)[:4]}"
            )
        return keep

    def init(params: PyTree) -> PyTree:
        return inner.init(tree.subset(params, split(params)))

    def update(grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        keep = split(grads)
        sub_updates, state = inner.update(
            tree.subset(grads, keep), state, tree.subset(params, keep)
        )
        return tree.merge(grads, sub_updates), state

    return GradientTransformation(init, update, inner.lr)


def _labels_of(labels: Any, params: PyTree) -> dict[str, str]:
    """``{path: label}`` for every leaf of ``params``. A dict whose values are all labels is a
    table of path patterns (for a flat dict of parameters it reads the same as a pytree)."""
    paths = tree.paths(params)
    if isinstance(labels, Mapping) and all(isinstance(v, str) for v in labels.values()):
        out = {}
        for path in paths:
            label = next((lab for pat, lab in labels.items() if tree.match(pat, path)), None)
            if label is None:
                raise ValueError(
                    f"multi_transform: no pattern of {list(labels)} matches the parameter "
                    f'{path!r}; add one ("*" matches every path)'
                )
            out[path] = label
        return out
    if callable(labels):
        return {path: labels(path) for path in paths}
    if isinstance(labels, (dict, list, tuple)):
        return _by_path("multi_transform", labels, params, str)
    raise TypeError(
        f"multi_transform: labels must be a callable from dotted paths to labels, a dict of "
        f"path patterns to labels or a pytree of labels shaped like the parameters, got {labels!r}"
    )


def multi_transform(
    transforms: Mapping[str, GradientTransformation], labels: Any
) -> GradientTransformation:
    """Each leaf updated by the optimizer of its label (optax's ``multi_transform``): per-group
    optimizers, learning rates and weight decay, as ``torch.optim``'s parameter groups. The
    state is ``{label: that optimizer's state over its leaves}``; a label with no leaf has
    none. A leaf whose label is not one of ``transforms`` is a ValueError naming both.
    ``lr`` (the metrics') is that of the first label's optimizer that reports one.
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"multi_transform: transforms must be a non-empty dict of labels to optimizers, got "
            f"{transforms!r}"
        )
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] is {t!r}, not a GradientTransformation"
            )

    def groups(params: PyTree) -> dict[str, Callable[[str], bool]]:
        by_path = _labels_of(labels, params)
        unknown = {p: lab for p, lab in by_path.items() if lab not in transforms}
        if unknown:
            path, label = next(iter(unknown.items()))
            raise ValueError(
                f"multi_transform: parameter {path!r} has label {label!r}, which is not one of "
                f"{sorted(transforms)}"
            )
        present = set(by_path.values())

        def of(label: str) -> Callable[[str], bool]:
            return lambda path: by_path[path] == label

        return {label: of(label) for label in transforms if label in present}

    def init(params: PyTree) -> dict[str, PyTree]:
        return {
            label: transforms[label].init(tree.subset(params, keep))
            for label, keep in groups(params).items()
        }

    def update(
        grads: PyTree, state: dict[str, PyTree], params: PyTree
    ) -> tuple[PyTree, dict[str, PyTree]]:
        new_state = dict(state)
        updates = grads
        for label, keep in groups(grads).items():
            sub, new_state[label] = transforms[label].update(
                tree.subset(grads, keep), state[label], tree.subset(params, keep)
            )
            updates = tree.merge(updates, sub)
        return updates, new_state

    def lr(state: dict[str, PyTree]) -> float | None:
        for label, t in transforms.items():
            if label in state:
                value = t.lr(state[label])
                if value is not None:
                    return value
        return None

    return GradientTransformation(init, update, lr)


def set_to_zero() -> GradientTransformation:
    """Zero updates and no state: the optimizer of a frozen group in :func:`multi_transform`."""

    def init(params: PyTree) -> tuple[()]:
        return ()

    def update(grads: PyTree, state: tuple[()], params: PyTree) -> tuple[PyTree, tuple[()]]:
        zeros = tree.map(lambda g: torch.zeros_like(g) if isinstance(g, torch.Tensor) else g, grads)
        return zeros, state

    return GradientTransformation(init, update)
