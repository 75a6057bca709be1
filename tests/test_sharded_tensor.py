"""ShardedTensor: placements, distribute/from_local, and redistribute between any two placements.

The reference is always the full tensor: every local shard is checked against slices of it
(torch.chunk semantics), every full_tensor() against it. Partial tensors are built adversarially:
uneven random pieces per rank that combine to the value. Values are small dyadic rationals
(k/16), so sums, averages and products of a few of them are exact in fp32 and every check is an
equality.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc.sharding as cs
from colfunc import testing as cf_testing
from colfunc.core import P
from colfunc.sharding import (
    Mesh,
    Partial,
    RankFailedError,
    Replicate,
    Shard,
    distribute,
    from_local,
    launch,
)
from colfunc.sharding.placement import chunk, placements_from_spec, spec_from_placements

pytestmark = pytest.mark.timeout(120)

PARTIALS = [Partial("sum"), Partial("avg"), Partial("max")]


# --- building tensors and their shards in the main thread ---------------------------------------


def dyadic(shape: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, tuple(shape), generator=g).float() / 16


def _piece(v: torch.Tensor, op: str, k: int, i: int, seed: int) -> torch.Tensor:
    """Piece ``i`` of ``k`` uneven random pieces whose ``op`` is ``v``."""
    noise = [dyadic(v.shape, seed * 131 + j) for j in range(k)]
    if op == "max":
        holder = seed % k
        return v if i == holder else v - noise[i].abs() - 1 / 16
    total = v * (k if op == "avg" else 1)
    return total - sum(noise[1:], torch.zeros_like(v)) if i == 0 else noise[i]


def shards(
    x: torch.Tensor, mesh_shape: dict[str, int], placements: Any, seed: int = 0
) -> list[torch.Tensor]:
    """Every rank's local part of ``x`` under ``placements`` (Partial pieces adversarial)."""
    out = []
    for r in range(math.prod(mesh_shape.values())):
        mesh = Mesh(mesh_shape, r)
        v = x
        for a, (axis, p) in enumerate(zip(mesh.axis_names, placements)):
            i, k = mesh.coords[axis], mesh.shape[axis]
            if isinstance(p, Shard):
                off, n = chunk(v.shape[p.dim], k, i)
                v = v.narrow(p.dim, off, n)
            elif isinstance(p, Partial):
                # the pieces differ only across the outer axes that split or reduce: ranks of
                # a Replicate axis hold the same piece
                prefix = tuple(
                    0 if isinstance(q, Replicate) else mesh.coords[b]
                    for b, q in zip(mesh.axis_names[:a], placements[:a])
                )
                v = _piece(v, p.op, k, i, hash((seed, a, prefix)) % 100_003)
        out.append(v.clone())
    return out


# --- strategies ---------------------------------------------------------------------------------

meshes = (
    st.lists(st.integers(1, 4), min_size=1, max_size=3)
    .filter(lambda s: math.prod(s) <= 8)
    .map(lambda s: dict(zip(("a", "b", "c"), s)))
)


placements = cf_testing.placements


def has_partial(pl: Any) -> bool:
    return any(isinstance(p, Partial) for p in pl)


# --- redistribute -------------------------------------------------------------------------------


def check_round_trips(
    mesh: Mesh, x: torch.Tensor, cases: list[tuple[Any, Any, list[torch.Tensor], Any]]
) -> list[str]:
    """For each (a, b, shards under a, expected shards under b or None): a -> b -> a."""
    fails = []
    for a, b, parts, want_b in cases:
        xs = from_local(parts[mesh.rank], mesh, a, shape=tuple(x.shape))
        y = xs.redistribute(b)
        z = y.redistribute(a)
        if not torch.equal(y.full_tensor(), x):
            fails.append(f"{a} -> {b}: full_tensor differs")
        if want_b is not None and not torch.equal(y.to_local(), want_b[mesh.rank]):
            fails.append(f"{a} -> {b}: rank {mesh.rank} shard {tuple(y.to_local().shape)} differs")
        if not torch.equal(z.full_tensor(), x):
            fails.append(f"{a} -> {b} -> {a}: full_tensor differs")
        if not has_partial(a) and not torch.equal(z.to_local(), parts[mesh.rank]):
            fails.append(f"{a} -> {b} -> {a}: rank {mesh.rank} shard differs")
    return fails


