"""Collectives on the threads backend against a plain single-process loop over ranks.

Every collective, over single axes and tuples of axes (in any order), on meshes of 1-3 axes with
sizes 1-4: outputs and input gradients equal the reference that computes every rank's output from
all ranks' inputs in one process with torch ops and backpropagates every rank's cotangent. Inputs
are small integers in fp32, so every sum is exact whatever its order. The ledger equals the ring
formula. ``test_comm_gloo.py`` runs the same cases on gloo processes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc.sharding import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    Mesh,
    RankFailedError,
    comm,
    launch,
    recording,
)

pytestmark = pytest.mark.timeout(120)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "broadcast")


# --- the reference: one process, every rank's input ---------------------------------------


def group_of(shape: dict[str, int], rank: int, axes: tuple[str, ...]) -> list[int]:
    """Rank's group over ``axes``: the other axes fixed, row-major over ``axes`` in tuple order."""
    names = list(shape)
    grid = np.arange(math.prod(shape.values())).reshape(list(shape.values()))
    coord = np.unravel_index(rank, grid.shape)
    index = tuple(slice(None) if a in axes else coord[i] for i, a in enumerate(names))
    sub = grid[index]  # free dims in mesh order
    kept = [a for a in names if a in axes]
    return sub.transpose([kept.index(a) for a in axes]).reshape(-1).tolist()


def reference(op: str, shape: dict[str, int], axes: tuple[str, ...], kw: dict, xs: list) -> list:
    """Every rank's output, built from torch ops on all ranks' inputs (so autograd transposes)."""
    out = []
    for r in range(len(xs)):
        g = group_of(shape, r, axes)
        n, i, mine = len(g), g.index(r), [xs[s] for s in g]
        if op == "all_reduce":
            red = kw.get("op", "sum")
            if red in ("sum", "avg"):
                y = sum(mine[1:], mine[0]) / (n if red == "avg" else 1)
            else:
                y = getattr(torch.stack(mine), "amax" if red == "max" else "amin")(0)
        elif op == "all_gather":
            y = torch.cat(mine, kw["dim"])
        elif op == "reduce_scatter":
            total = sum(mine[1:], mine[0]) / (n if kw.get("op") == "avg" else 1)
            y = total.chunk(n, kw["dim"])[i]
        elif op == "all_to_all":
            y = torch.cat([x.chunk(n, kw["split_dim"])[i] for x in mine], kw["concat_dim"])
        elif op == "ppermute":
            srcs = [s for s, d in kw["perm"] if d == i]
            y = mine[srcs[0]] * 1 if srcs else torch.zeros_like(xs[r])
        else:
            y = mine[kw["src"]] * 1
        out.append(y)
    return out


def ring_formula(op: str, kw: dict, x: torch.Tensor, n: int, i: int) -> int:
    """Bytes rank ``i`` of a group of ``n`` sends, written out per op (see colfunc.sharding.ledger)."""
    b = x.numel() * x.element_size()
    return {
        "all_gather": (n - 1) * b,  # (n-1)/n of the gathered n*b
        "reduce_scatter": (n - 1) * b // n,
        "all_reduce": 2 * (n - 1) * b // n,
        "all_to_all": (n - 1) * b // n,
        "broadcast": b if n > 1 and i != (kw.get("src", 0) - 1) % n else 0,
        "ppermute": b if any(s == i != d for s, d in kw.get("perm", ())) else 0,
    }[op]


# --- cases run on every rank ----------------------------------------------------------------


@dataclasses.dataclass
class Case:
    op: str
    shape: dict[str, int]
    axes: tuple[str, ...]
    kw: dict
    xs: list  # per-rank inputs
    cots: list  # per-rank cotangents of the outputs


def make_case(op: str, shape: dict, axes: tuple, kw: dict, in_shape: tuple, seed: int) -> Case:
    size = math.prod(shape.values())
    g = torch.Generator().manual_seed(seed)
    # small integers: every sum is exact, and max/min see ties
    xs = [torch.randint(-3, 4, in_shape, generator=g).float() for _ in range(size)]
    ys = reference(op, shape, axes, kw, xs)
    cots = [torch.randint(-3, 4, y.shape, generator=g).float() for y in ys]
    return Case(op, shape, axes, kw, xs, cots)


