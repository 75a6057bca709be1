"""The collective cases of ``test_comm.py`` on real gloo processes, with 2 and 4 ranks.

One launch per mesh for the whole module (spawning processes costs seconds on a small machine):
the fixture runs every case on every rank and returns the results; each test then checks its
op against the single-process reference, the ring formula of the ledger, and the threads backend.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch
from test_comm import OPS, Case, check_case, make_case, run_cases

from colfunc.sharding import launch

pytestmark = pytest.mark.timeout(120)

MESHES = ({"dp": 2}, {"dp": 2, "tp": 2})


def module_cases(shape: dict[str, int], seed: int = 0) -> list[Case]:
    """Every op over every axis and tuple of axes (both orders), with drawn dims and shapes."""
    rng = random.Random(seed)
    names = list(shape)
    axis_sets = [(a,) for a in names] + (
        [tuple(names), tuple(reversed(names))] if len(names) > 1 else []
    )
    out = []
    m = len(axis_sets)  # variants are spread over the axis sets: each is run at least once
    for op in OPS:
        for k, axes in enumerate(axis_sets):
            n = 1
            for a in axes:
                n *= shape[a]
            in_shape = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
            dim = rng.randrange(len(in_shape))
            kws: list[dict[str, Any]]
            if op == "all_reduce":
                kws = [{"op": red} for red in ("sum", "avg", "max", "min")[k::m]]
            elif op == "all_gather":
                kws = [{"dim": dim}]
            elif op == "reduce_scatter":
                in_shape[dim] = n * rng.randint(1, 2)
                kws = [{"dim": dim, "op": red} for red in ("sum", "avg")[k % 2 :: m]]
            elif op == "all_to_all":
                in_shape[dim] = n * rng.randint(1, 2)
                kws = [{"split_dim": dim, "concat_dim": rng.randrange(len(in_shape))}]
            elif op == "ppermute":
                dsts = rng.sample(range(n), n)
                kws = [{"perm": [(i, (i + 1) % n) for i in range(n)]}, {"perm": [(0, dsts[0])]}][
                    k % 2 :: m
                ]
            else:
                kws = [{"src": rng.randrange(n)}]
            for kw in kws:
                out.append(make_case(op, shape, axes, kw, tuple(in_shape), rng.randrange(2**16)))
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[Case], list, list]]:
    """Per world size: the cases, the gloo results, the threads results (indexed [rank][case])."""
    out = {}
    for shape in MESHES:
        cases = module_cases(shape)
        gloo = launch(functools.partial(run_cases, cases), shape, backend="gloo", timeout=60)
        threads = launch(functools.partial(run_cases, cases), shape, backend="threads")
        out[len(gloo)] = (cases, gloo, threads)
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_gloo_equals_loop_over_ranks(runs: dict, size: int, op: str) -> None:
    cases, gloo, _ = runs[size]
    checked = 0
    for k, case in enumerate(cases):
        if case.op == op:
            check_case(case, [gloo[r][k] for r in range(size)])
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_equals_threads_exactly(runs: dict, size: int) -> None:
    cases, gloo, threads = runs[size]
    for k, case in enumerate(cases):
        for r in range(size):
            a, b = gloo[r][k], threads[r][k]
            where = f"{case.op}{case.kw} over {case.axes}, rank {r}"
            assert torch.equal(a["y"], b["y"]) and torch.equal(a["grad"], b["grad"]), where
            assert a["sent"] == b["sent"], where


def _mismatched(mesh: Any) -> str:
    """Rank 0 calls all_reduce while rank 1 calls all_gather; each returns what it raised."""
    from colfunc.sharding import CollectiveMismatchError, comm

    x = torch.ones(4)
    try:
        if mesh.rank == 0:
            comm.all_reduce(x, "dp", mesh=mesh)
        else:
            comm.all_gather(x, "dp", 0, mesh)
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def _one_rank_hangs(mesh: Any) -> None:
    import time

    from colfunc.sharding import comm

    if mesh.rank == 0:
        comm.all_reduce(torch.ones(4), "dp", mesh=mesh)
    else:
        time.sleep(6)  # never reaches the collective


def test_debug_flag_turns_a_mismatch_into_an_error_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    monkeypatch.setenv("COLFUNC_DEBUG_COLLECTIVES", "1")
    t0 = time.monotonic()
    said = launch(_mismatched, {"dp": 2}, backend="gloo", timeout=20)
    assert time.monotonic() - t0 < 10 + 5  # (process start-up included)
    calls = (
        "rank 0 called all_reduce(axis='dp', op='sum', shape=(4,), dtype=float32); "
        "rank 1 called all_gather(axis='dp', dim=0, shape=(4,), dtype=float32)"
    )
    for r, message in enumerate(said):
        assert message == f"rank {r}: ranks (0, 1) entered different collectives: {calls}"


def test_without_the_flag_the_timeout_ends_a_hang_with_a_named_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from colfunc.sharding import CollectiveTimeoutError, RankFailedError

    monkeypatch.delenv("COLFUNC_DEBUG_COLLECTIVES", raising=False)
    with pytest.raises(RankFailedError) as info:
        launch(_one_rank_hangs, {"dp": 2}, backend="gloo", timeout=2)
    cause = info.value.__cause__
    assert isinstance(cause, CollectiveTimeoutError)
    assert str(cause).startswith(
        "rank 0: all_reduce(axis='dp', op='sum', shape=(4,), dtype=float32) did not complete "
        "within the collective timeout (2 s)"
    )


def _scatters(mesh: Any) -> list[torch.Tensor]:
    """Reduce-scatters of drawn (not small-integer) values: blocking along dims 0 and 1, started
    asynchronously, summed and averaged, in fp32 and bf16."""
    from colfunc.sharding import comm

    g = torch.Generator().manual_seed(100 + mesh.rank)
    n = mesh.axis_size("dp")
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3 * n, 5, generator=g).to(dtype)
        out.append(comm.reduce_scatter(x, "dp", 0, "sum", mesh))
        out.append(comm.reduce_scatter(x.T.contiguous(), "dp", 1, "avg", mesh))
        out.append(comm.reduce_scatter_async(x.clone(), "dp", "avg", mesh).wait())
        out.append(comm.reduce_scatter_async(x.clone(), "dp", "sum", mesh).wait())
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_reduce_scatter_sums_in_group_order_as_threads(size: int) -> None:
    """Gloo's reduce-scatter (an all-to-all, then the chunks added in group order) gives the
    threads backend's numbers bit for bit, rounding included, blocking or started early."""
    shape = {"dp": size}
    gloo = launch(_scatters, shape, backend="gloo", timeout=60)
    threads = launch(_scatters, shape, backend="threads")
    for r in range(size):
        for k, (a, b) in enumerate(zip(gloo[r], threads[r], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {r}, case {k}"