def round_trip_cases(x: torch.Tensor, mesh_shape: dict[str, int], pairs: list[Any]) -> list[Any]:
    return [
        (
            a,
            b,
            shards(x, mesh_shape, a, seed=i),
            None if has_partial(b) else shards(x, mesh_shape, b),
        )
        for i, (a, b) in enumerate(pairs)
    ]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_redistribute_round_trip_is_identity(data: st.DataObject) -> None:
    mesh_shape = data.draw(meshes, label="mesh")
    ndim = data.draw(st.integers(1, 3))
    shape = data.draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim), label="shape")
    pl = placements(ndim, len(mesh_shape))
    pairs = data.draw(st.lists(st.tuples(pl, pl), min_size=1, max_size=6), label="pairs")
    x = dyadic(shape, seed=len(pairs))
    cases = round_trip_cases(x, mesh_shape, pairs)
    results = launch(lambda mesh: check_round_trips(mesh, x, cases), mesh=mesh_shape)
    assert results == [[]] * len(results)


def test_redistribute_every_pair_on_a_2x2_mesh() -> None:
    mesh_shape = {"a": 2, "b": 2}
    one = [Shard(0), Shard(1), Replicate(), *PARTIALS]
    valid = [
        (p, q)
        for p in one
        for q in one
        if not ({p, q} & {Partial("max")} and {p, q} & {Partial("sum"), Partial("avg")})
    ]
    pairs = [(a, b) for a in valid for b in valid]
    x = dyadic((3, 5), seed=1)
    cases = round_trip_cases(x, mesh_shape, pairs)
    results = launch(lambda mesh: check_round_trips(mesh, x, cases), mesh=mesh_shape)
    assert results == [[]] * 4


def test_redistribute_uses_the_collective_of_each_transition() -> None:
    """Shard -> Replicate gathers, Partial -> Shard reduce-scatters, Shard(i) -> Shard(j) is an
    all_to_all, Replicate -> Shard moves nothing (bytes as the ring formulas give)."""
    x = dyadic((4, 6), seed=2)

    def fn(mesh: Mesh) -> dict[str, int]:
        out = {}
        with cs.recording(mesh) as led:
            for name, a, b in [
                ("gather", Shard(0), Replicate()),
                ("reduce_scatter", Partial(), Shard(1)),
                ("all_to_all", Shard(0), Shard(1)),
                ("slice", Replicate(), Shard(0)),
                ("all_reduce", Partial(), Replicate()),
            ]:
                led.reset()
                distribute(x, mesh, [a]).redistribute([b])
                out[name] = led.bytes()
                out[name + "_ops"] = len(led.as_dict())
        return out

    got = launch(fn, mesh={"tp": 2})[0]
    n = x.numel() * 4
    assert got == {
        "gather": n // 2, "gather_ops": 1,
        "reduce_scatter": n // 2, "reduce_scatter_ops": 1,
        "all_to_all": n // 4, "all_to_all_ops": 1,
        "slice": 0, "slice_ops": 0,
        "all_reduce": n, "all_reduce_ops": 1,
    }  # fmt: skip


# --- distribute, from_local, full_tensor ----------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 5), n=st.integers(0, 9), dim=st.integers(0, 1))
def test_distribute_follows_torch_chunk(k: int, n: int, dim: int) -> None:
    shape = [3, 3]
    shape[dim] = n
    x = dyadic(shape, seed=n)

    def fn(mesh: Mesh) -> bool:
        xs = distribute(x, mesh, [Shard(dim)])
        pieces = x.chunk(k, dim) if n else ()
        want = pieces[mesh.rank] if mesh.rank < len(pieces) else x.narrow(dim, 0, 0)
        return (
            torch.equal(xs.to_local(), want)
            and torch.equal(xs.full_tensor(), x)
            and xs.shape == x.shape
        )

    assert all(launch(fn, mesh={"tp": k}))


def test_several_axes_split_one_dim_major_first() -> None:
    x = dyadic((8, 3), seed=3)

    def fn(mesh: Mesh) -> torch.Tensor:
        return distribute(x, mesh, P(("a", "b"))).to_local()

    got = launch(fn, mesh={"a": 2, "b": 2})
    assert all(torch.equal(got[r], x[2 * r : 2 * r + 2]) for r in range(4))  # rank (a, b) = 2a + b