def run_cases(cases: list[Case], mesh: Mesh) -> list[dict[str, Any]]:
    """On one rank: each case's output, input gradient, forward ledger, and whether x was kept."""
    results = []
    for case in cases:
        x = case.xs[mesh.rank].clone().requires_grad_()
        with recording(mesh) as led:
            led.reset()
            y = getattr(comm, case.op)(
                x, case.axes if len(case.axes) > 1 else case.axes[0], **case.kw
            )
            sent = led.as_dict()
        y.backward(case.cots[mesh.rank])
        with torch.no_grad():  # the path without an autograd node
            y_no_grad = getattr(comm, case.op)(x, case.axes, **case.kw)
        results.append(
            {
                "y": y.detach(),
                "y_no_grad": y_no_grad,
                "grad": x.grad,
                "sent": sent,
                "kept": torch.equal(x.detach(), case.xs[mesh.rank]),
            }
        )
    return results


def check_case(case: Case, got: list[dict[str, Any]]) -> None:
    """Compare every rank's result of ``case`` with the reference loop and the ring formula."""
    xs = [x.clone().requires_grad_() for x in case.xs]
    ys = reference(case.op, case.shape, case.axes, case.kw, xs)
    total = sum((y * c).sum() for y, c in zip(ys, case.cots)) + sum(x.sum() * 0 for x in xs)
    total.backward()  # (the zero term: inputs that reach no output get a zero gradient)
    key = case.axes[0] if len(case.axes) == 1 else case.axes
    for r, res in enumerate(got):
        where = f"{case.op}{case.kw} over {case.axes} on {case.shape}, rank {r}"
        torch.testing.assert_close(res["y"], ys[r].detach(), rtol=0, atol=0, msg=where)
        assert torch.equal(res["y_no_grad"], res["y"]), where
        torch.testing.assert_close(res["grad"], xs[r].grad, rtol=1e-6, atol=1e-6, msg=where)
        assert res["kept"], f"{where}: the input was modified"
        g = group_of(case.shape, r, case.axes)
        want = ring_formula(case.op, case.kw, case.xs[r], len(g), g.index(r))
        assert res["sent"] == {(case.op, key): want}, where


# --- strategies -----------------------------------------------------------------------------


