"""Pytrees with dotted paths.

A pytree here is any nesting of dicts, lists, tuples, named tuples and dataclasses registered with
`optree`, with tensors (or other leaves) at the bottom. Every leaf has a *path*: the keys leading to
it joined by dots, e.g. ``"blocks.attn.wq"``. Paths are how plans (sharding, remat by name) address
parameters, so they are part of the public contract.

Patterns are shell globs over whole paths (``fnmatch``): ``"blocks.*.w?"`` or ``"*.bias"``; a
``*`` also crosses dots, so ``"blocks.*"`` matches everything under ``blocks``.

Example:
    >>> import torch, colfunc as cf
    >>> t = {"embed": torch.zeros(2), "blocks": {"wq": torch.ones(3)}}
    >>> cf.tree.paths(t)
    ['blocks.wq', 'embed']
    >>> cf.tree.map_with_path(lambda p, x: x + (p == "embed"), t)["embed"]
    tensor([1., 1.])
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

__all__ = [
    "flatten_with_paths",
    "leaves",
    "map",
    "map_with_path",
    "match",
    "merge",
    "paths",
    "select",
    "size_bytes",
    "structure",
    "subset",
    "tensors",
    "unflatten",
]

PyTree = Any
# None stays a node (an empty subtree), as in JAX: optional state slots need no special casing.
_NONE_IS_LEAF = False


def _entry_name(entry: Any) -> str:
    # optree accessor entries: MappingEntry(key), SequenceEntry(index), NamedTupleEntry(field), ...
    for attr in ("field", "key", "index", "entry"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_of(accessor: Any) -> str:
    return ".".join(_entry_name(e) for e in accessor)


# treedef -> its leaves' paths: a training step flattens trees of the same few structures many
# times per step, and naming the paths costs about ten times the flatten itself
_PATHS: dict[Any, tuple[str, ...]] = {}
_PATHS_KEPT = 4096


def _paths_of(treedef: Any) -> tuple[str, ...]:
    try:
        known = _PATHS.get(treedef)
    except TypeError:  # a node whose metadata cannot be hashed: name the paths every time
        return tuple(_path_of(a) for a in treedef.accessors())
    if known is None:
        known = tuple(_path_of(a) for a in treedef.accessors())
        if len(_PATHS) >= _PATHS_KEPT:
            _PATHS.clear()
        _PATHS[treedef] = known
    return known


# A training step flattens trees of the same few structures many times per step, and
# ``optree.tree_flatten`` costs about ten times flattening along a known treedef (which checks
# every node's type, keys and length as it goes). So the treedef last seen for a tree's
# top-level signature (its type, and a dict's keys or a sequence's length) is tried first; its
# result stands when every leaf it yields is a leaf (a tensor or a plain scalar), not a subtree
# or a None in a leaf's place. Trees that optree deems equal in structure (dicts with the same
# keys, whatever their order) share the treedef first seen.
_KNOWN: dict[Any, Any] = {}
_KNOWN_KEPT = 256
_SCALARS = (int, float, bool, str, complex)


def _signature(tree: PyTree) -> Any:
    kind = type(tree)
    if kind is dict:
        return (kind, tuple(tree))
    if kind is list or kind is tuple:
        return (kind, len(tree))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return (kind,)
    return None


def _is_plain_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or type(x) in _SCALARS


def _flatten(tree: PyTree) -> tuple[list[Any], Any]:
    """``optree.tree_flatten(tree)``, along the treedef last seen for ``tree``'s signature
    when ``tree`` has its structure."""
    sig = _signature(tree)
    if sig is not None:
        treedef = _KNOWN.get(sig)
        if treedef is not None:
            try:
                leaves_ = treedef.flatten_up_to(tree)
            except (ValueError, TypeError):
                leaves_ = None
            if leaves_ is not None and all(_is_plain_leaf(x) for x in leaves_):
                return leaves_, treedef
    leaves_, treedef = optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF)
    if sig is not None:
        if len(_KNOWN) >= _KNOWN_KEPT:
            _KNOWN.clear()
        _KNOWN[sig] = treedef
    return leaves_, treedef


def flatten_with_paths(tree: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """Return ``([(path, leaf), ...], treedef)``, leaves in the canonical (sorted-key) order."""
    leaves_, treedef = _flatten(tree)
    return list(zip(_paths_of(treedef), leaves_)), treedef


def unflatten(treedef: Any, leaves_: Iterable[Any]) -> PyTree:
    """Inverse of :func:`flatten_with_paths` (give the leaves only)."""
    return optree.tree_unflatten(treedef, list(leaves_))


def structure(tree: PyTree) -> Any:
    return _flatten(tree)[1]


def leaves(tree: PyTree) -> list[Any]:
    return _flatten(tree)[0]


def paths(tree: PyTree) -> list[str]:
    """The dotted path of every leaf, in leaf order."""
    return [p for p, _ in flatten_with_paths(tree)[0]]


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` applied leafwise over one or more trees of the same structure."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=_NONE_IS_LEAF)


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn(path, leaf, *other_leaves)`` applied leafwise; ``path`` is the dotted path."""
    flat, treedef = flatten_with_paths(tree)
    others = [treedef.flatten_up_to(r) for r in rest]
    out = [fn(p, x, *(o[i] for o in others)) for i, (p, x) in enumerate(flat)]
    return unflatten(treedef, out)


