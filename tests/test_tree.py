"""colfunc.tree against hand-written walks of nested dicts and lists, and against fnmatch."""

from __future__ import annotations

import fnmatch
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from colfunc import tree

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]

keys = st.text(alphabet="abcxyz_0", min_size=1, max_size=3)


@st.composite
def tensors(draw) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) % 3).to(dtype)


leaf = st.one_of(tensors(), st.integers(-5, 5))
trees = st.recursive(
    leaf,
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=3), st.lists(children, max_size=3)
    ),
    max_leaves=8,
)


def walk(t: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs, dict keys sorted: the reference for the canonical order."""
    if isinstance(t, dict):
        return [pair for k in sorted(t) for pair in walk(t[k], f"{prefix}{k}.")]
    if isinstance(t, (list, tuple)):
        return [pair for i, x in enumerate(t) for pair in walk(x, f"{prefix}{i}.")]
    if t is None:
        return []
    return [(prefix[:-1], t)]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b and type(a) is type(b)


@given(trees)
def test_flatten_unflatten_round_trip(t):
    flat, treedef = tree.flatten_with_paths(t)
    assert same(tree.unflatten(treedef, [x for _, x in flat]), t)
    # the leaves come back as the same objects: flattening copies nothing
    assert all(x is y for (_, x), (_, y) in zip(flat, walk(t)))


@given(trees)
def test_paths_are_dotted_keys_in_sorted_order(t):
    expected = walk(t)
    assert tree.paths(t) == [p for p, _ in expected]
    assert [p for p, _ in tree.flatten_with_paths(t)[0]] == [p for p, _ in expected]
    assert len(tree.leaves(t)) == len(expected)


@given(trees)
def test_map_with_path_sees_each_path_once(t):
    seen: list[str] = []

    def fn(path: str, x: Any) -> tuple[str, Any]:
        seen.append(path)
        return (path, x)

    out = tree.map_with_path(fn, t)
    expected = walk(t)
    assert seen == [p for p, _ in expected]
    # tuples returned by fn are nodes again, so the output walks as (path, leaf) pairs
    assert [x for _, x in walk(out)] == [v for pair in expected for v in pair]


@given(trees)
def test_map_over_two_trees(t):
    doubled = tree.map(lambda x, y: x + y, t, t)
    for (p, x), (q, y) in zip(walk(doubled), walk(t)):
        assert p == q and same(x, y + y)


def test_map_with_path_with_a_second_tree():
    a = {"w": torch.ones(2), "b": {"c": torch.zeros(1)}}
    b = {"w": torch.full((2,), 3.0), "b": {"c": torch.ones(1)}}
    out = tree.map_with_path(lambda p, x, y: x * 10 + y if p == "b.c" else x, a, b)
    assert torch.equal(out["b"]["c"], torch.ones(1)) and torch.equal(out["w"], torch.ones(2))


def test_none_is_an_empty_subtree_and_named_tuples_name_their_fields():
    class State(NamedTuple):
        step: int
        moments: dict
        extra: Any

    t = {"opt": State(3, {"w": torch.ones(1)}, None), "none": None}
    assert tree.paths(t) == ["opt.step", "opt.moments.w"]
    assert tree.tensors(t)[0] is t["opt"].moments["w"]
    assert tree.map(lambda x: x, t)["none"] is None


pattern_chars = st.text(alphabet="ab.*?", max_size=6)
path_chars = st.text(alphabet="ab.", max_size=6)


@given(pattern=pattern_chars, path=path_chars)
def test_match_is_a_whole_path_case_sensitive_glob(pattern, path):
    assert tree.match(pattern, path) == fnmatch.fnmatchcase(path, pattern)


@pytest.mark.parametrize(
    ("pattern", "path", "hit"),
    [
        ("blocks.*", "blocks.attn.wq", True),  # * crosses dots
        ("*.bias", "blocks.0.mlp.bias", True),
        ("*.w?", "blocks.attn.wq", True),
        ("*.w?", "blocks.attn.wqk", False),
        ("blocks", "blocks.attn", False),  # the whole path must match
        ("attn", "blocks.attn.wq", False),
        ("*.Bias", "x.bias", False),  # case-sensitive on every platform
        ("blocks.[01].w", "blocks.1.w", True),
    ],
)
def test_match_examples(pattern, path, hit):
    assert tree.match(pattern, path) is hit


@given(t=trees, pattern=st.sampled_from(["*", "a*", "*.0", "?", "*x*", "b.*", "[ab]*.?"]))
def test_select_keeps_matching_leaves(t, pattern):
    expected = {p: x for p, x in walk(t) if fnmatch.fnmatchcase(p, pattern)}
    got = tree.select(t, pattern)
    assert list(got) == list(expected)
    assert all(got[p] is expected[p] for p in got)


@given(trees)
def test_tensors_and_size_bytes(t):
    ts = [x for _, x in walk(t) if isinstance(x, torch.Tensor)]
    assert [id(x) for x in tree.tensors(t)] == [id(x) for x in ts]
    # each tensor is fresh and contiguous, so its storage is exactly its bytes
    assert tree.size_bytes(t) == sum(x.untyped_storage().nbytes() for x in ts)


def test_size_bytes_by_dtype():
    t = {"a": torch.zeros(3, 4), "b": [torch.zeros(5, dtype=torch.bfloat16)], "n": 7}
    assert tree.size_bytes(t) == 3 * 4 * 4 + 5 * 2


# trees whose leaves may also be None, tuples or named tuples: shapes a cached treedef could
# match only "up to" (a subtree or a None where it had a leaf)
class Pair(NamedTuple):
    a: Any
    b: Any


loose = st.recursive(
    st.one_of(leaf, st.none()),
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.builds(Pair, children, children),
    ),
    max_leaves=8,
)


@given(st.lists(loose, min_size=2, max_size=4))
def test_flatten_along_a_known_treedef_equals_a_fresh_flatten(ts):
    """Trees flattened one after another (so a treedef seen before is tried first, whenever
    the top level looks alike) give exactly optree's own leaves and an equal treedef."""
    import optree

    for t in ts:
        want_leaves, want_def = optree.tree_flatten(t, none_is_leaf=False)
        flat, treedef = tree.flatten_with_paths(t)
        assert treedef == want_def
        assert len(flat) == len(want_leaves)
        assert all(x is y for (_, x), y in zip(flat, want_leaves))
        assert [p for p, _ in flat] == [p for p, _ in walk_loose(t)]
        assert tree.structure(t) == want_def
        assert all(x is y for x, y in zip(tree.leaves(t), want_leaves))
        assert same_loose(tree.unflatten(treedef, [x for _, x in flat]), t)


def test_flatten_along_a_known_treedef_sees_a_subtree_or_none_in_a_leaf_slot():
    """The same top-level keys with a subtree, a None or an extra key below are new
    structures, not the cached one."""
    first = {"a": torch.ones(1), "b": {"c": 1}}
    tree.flatten_with_paths(first)
    for later, paths in (
        ({"a": (torch.ones(1), torch.zeros(1)), "b": {"c": 1}}, ["a.0", "a.1", "b.c"]),
        ({"a": None, "b": {"c": 1}}, ["b.c"]),
        ({"a": torch.ones(1), "b": {"c": 1, "d": 2}}, ["a", "b.c", "b.d"]),
        ({"a": torch.ones(1), "b": Pair(1, 2)}, ["a", "b.a", "b.b"]),
    ):
        assert tree.paths(later) == paths
        assert tree.structure(later) == tree.structure(dict(later))


def walk_loose(t: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(t, Pair):
        return walk_loose(t.a, f"{prefix}a.") + walk_loose(t.b, f"{prefix}b.")
    return walk(t, prefix) if not isinstance(t, (dict, list, tuple)) else _walk_nodes(t, prefix)


def _walk_nodes(t: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(t, dict):
        return [p for k in sorted(t) for p in walk_loose(t[k], f"{prefix}{k}.")]
    return [p for i, x in enumerate(t) for p in walk_loose(x, f"{prefix}{i}.")]


def same_loose(a: Any, b: Any) -> bool:
    if isinstance(a, Pair):
        return isinstance(b, Pair) and same_loose(a.a, b.a) and same_loose(a.b, b.b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_loose(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_loose, a, b))
    if a is None:
        return b is None
    return same(a, b)