@st.composite
def meshes(draw: Any, max_size: int = 8) -> dict[str, int]:
    """1-3 axes, sizes 1-4, at most ``max_size`` ranks."""
    names = draw(st.permutations(["dp", "tp", "pp"]))[: draw(st.integers(1, 3))]
    shape: dict[str, int] = {}
    for name in names:
        shape[name] = draw(
            st.integers(1, max(1, min(4, max_size // math.prod(shape.values() or [1]))))
        )
    return shape


@st.composite
def cases(draw: Any, op: str) -> Case:
    shape = draw(meshes())
    axes = tuple(draw(st.permutations(list(shape)))[: draw(st.integers(1, len(shape)))])
    n = math.prod(shape[a] for a in axes)
    in_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    dim = draw(st.integers(-len(in_shape), len(in_shape) - 1))
    kw: dict[str, Any] = {}
    if op == "all_reduce":
        kw["op"] = draw(st.sampled_from(["sum", "avg", "max", "min"]))
    elif op == "all_gather":
        kw["dim"] = dim
    elif op == "reduce_scatter":
        kw.update(dim=dim, op=draw(st.sampled_from(["sum", "avg"])))
        in_shape[dim] = n * draw(st.integers(1, 2))
    elif op == "all_to_all":
        kw.update(split_dim=dim, concat_dim=draw(st.integers(0, len(in_shape) - 1)))
        in_shape[dim] = n * draw(st.integers(1, 2))
    elif op == "ppermute":
        dsts = draw(st.permutations(range(n)))
        kw["perm"] = [(s, d) for s, d in enumerate(dsts) if draw(st.booleans())]
    else:
        kw["src"] = draw(st.integers(0, n - 1))
    return make_case(op, shape, axes, kw, tuple(in_shape), draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=12)
@given(data=st.data())
def test_collective_equals_loop_over_ranks(op: str, data: Any) -> None:
    case = data.draw(cases(op))
    got = launch(functools.partial(run_cases, [case]), case.shape, timeout=20)
    check_case(case, [g[0] for g in got])


def test_sum_order_is_group_order() -> None:
    # values whose fp32 sum depends on the order: the threads backend adds in group order
    xs = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    got = launch(lambda m: comm.all_reduce(xs[m.rank], "dp"), {"dp": 4})
    want = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert all(torch.equal(g, want) for g in got)


def test_torch_func_grad_through_collectives() -> None:
    shape = {"dp": 2, "tp": 2}
    w = torch.arange(8.0).reshape(4, 2)

    def fn(mesh: Mesh) -> torch.Tensor:
        x = torch.full((2, 2), float(mesh.rank + 1))

        def loss(x: torch.Tensor) -> torch.Tensor:
            y = comm.all_gather(x, "tp", 0)  # [4, 2]
            return comm.reduce_scatter(y * w, ("dp", "tp"), 0).sum()

        return torch.func.grad(loss)(x)

    got = launch(fn, shape)
    xs = [torch.full((2, 2), float(r + 1), requires_grad=True) for r in range(4)]
    ys = [torch.cat([xs[s] for s in group_of(shape, r, ("tp",))]) * w for r in range(4)]
    total = sum(ys[1:], ys[0])
    sum(total.chunk(4)[r].sum() for r in range(4)).backward()
    for r in range(4):
        torch.testing.assert_close(got[r], xs[r].grad)


@settings(max_examples=8)
@given(
    shape=st.sampled_from([{"dp": 2}, {"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 1}]),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
)
def test_all_reduce_async_equals_all_reduce(shape: dict[str, int], op: str) -> None:
    def fn(mesh: Mesh) -> tuple[bool, int]:
        xs = [
            torch.randn(5, 3, generator=torch.Generator().manual_seed(mesh.rank + k))
            for k in range(3)
        ]
        with recording() as led:
            # several in flight at once, interleaved with a blocking collective on the same group
            pending = [comm.all_reduce_async(x.clone(), "dp", op) for x in xs]
            blocking = [comm.all_reduce(x, "dp", op) for x in xs]
            got = [p.wait() for p in reversed(pending)][::-1]
            again = pending[0].wait() is got[0]
        same = all(torch.equal(g, b) for g, b in zip(got, blocking))
        sent = led.bytes("all_reduce", "dp")
        return same and again, sent

    for same, sent in launch(fn, shape):
        assert same
        n = shape["dp"]
        assert sent == 2 * 2 * 3 * 60 * (n - 1) // n  # 3 tensors of 60 bytes, twice


def test_all_reduce_async_bad_arguments() -> None:
    def fn(mesh: Mesh) -> None:
        with pytest.raises(ValueError, match="op must be one of"):
            comm.all_reduce_async(torch.ones(2), "dp", "mean")
        with pytest.raises(TypeError, match="floating"):
            comm.all_reduce_async(torch.ones(2, dtype=torch.int64), "dp", "avg")
        with pytest.raises(ValueError, match="pp"):
            comm.all_reduce_async(torch.ones(2), "pp")

    launch(fn, {"dp": 2})


def test_ledger_is_off_by_default_and_resettable() -> None:
    def fn(mesh: Mesh) -> tuple[int, int, int]:
        x = torch.ones(4, 8)
        comm.all_gather(x, "tp")
        off = mesh.ledger.bytes()
        with recording() as led:
            comm.all_gather(x, "tp")
            comm.all_reduce(x, ("dp", "tp"))
        on = led.bytes(op="all_gather", axis="tp") + led.bytes(axis=("dp", "tp"))
        led.reset()
        return off, on, led.bytes()

    got = launch(fn, {"dp": 2, "tp": 2})
    # all_gather over 2: (2-1) * 128 bytes; all_reduce over 4: 2 * 3/4 * 128
    assert got == [(0, 128 + 192, 0)] * 4


# --- mismatches, timeouts, failures ---------------------------------------------------------


def _catch(call: Any) -> str:
    try:
        call()
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "second, named",
    [
        (lambda x: comm.all_gather(x, "dp"), "all_gather"),  # another op
        (lambda x: comm.all_reduce(x[:1], "dp"), "shape=(1,)"),  # another shape
        (lambda x: comm.all_reduce(x.double(), "dp"), "dtype=float64"),  # another dtype
        (lambda x: comm.all_reduce(x, "dp", "max"), "op='max'"),  # another argument
    ],
)
def test_mismatch_raises_on_every_rank(second: Any, named: str) -> None:
    def fn(mesh: Mesh) -> str:
        x = torch.ones(2)
        return _catch(lambda: comm.all_reduce(x, "dp") if mesh.rank == 0 else second(x))

    start = time.monotonic()
    got = launch(fn, {"dp": 2}, timeout=8)
    assert time.monotonic() - start < 10
    for msg in got:
        assert msg.startswith("CollectiveMismatchError"), msg
        assert "rank 0 called all_reduce(axis='dp', op='sum', shape=(2,)" in msg, msg
        assert "rank 1 called" in msg and named in msg, msg


@pytest.mark.timeout(30)
def test_axes_in_another_order_is_a_mismatch() -> None:
    def fn(mesh: Mesh) -> str:
        axes = ("dp", "tp") if mesh.rank else ("tp", "dp")
        return _catch(lambda: comm.all_gather(torch.ones(1), axes))

    got = launch(fn, {"dp": 2, "tp": 2}, timeout=8)
    assert all("CollectiveMismatchError" in m and "axis=('tp', 'dp')" in m for m in got), got


@pytest.mark.timeout(30)
def test_different_groups_raise_at_once_instead_of_timing_out() -> None:
    # rank 0 waits over "dp" (with rank 2), rank 1 over "tp" (with rank 0), ranks 2, 3 return:
    # nothing can ever complete, so both waiting ranks raise before the 20 s timeout.
    def fn(mesh: Mesh) -> str:
        if mesh.rank >= 2:
            return "returned"
        axis = "dp" if mesh.rank == 0 else "tp"
        return _catch(lambda: comm.all_reduce(torch.ones(1), axis))

    start = time.monotonic()
    got = launch(fn, {"dp": 2, "tp": 2}, timeout=20)
    assert time.monotonic() - start < 5
    for msg in got[:2]:
        assert msg.startswith("CollectiveMismatchError"), msg
        assert (
            "rank 0 waits in all_reduce(axis='dp'" in msg
            and "rank 1 waits in all_reduce(axis='tp'" in msg
        )
        assert "rank 2 has returned" in msg and "rank 3 has returned" in msg


@pytest.mark.timeout(30)
def test_missing_rank_times_out_naming_it() -> None:
    def fn(mesh: Mesh) -> torch.Tensor:
        if mesh.rank == 1:
            time.sleep(1.5)  # busy past rank 0's timeout
        return comm.all_reduce(torch.ones(1), "dp")

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(fn, {"dp": 2}, timeout=0.5)
    assert time.monotonic() - start < 5
    cause = info.value.__cause__
    assert info.value.rank == 0 and isinstance(cause, CollectiveTimeoutError)
    assert "ranks [1] did not arrive within 0.5 s" in str(cause)
    assert "rank 1 is running outside collectives" in str(cause)


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: comm.all_reduce(torch.ones(2), "tp", "prod", m), "'prod'"),
        (lambda m: comm.all_reduce(torch.ones(2, dtype=torch.long), "tp", "avg", m), "int64"),
        (lambda m: comm.all_gather(torch.ones(2), "tp", 1, m), "dim=1"),
        (lambda m: comm.reduce_scatter(torch.ones(3), "tp", 0, "sum", m), "x.shape\\[0\\] = 3"),
        (lambda m: comm.all_to_all(torch.ones(2, 3), "tp", 1, 0, m), "not divisible by the size 2"),
        (lambda m: comm.ppermute(torch.ones(2), "tp", [(0, 2)], m), "outside \\[0, 2\\)"),
        (lambda m: comm.ppermute(torch.ones(2), "tp", [(0, 1), (1, 1)], m), "repeats"),
        (lambda m: comm.broadcast(torch.ones(2), "tp", 5, m), "src=5"),
        (lambda m: comm.all_reduce(torch.ones(2), "xx", "sum", m), "'xx'"),
        (lambda m: comm.all_reduce([1.0], "tp", "sum", m), "list"),
    ],
)
def test_bad_arguments_name_the_value(call: Any, match: str) -> None:
    mesh = Mesh({"dp": 1, "tp": 2})
    with pytest.raises((ValueError, TypeError), match=match):
        call(mesh)


def test_groups_of_one_need_no_backend() -> None:
    mesh = Mesh({"dp": 1, "tp": 2})  # no world: groups over "dp" have one rank
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(comm.all_gather(x, "dp", 1, mesh), x)
    assert torch.equal(comm.ppermute(x, "dp", [], mesh), torch.zeros_like(x))
    with pytest.raises(RuntimeError, match="no backend world"):
        comm.all_reduce(x, "tp", mesh=mesh)