def map_subtrees(fn: Callable[[PyTree], PyTree], tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` with every subtree shaped like ``like`` replaced by ``fn(subtree)``; e.g. the
    moments of an optimizer state, which mirror the parameters. A subtree is shaped like
    ``like`` when it has the same structure, or when it is a dict holding some of ``like``'s
    leaves at their paths (:func:`subset`: an optimizer over part of the parameters, as
    ``optim.multi_transform`` makes); ``fn`` then receives that part."""
    spec = structure(like)
    known = set(paths(like))

    def shaped(node: Any) -> bool:
        if structure(node) == spec:
            return True
        if type(node) is not dict or not node:
            return False
        inside = paths(node)
        return bool(inside) and known.issuperset(inside)

    return optree.tree_map(
        lambda node: fn(node) if shaped(node) else node,
        tree,
        is_leaf=shaped,
        none_is_leaf=_NONE_IS_LEAF,
    )


def match(pattern: str, path: str) -> bool:
    """Whether ``path`` matches the glob ``pattern`` (the whole path, case-sensitive)."""
    return fnmatch.fnmatchcase(path, pattern)


def select(tree: PyTree, pattern: str) -> dict[str, Any]:
    """``{path: leaf}`` for the leaves whose path matches ``pattern``."""
    return {p: x for p, x in flatten_with_paths(tree)[0] if match(pattern, p)}


def tensors(tree: PyTree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` (other leaves, such as step counters, are skipped)."""
    return [x for x in leaves(tree) if isinstance(x, torch.Tensor)]


def size_bytes(tree: PyTree) -> int:
    """Total bytes of the tensor leaves."""
    return sum(x.numel() * x.element_size() for x in tensors(tree))


_DROPPED = object()  # a subtree with no leaf kept


def subset(tree: PyTree, keep: Callable[[str], bool]) -> PyTree:
    """``tree`` with only the leaves whose dotted path ``keep`` accepts: dicts lose the entries
    with nothing kept (an empty result is ``{}``); a list, tuple or other node is kept whole or
    dropped whole, and a ValueError names a node of which only some leaves are kept (dropping
    them would renumber the rest).

    Example:
        >>> subset({"a": {"w": x, "b": y}, "c": z}, lambda p: p != "a.b")
        {'a': {'w': x}, 'c': z}
    """

    def walk(node: Any, path: str) -> Any:
        if type(node) is dict:
            out = {}
            for k, v in node.items():
                sub = walk(v, f"{path}.{k}" if path else str(k))
                if sub is not _DROPPED:
                    out[k] = sub
            return out if out or not node else _DROPPED
        flat = flatten_with_paths(node)[0]
        if not flat:
            return node
        full = [f"{path}.{p}" if path and p else (path or p) for p, _ in flat]
        kept = [keep(p) for p in full]
        if all(kept):
            return node
        if not any(kept):
            return _DROPPED
        raise ValueError(
            f"subset: {path!r} is a {type(node).__name__} of which only some leaves are kept "
            f"({[p for p, k in zip(full, kept) if k][:3]}); keep all of it or none, or hold "
            "the leaves in a dict"
        )

    out = walk(tree, "")
    return {} if out is _DROPPED else out


def merge(tree: PyTree, part: PyTree) -> PyTree:
    """``tree`` with each leaf that ``part`` holds at the same path replaced by ``part``'s (the
    inverse of :func:`subset`); a path of ``part`` that ``tree`` lacks is a ValueError."""
    given = dict(flatten_with_paths(part)[0])
    flat, treedef = flatten_with_paths(tree)
    unknown = sorted(set(given) - {p for p, _ in flat})
    if unknown:
        raise ValueError(f"merge: {unknown[:3]} are not paths of the tree")
    return unflatten(treedef, [given.get(p, x) for p, x in flat])
