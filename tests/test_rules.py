"""Propagation rules: every op with a rule, on sharded inputs, equals the op on full inputs.

Each case runs an op (through the ATen ops it decomposes into) on ShardedTensors whose
placements are drawn per mesh axis, Partial ones built from uneven random pieces, under strict
mode, so an op that fell back would fail. The output's full tensor and the inputs' gradients
(through a random cotangent) are compared with plain PyTorch on the full tensors: equal where no
sum is reordered (dyadic inputs make sums and products exact), else within 1e-6.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sharded_tensor import dyadic, meshes, placements, shards

import colfunc.sharding as cs
from colfunc import ops
from colfunc.sharding import Mesh, Replicate, Shard, from_local, launch

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass(frozen=True)
class Case:
    """``fn`` on inputs of ``shapes``; an int entry ``("ids", shape, high)`` is an index tensor."""

    fn: Callable[..., torch.Tensor]
    shapes: tuple[Any, ...]
    exact: bool = True
    grad: bool = True


def ids(shape: tuple[int, ...], high: int) -> tuple[str, tuple[int, ...], int]:
    return ("ids", shape, high)


def targets(shape: tuple[int, ...], high: int) -> tuple[str, tuple[int, ...], int]:
    return ("targets", shape, high)


CASES: dict[str, Case] = {
    # matrix products
    "mm": Case(torch.mm, ((5, 6), (6, 7))),
    "addmm": Case(lambda b, x, w: torch.addmm(b, x, w), ((7,), (5, 6), (6, 7))),
    "bmm": Case(torch.bmm, ((3, 4, 5), (3, 5, 2))),
    "matmul_3d_2d": Case(torch.matmul, ((2, 5, 6), (6, 3))),
    "linear": Case(lambda x, w, b: F.linear(x, w.t(), b), ((2, 3, 6), (6, 4), (4,))),
    # elementwise, with broadcasting
    "add": Case(lambda x, y: x + y, ((5, 6), (6,))),
    "sub": Case(lambda x, y: x - 2 * y, ((5, 6), (5, 1))),
    "mul": Case(lambda x, y: x * y, ((5, 6), (1, 6))),
    "div": Case(lambda x, y: x / (y.abs() + 1), ((5, 6), (5, 6)), exact=False),
    "neg_scalar": Case(lambda x: -x * 3 + 1, ((4, 5),)),
    "pow": Case(lambda x: x.pow(2), ((4, 5),)),
    "exp": Case(torch.exp, ((4, 5),), exact=False),
    "rsqrt": Case(lambda x: torch.rsqrt(x.abs() + 1), ((4, 5),), exact=False),
    "tanh": Case(torch.tanh, ((4, 5),), exact=False),
    "gelu_tanh": Case(lambda x: F.gelu(x, approximate="tanh"), ((4, 5),), exact=False),
    "gelu": Case(F.gelu, ((4, 5),), exact=False),
    "silu": Case(F.silu, ((4, 5),), exact=False),
    "relu": Case(F.relu, ((4, 5),)),
    "where": Case(lambda x, y: torch.where(x > 0, x, y), ((4, 5), (5,))),
    "cast": Case(lambda x: x.double().float(), ((4, 5),)),
    # reductions
    "sum": Case(lambda x: x.sum(), ((3, 5),)),
    "sum_dim": Case(lambda x: x.sum(1), ((3, 5, 2),)),
    "sum_dims_keepdim": Case(lambda x: x.sum((0, 2), keepdim=True), ((3, 5, 2),)),
    "mean": Case(lambda x: x.mean(), ((3, 5),), exact=False),
    "mean_dim": Case(lambda x: x.mean(-1, keepdim=True), ((3, 5),), exact=False),
    "amax": Case(lambda x: x.amax(1), ((3, 5),)),
    "max": Case(lambda x: x.max(), ((3, 5),)),
    "max_dim": Case(lambda x: x.max(1).values, ((3, 5),)),
    # views and reshapes
    "view_heads": Case(lambda x: x.view(2, 3, 2, 4).transpose(1, 2), ((2, 3, 8),)),
    "reshape_merge": Case(lambda x: x.reshape(6, 8), ((2, 3, 8),)),
    "reshape_flat": Case(lambda x: x.reshape(-1), ((3, 4),)),
    "transpose": Case(lambda x: x.transpose(0, 2), ((2, 3, 4),)),
    "t": Case(torch.t, ((3, 5),)),
    "permute": Case(lambda x: x.permute(2, 0, 1), ((2, 3, 4),)),
    "split": Case(lambda x: x.split(2, dim=1)[1], ((3, 5),)),
    "cat": Case(lambda x, y: torch.cat([x, y], dim=1), ((3, 2), (3, 4))),
    "stack": Case(lambda x, y: torch.stack([x, y], 1), ((3, 4), (3, 4))),
    "unsqueeze": Case(lambda x: x.unsqueeze(1), ((3, 4),)),
    "squeeze": Case(lambda x: x.squeeze(1), ((3, 1, 4),)),
    "expand": Case(lambda x: x.expand(2, 3, 5, 4), ((3, 1, 4),)),
    "slice": Case(lambda x: x[:, 1:4], ((3, 5),)),
    "select": Case(lambda x: x[:, 2], ((3, 5),)),
    "unbind": Case(lambda x: x.unbind(0)[1], ((3, 5),)),
    # embedding and indexing
    "embedding": Case(lambda w, i: F.embedding(i, w), ((7, 6), ids((2, 5), 7))),
    "index_select_0": Case(lambda x, i: x.index_select(0, i), ((7, 5), ids((4,), 7))),
    "index_select_1": Case(lambda x, i: x.index_select(1, i), ((3, 6), ids((5,), 6))),
    # softmax, norms, attention, losses
    "softmax": Case(lambda x: F.softmax(x, -1), ((4, 7),), exact=False),
    "log_softmax": Case(lambda x: F.log_softmax(x, -1), ((4, 7),), exact=False),
    "log_softmax_dim0": Case(lambda x: F.log_softmax(x, 0), ((5, 3),), exact=False),
    "layer_norm": Case(
        lambda x, w, b: F.layer_norm(x, (6,), w, b), ((2, 3, 6), (6,), (6,)), exact=False
    ),
    "rms_norm": Case(lambda x, w: ops.rms_norm(x, w), ((2, 3, 6), (6,)), exact=False),
    "attention": Case(
        lambda q, k, v: ops.attention(q, k, v),
        ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8)),
        exact=False,
    ),
    "attention_gqa": Case(
        lambda q, k, v: ops.attention(q, k, v),
        ((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
        exact=False,
    ),
    "cross_entropy": Case(
        lambda x, t: F.cross_entropy(x, t), ((6, 7), targets((6,), 7)), exact=False
    ),
    "cross_entropy_sum": Case(
        lambda x, t: F.cross_entropy(x, t, reduction="sum"), ((6, 7), targets((6,), 7)), exact=False
    ),
    "nll_none": Case(lambda x, t: F.nll_loss(x, t, reduction="none"), ((6, 7), targets((6,), 7))),
    # factories
    "zeros_like": Case(lambda x: torch.zeros_like(x) + x, ((3, 4),)),
    "ones_like": Case(lambda x: torch.ones_like(x) * x, ((3, 4),)),
    "full_like": Case(lambda x: torch.full_like(x, 2.0) * x, ((3, 4),)),
    "empty_like": Case(lambda x: torch.empty_like(x).fill_(0.5) + x, ((3, 4),)),
    "new_zeros": Case(lambda x: x.new_zeros(3, 4) + x, ((3, 4),)),
}


def _inputs(case: Case, seed: int) -> list[torch.Tensor]:
    out = []
    for i, s in enumerate(case.shapes):
        g = torch.Generator().manual_seed(seed + i)
        if isinstance(s, tuple) and s and s[0] in ("ids", "targets"):
            kind, shape, high = s
            t = torch.randint(0, high, shape, generator=g)
            if kind == "targets":
                t[0] = -100  # an ignored target
            out.append(t)
        else:
            out.append(dyadic(s, seed + i))
    return out


def _reference(
    case: Case, xs: list[torch.Tensor], cot: torch.Tensor
) -> tuple[torch.Tensor, list[Any]]:
    leaves = [x.clone().requires_grad_() if x.is_floating_point() else x for x in xs]
    out = case.fn(*leaves)
    (out * cot).sum().backward()
    return out.detach(), [x.grad if x.is_floating_point() else None for x in leaves]


def _check(
    mesh: Mesh,
    case: Case,
    xs: list[torch.Tensor],
    parts: list[Any],
    pls: list[Any],
    cot: torch.Tensor,
    want: Any,
) -> list[str]:
    out_ref, grads_ref = want
    inputs = []
    for x, p, pl in zip(xs, parts, pls):
        t = from_local(p[mesh.rank], mesh, pl, shape=tuple(x.shape))
        inputs.append(t.requires_grad_() if x.is_floating_point() else t)
    with cs.strict():
        out = case.fn(*inputs)
        (out * cot).sum().backward()
    got = [out.full_tensor()] + [
        t.grad.full_tensor() for t, x in zip(inputs, xs) if x.is_floating_point()
    ]
    ref = [out_ref] + [g for g in grads_ref if g is not None]
    fails = []
    for name, a, b in zip(["output"] + [f"grad {i}" for i in range(len(ref) - 1)], got, ref):
        close = torch.equal(a, b) if case.exact else torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        if not close:
            fails.append(f"{name} differs by {(a - b).abs().max().item():.3g} (placements {pls})")
    return fails


def _index_placements(ndim: int, n_axes: int) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.tuples(
        *[st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1)))] * n_axes
    )


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_rule_matches_the_full_op(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    mesh_shape = data.draw(meshes.filter(lambda s: math.prod(s.values()) <= 4), label="mesh")
    xs = _inputs(case, seed=len(name))
    pls = [
        data.draw(
            (placements if x.is_floating_point() else _index_placements)(x.dim(), len(mesh_shape)),
            label=f"input {i}",
        )
        for i, x in enumerate(xs)
    ]
    parts = [shards(x, mesh_shape, pl, seed=i) for i, (x, pl) in enumerate(zip(xs, pls))]
    out_shape = case.fn(*xs).shape
    cot = dyadic(out_shape, seed=99)
    want = _reference(case, xs, cot)
    results = launch(lambda mesh: _check(mesh, case, xs, parts, pls, cot, want), mesh=mesh_shape)
    assert results == [[]] * len(results), results[0]


def test_vocab_parallel_cross_entropy_reduces_little() -> None:
    """Logits split on the vocabulary: log_softmax and nll need two all_reduces of [N, 1] and a
    scalar, not a gather of the logits (Megatron's vocab-parallel cross-entropy)."""
    x, t = dyadic((6, 16), seed=1), torch.tensor([1, 5, -100, 15, 8, 0])
    want = F.cross_entropy(x, t)

    def fn(mesh: Mesh) -> tuple[Any, int, dict[Any, int]]:
        xs = cs.distribute(x, mesh, [Shard(1)])
        with cs.recording(mesh) as led, cs.strict():
            loss = F.cross_entropy(xs, t)
        sent = led.as_dict()
        return loss.placements, sent, loss.full_tensor()

    for pl, sent, loss in launch(fn, mesh={"tp": 4}):
        assert pl == (cs.Partial(),)
        assert (
            set(sent) == {("all_reduce", "tp")}
            and sent[("all_reduce", "tp")] == 2 * 3 * 6 * 4 * 2 // 4
        )
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def test_head_split_view_keeps_heads_sharded() -> None:
    """[B, T, H*E] split on H*E becomes [B, T, H, E] split on H, with no communication."""
    x = dyadic((2, 3, 8), seed=2)

    def fn(mesh: Mesh) -> tuple[Any, int]:
        with cs.recording(mesh) as led:
            y = cs.distribute(x, mesh, [Shard(2)]).view(2, 3, 4, 2)
        return y.placements, led.bytes()

    assert launch(fn, mesh={"tp": 2}) == [((Shard(2),), 0)] * 2
    # 3 heads over 2 ranks: the chunk boundary would cut a head, so the view gathers
    assert (
        launch(
            lambda m: (
                cs.distribute(dyadic((2, 3, 6), 3), m, [Shard(2)]).view(2, 3, 3, 2).placements
            ),
            mesh={"tp": 2},
        )
        == [(Replicate(),)] * 2
    )


def test_empty_shards_skip_the_kernel() -> None:
    """4 heads split over 3 ranks leave rank 2 no head, on which the CPU flash attention kernel
    faults (SIGFPE); the empty outputs are made without running it."""
    q = dyadic((2, 4, 5, 8), seed=4)
    leaf = q.clone().requires_grad_()
    ops.attention(leaf, leaf, leaf).sum().backward()

    def fn(mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        qs = cs.distribute(q, mesh, [Shard(1)]).requires_grad_()
        with cs.strict():
            out = ops.attention(qs, qs, qs)
            out.sum().backward()
        return out.full_tensor(), qs.grad.full_tensor(), tuple(out.to_local().shape)

    results = launch(fn, mesh={"tp": 3})
    assert results[2][2] == (2, 0, 5, 8)
    for out, grad, _ in results:
        torch.testing.assert_close(out, ops.attention(q, q, q), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-6, atol=1e-6)
