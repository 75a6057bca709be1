"""shard_map against a plain loop over mesh coordinates.

The reference runs the body once per mesh coordinate on plain slices of the full inputs, in one
process, with each collective written out as what it computes over the loop (a sum, a
concatenation, a shift), and assembles the outputs by the out-specs. Gradients of the reference
come from autograd through that loop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sharded_tensor import dyadic

import colfunc.sharding as cs
from colfunc.core import P
from colfunc.sharding import Mesh, Replicate, Shard, comm, distribute, launch, shard_map

pytestmark = pytest.mark.timeout(120)


def _grads(
    fn: Any, xs: list[torch.Tensor], cot: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.clone().requires_grad_() for x in xs]
    out = fn(*leaves)
    (out * cot).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _run(
    mesh_shape: dict[str, int],
    body: Any,
    in_specs: Any,
    out_specs: Any,
    xs: list[torch.Tensor],
    cot: torch.Tensor,
) -> list[Any]:
    def fn(mesh: Mesh) -> Any:
        leaves = [x.clone().requires_grad_() for x in xs]
        out = shard_map(body, mesh, in_specs, out_specs)(*leaves)
        (out * cot).sum().backward()
        return out.full_tensor(), [x.grad for x in leaves], out.placements

    return launch(fn, mesh=mesh_shape)


def _assert_all(
    results: list[Any], want: tuple[torch.Tensor, list[torch.Tensor]], placements: Any
) -> None:
    out_ref, grads_ref = want
    for out, grads, pl in results:
        assert pl == placements
        torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
        for g, r in zip(grads, grads_ref):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 4), b=st.integers(1, 4), d=st.integers(1, 7), f=st.integers(1, 6))
def test_column_parallel_body_without_collectives(n: int, b: int, d: int, f: int) -> None:
    x, w, cot = dyadic((b, d), 1), dyadic((d, f), 2), dyadic((b, f), 3)

    def loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # coordinate r holds all of x and the r-th torch.chunk of w's columns
        return torch.cat([x @ w_r for w_r in w.chunk(n, 1)] if f else [x @ w], 1)

    results = _run(
        {"tp": n}, lambda x_l, w_l: x_l @ w_l, (P(), P(None, "tp")), P(None, "tp"), [x, w], cot
    )
    _assert_all(results, _grads(loop, [x, w], cot), (Shard(1),))


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 4), b=st.integers(1, 4), d=st.integers(1, 7), f=st.integers(1, 6))
def test_row_parallel_body_with_all_reduce(n: int, b: int, d: int, f: int) -> None:
    x, w, cot = dyadic((b, d), 4), dyadic((d, f), 5), dyadic((b, f), 6)

    def loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # all_reduce over the loop: the sum of every coordinate's partial product
        parts = [x_r @ w_r for x_r, w_r in zip(x.chunk(n, 1), w.chunk(n, 0))]
        return torch.stack(parts).sum(0)

    def body(x_l: torch.Tensor, w_l: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(x_l @ w_l, "tp")

    results = _run({"tp": n}, body, (P(None, "tp"), P("tp")), P(), [x, w], cot)
    _assert_all(results, _grads(loop, [x, w], cot), (Replicate(),))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), rows=st.integers(1, 3))
def test_ring_shift_with_ppermute(n: int, rows: int) -> None:
    x, cot = dyadic((n * rows, 3), 7), dyadic((n * rows, 3), 8)

    def loop(x: torch.Tensor) -> torch.Tensor:
        chunks = [(x_r * 2) for x_r in x.chunk(n, 0)]
        return torch.cat([chunks[(r - 1) % n] for r in range(n)], 0)

    def body(x_l: torch.Tensor) -> torch.Tensor:
        return comm.ppermute(x_l * 2, "tp", [(i, (i + 1) % n) for i in range(n)])

    results = _run({"tp": n}, body, P("tp"), P("tp"), [x], cot)
    _assert_all(results, _grads(loop, [x], cot), (Shard(0),))


def test_two_axis_mesh_with_sharded_inputs_and_a_partial_output() -> None:
    """Inputs already sharded otherwise are redistributed to the in-specs; a Partial out-spec
    leaves the body's per-rank results to be summed."""
    x, w, cot = dyadic((4, 6), 9), dyadic((6, 5), 10), dyadic((4, 5), 11)
    dp, tp = 2, 2

    def loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # coordinate (i, j): rows chunk i of x, contraction chunk j; Partial over tp, split over dp
        rows = []
        for x_i in x.chunk(dp, 0):
            rows.append(sum(x_ij @ w_j for x_ij, w_j in zip(x_i.chunk(tp, 1), w.chunk(tp, 0))))
        return torch.cat(rows, 0)

    def fn(mesh: Mesh) -> Any:
        xs = distribute(x, mesh, [Replicate(), Shard(0)]).requires_grad_()
        ws = distribute(w, mesh, [Shard(1), Replicate()]).requires_grad_()
        out = shard_map(
            lambda a, b: a @ b, mesh, (P("dp", "tp"), P("tp")), [Shard(0), cs.Partial()]
        )(xs, ws)
        (out * cot).sum().backward()
        return out.placements, out.full_tensor(), xs.grad.full_tensor(), ws.grad.full_tensor()

    out_ref, (gx, gw) = _grads(loop, [x, w], cot)
    for pl, out, gx_, gw_ in launch(fn, mesh={"dp": dp, "tp": tp}):
        assert pl == (Shard(0), cs.Partial())
        assert torch.equal(out, out_ref) and torch.equal(gx_, gx) and torch.equal(gw_, gw)


def test_bad_specs_raise() -> None:
    mesh = Mesh({"tp": 1})
    mapped = shard_map(lambda a, b: a + b, mesh, (P(),), P())
    with pytest.raises(ValueError, match=r"one entry per argument.*2 arguments"):
        mapped(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"axis 'dp'.*mesh axes are \('tp',\)"):
        shard_map(lambda a: a, mesh, (P("dp"),), P())(torch.zeros(2))