def test_from_local_finds_the_global_shape() -> None:
    def fn(mesh: Mesh) -> tuple[tuple[int, ...], torch.Tensor]:
        local = torch.full((2 if mesh.rank < 3 else 1, 2), float(mesh.rank))  # torch.chunk(7, 4)
        xs = from_local(local, mesh, [Shard(0)])
        return tuple(xs.shape), xs.full_tensor()

    results = launch(fn, mesh={"tp": 4})
    want = torch.tensor([0.0, 0, 1, 1, 2, 2, 3]).repeat(2, 1).T
    assert all(s == (7, 2) and torch.equal(t, want) for s, t in results)


def test_from_local_rejects_inconsistent_shapes_on_every_rank() -> None:
    def fn(mesh: Mesh) -> None:
        from_local(torch.zeros(2 if mesh.rank != 1 else 3, 4), mesh, [Shard(1)])

    with pytest.raises(RankFailedError) as e:
        launch(fn, mesh={"tp": 2}, timeout=10)
    assert isinstance(e.value.__cause__, ValueError)
    msg = str(e.value.__cause__)
    assert "rank 1 has (3, 4)" in msg and "expected (2, 4)" in msg


def test_from_local_with_a_shape_checks_this_rank() -> None:
    def fn(mesh: Mesh) -> None:
        from_local(torch.zeros(3, 4), mesh, [Shard(0)], shape=(4, 4))

    with pytest.raises(RankFailedError) as e:
        launch(fn, mesh={"tp": 2}, timeout=10)
    assert isinstance(e.value.__cause__, ValueError)
    assert "shard of shape (3, 4)" in str(e.value.__cause__) and "(2, 4)" in str(e.value.__cause__)


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ({"dp": Shard(0)}, r"axes \['dp'\].*mesh axes are \('tp',\)"),
        (P("dp"), r"axis 'dp'.*mesh axes are \('tp',\)"),
        ([Shard(2)], r"Shard\(2\) on axis 'tp' is out of range for a tensor with 2 dims"),
        ([Shard(0), Replicate()], r"2 placements.*mesh with 1 axes"),
        (P(None, None, "tp"), r"names 3 dims but the tensor has 2"),
    ],
)
def test_bad_placements_raise_value_error(placements: Any, match: str) -> None:
    mesh = Mesh({"tp": 1})
    with pytest.raises(ValueError, match=match):
        distribute(torch.zeros(2, 3), mesh, placements)


def test_bad_placement_values() -> None:
    mesh = Mesh({"a": 1, "b": 1})
    with pytest.raises(ValueError, match=r"Partial: op must be one of .* got 'min'"):
        Partial("min")
    with pytest.raises(TypeError, match="Shard: dim must be an int"):
        Shard("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mix Partial\('max'\) with \['sum'\]"):
        distribute(torch.zeros(2), mesh, [Partial("max"), Partial("sum")])
    with pytest.raises(ValueError, match=r"not in the mesh's axis order .* \('a', 'b'\)"):
        placements_from_spec(mesh, P(("b", "a")))


def test_spec_and_placements_convert_both_ways() -> None:
    mesh = Mesh({"dp": 2, "tp": 2})
    for spec in [P(), P("tp"), P(None, "dp"), P(("dp", "tp")), P("tp", "dp")]:
        pl = placements_from_spec(mesh, spec, 2)
        assert spec_from_placements(mesh, pl) == spec
    assert placements_from_spec(mesh, P(None, "tp")) == (Replicate(), Shard(1))


# --- autograd -----------------------------------------------------------------------------------


def test_gradients_come_back_with_the_placements_of_the_input() -> None:
    x, c = dyadic((4, 6), seed=4), dyadic((4, 6), seed=5)

    def fn(mesh: Mesh) -> list[Any]:
        out = []
        for a, b in [
            (Shard(0), Replicate()),
            (Shard(1), Shard(0)),
            (Replicate(), Partial()),
            (Partial(), Shard(1)),
        ]:
            xs = from_local(
                shards(x, dict(mesh.shape), [a])[mesh.rank], mesh, [a], shape=(4, 6)
            ).requires_grad_()
            (xs.redistribute([b]).full_tensor() * c).sum().backward()
            g = xs.grad
            assert isinstance(g, cs.ShardedTensor)
            out.append((g.placements, torch.equal(g.full_tensor(), c)))
        return out

    got = launch(fn, mesh={"tp": 2})[0]
    assert got == [
        ((Shard(0),), True),
        ((Shard(1),), True),
        ((Replicate(),), True),
        ((Replicate(),), True),
    ]


