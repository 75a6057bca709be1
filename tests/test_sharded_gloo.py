"""The ShardedTensor checks again on real gloo processes, 2 and 4 ranks, fewer examples.

Spawning costs seconds here, so each world size is launched once per module: one launch runs
every check (redistribute round trips, every op rule, shard_map, a tensor-parallel GPT step) and
returns the failures by check; the tests below only read them. The cases, shards and references
are built in this process, with the same helpers as the threads tests.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch
from test_rules import CASES, _check, _inputs, _reference
from test_sharded_tensor import PARTIALS, check_round_trips, dyadic, round_trip_cases, shards

import colfunc.sharding as cs
from colfunc import tree
from colfunc.core import P
from colfunc.models import gpt
from colfunc.sharding import Mesh, Partial, Replicate, Shard, comm, launch, shard_map

pytestmark = pytest.mark.timeout(300)

MESHES = {2: {"tp": 2}, 4: {"dp": 2, "tp": 2}}
GPT = gpt.Config(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_seq_len=16)


def _placements(
    rng: random.Random, ndim: int, n_axes: int, partial: bool = True
) -> tuple[Any, ...]:
    while True:
        choices = [Shard(d) for d in range(ndim)] + [Replicate()] + (PARTIALS if partial else [])
        pl = tuple(rng.choice(choices) for _ in range(n_axes))
        ops = {p.op for p in pl if isinstance(p, Partial)}
        if not ("max" in ops and len(ops) > 1):
            return pl


def _cases(mesh_shape: dict[str, int]) -> dict[str, Any]:
    rng, n = random.Random(len(mesh_shape)), len(mesh_shape)
    x = dyadic((5, 3, 4), seed=1)
    pairs = [(_placements(rng, 3, n), _placements(rng, 3, n)) for _ in range(24)]
    ops = {}
    for name, case in CASES.items():
        xs = _inputs(case, seed=len(name))
        pls = [_placements(rng, t.dim(), n, partial=t.is_floating_point()) for t in xs]
        parts = [shards(t, mesh_shape, pl, seed=i) for i, (t, pl) in enumerate(zip(xs, pls))]
        cot = dyadic(case.fn(*xs).shape, seed=99)
        ops[name] = (xs, parts, pls, cot, _reference(case, xs, cot))
    params = gpt.init(GPT, seed=0)
    ids = torch.randint(0, GPT.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    leaves = tree.map(lambda t: t.clone().requires_grad_(), params)
    loss = gpt.loss(GPT)(leaves, batch)
    loss.backward()
    model = (params, batch, loss.detach(), tree.map(lambda t: t.grad, leaves))
    return {
        "x": x,
        "round_trips": round_trip_cases(x, mesh_shape, pairs),
        "ops": ops,
        "model": model,
    }


def _gpt_check(mesh: Mesh, model: Any) -> list[str]:
    params, batch, want, want_grads = model
    plan = lambda p: next((s for pat, s in gpt.tp_plan.items() if tree.match(pat, p)), P())  # noqa: E731
    sharded = tree.map_with_path(
        lambda p, t: cs.distribute(t, mesh, plan(p)).requires_grad_(), params
    )
    with cs.strict():
        loss = gpt.loss(GPT)(sharded, batch)
        loss.backward()
    fails = [] if torch.allclose(loss.full_tensor(), want, rtol=1e-5) else ["gpt loss differs"]
    for (path, t), g in zip(tree.flatten_with_paths(sharded)[0], tree.leaves(want_grads)):
        if not torch.allclose(t.grad.full_tensor(), g, rtol=1e-5, atol=1e-6):
            fails.append(f"gpt grad {path} differs")
    return fails


def _shard_map_check(mesh: Mesh) -> list[str]:
    x, w = dyadic((4, 6), seed=2), dyadic((6, 5), seed=3)
    y = shard_map(lambda a, b: comm.all_reduce(a @ b, "tp"), mesh, (P(None, "tp"), P("tp")), P())(
        x, w
    )
    return [] if torch.equal(y.full_tensor(), x @ w) else ["shard_map row-parallel differs"]


def _all_checks(cases: dict[str, Any], mesh: Mesh) -> dict[str, list[str]]:
    out = {"round_trips": check_round_trips(mesh, cases["x"], cases["round_trips"])}
    for name, (xs, parts, pls, cot, want) in cases["ops"].items():
        out[f"op {name}"] = _check(mesh, CASES[name], xs, parts, pls, cot, want)
    out["shard_map"] = _shard_map_check(mesh)
    out["gpt"] = _gpt_check(mesh, cases["model"])
    return out


@pytest.fixture(scope="module", params=sorted(MESHES))
def gloo_results(request: pytest.FixtureRequest) -> list[dict[str, list[str]]]:
    mesh_shape = MESHES[request.param]
    return launch(
        functools.partial(_all_checks, _cases(mesh_shape)),
        mesh=mesh_shape,
        backend="gloo",
        timeout=120,
    )


def _failures(results: list[dict[str, list[str]]], prefix: str) -> dict[str, list[str]]:
    return {
        f"rank {r} {k}": v
        for r, res in enumerate(results)
        for k, v in res.items()
        if k.startswith(prefix) and v
    }


def test_redistribute_round_trips_on_gloo(gloo_results: list[dict[str, list[str]]]) -> None:
    assert _failures(gloo_results, "round_trips") == {}


def test_every_rule_on_gloo(gloo_results: list[dict[str, list[str]]]) -> None:
    assert len([k for k in gloo_results[0] if k.startswith("op ")]) == len(CASES)
    assert _failures(gloo_results, "op ") == {}


def test_shard_map_and_tensor_parallel_gpt_on_gloo(
    gloo_results: list[dict[str, list[str]]],
) -> None:
    assert _failures(gloo_results, "shard_map") == {}
    assert _failures(gloo_results, "gpt") == {}