def test_torch_func_grad_through_sharded_tensors() -> None:
    x, w = dyadic((4, 6), seed=6), dyadic((6, 5), seed=7)

    def loss(w_: torch.Tensor, x_: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x_ @ w_).sum()

    want = torch.func.grad(loss)(w, x)

    def fn(mesh: Mesh) -> tuple[Any, torch.Tensor]:
        g = torch.func.grad(loss)(
            distribute(w, mesh, [Shard(1)]), distribute(x, mesh, [Replicate()])
        )
        return g.placements, g.full_tensor()

    for pl, g in launch(fn, mesh={"tp": 2}):
        assert pl == (Shard(1),)
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


def test_from_local_and_to_local_are_differentiable() -> None:
    def fn(mesh: Mesh) -> bool:
        local = torch.full((2, 3), float(mesh.rank + 1), requires_grad=True)
        xs = from_local(local, mesh, [Shard(0)])
        (xs.to_local() * 3).sum().backward()
        return torch.equal(local.grad, torch.full((2, 3), 3.0))

    assert all(launch(fn, mesh={"tp": 2}))


# --- fallback and strict mode --------------------------------------------------------------------


def test_an_op_without_a_rule_falls_back_and_is_counted() -> None:
    x = dyadic((4, 6), seed=8)

    def fn(mesh: Mesh) -> tuple[Any, dict[str, int], bool]:
        cs.reset_fallback_counts() if mesh.rank == 0 else None
        cs.comm.all_reduce(
            torch.zeros(1), "tp", mesh=mesh
        )  # the reset is seen before anyone counts
        y = torch.cumsum(distribute(x, mesh, [Shard(1)]), dim=1)
        return y.placements, cs.fallback_counts(), torch.equal(y.full_tensor(), x.cumsum(1))

    for pl, counts, ok in launch(fn, mesh={"tp": 2}):
        assert pl == (Replicate(),) and counts == {"aten.cumsum.default": 1} and ok


def test_strict_mode_raises_naming_the_op_and_placements() -> None:
    mesh = Mesh({"tp": 1})
    x = distribute(torch.ones(3, 2), mesh, [Shard(0)])
    with (
        cs.strict(),
        pytest.raises(
            RuntimeError,
            match=r"no sharding rule for aten.cumsum.default \(inputs: \(3, 2\) \(Shard\(0\),\)\)",
        ),
    ):
        torch.cumsum(x, 0)
    os.environ["COLFUNC_SHARDING_STRICT"] = "1"
    try:
        with pytest.raises(RuntimeError, match=r"no sharding rule for aten\.cumsum"):
            torch.cumsum(x, 0)
    finally:
        del os.environ["COLFUNC_SHARDING_STRICT"]
    assert torch.equal(torch.cumsum(x, 0).full_tensor(), torch.ones(3, 2).cumsum(0))


def test_in_place_ops_keep_the_destination_placements() -> None:
    x, y = dyadic((4, 6), seed=9), dyadic((4, 6), seed=10)

    def fn(mesh: Mesh) -> list[Any]:
        a = distribute(x, mesh, [Shard(0)])
        a.add_(distribute(y, mesh, [Partial()]), alpha=2)
        b = distribute(x, mesh, [Partial()])
        b.copy_(distribute(y, mesh, [Shard(1)]))
        c = distribute(x, mesh, [Partial()])
        c.fill_(1.0)
        return [(t.placements, t.full_tensor()) for t in (a, b, c)]

    (pa, a), (pb, b), (pc, c) = launch(fn, mesh={"tp": 2})[1]
    assert (pa, pb, pc) == ((Shard(0),), (Partial(),), (Partial(),))
    assert torch.equal(a, x + 2 * y) and torch.equal(b, y) and torch.equal(c, torch.ones(4, 6))
