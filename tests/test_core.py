"""The ground floor: scan_layers against a plain loop, the context stack, layered, P, random."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import colfunc as cf
from colfunc import core
from colfunc import random as cfr


def block(lp: dict, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ lp["w"] + lp["b"])


def make_blocks(layers: int, width: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(layers, width, width, generator=g) / width**0.5,
        "b": torch.randn(layers, width, generator=g),
    }


def loop(blocks: dict, h: torch.Tensor, order=None) -> torch.Tensor:
    for i in order if order is not None else range(blocks["w"].shape[0]):
        h = block({"w": blocks["w"][i], "b": blocks["b"][i]}, h)
    return h


def value_and_grads(fn, blocks: dict, h: torch.Tensor):
    leaves = [blocks["w"].clone().requires_grad_(), blocks["b"].clone().requires_grad_()]
    h = h.clone().requires_grad_()
    out = fn({"w": leaves[0], "b": leaves[1]}, h)
    grads = torch.autograd.grad(
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), [*leaves, h]
    )
    return out.detach(), grads


@given(
    layers=st.integers(1, 6),
    width=st.integers(1, 4),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_scan_layers_equals_a_python_loop(layers, width, batch, seed):
    blocks = make_blocks(layers, width, seed)
    h = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed + 1))
    out, grads = value_and_grads(lambda bl, x: cf.scan_layers(block, x, bl), blocks, h)
    ref, ref_grads = value_and_grads(loop, blocks, h)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


def test_scan_layers_needs_one_leading_layer_axis():
    blocks = {"w": torch.zeros(3, 2, 2), "b": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="leading layer axis"):
        cf.scan_layers(block, torch.zeros(1, 2), blocks)
    with pytest.raises(ValueError, match="leading layer axis"):
        cf.scan_layers(
            block, torch.zeros(1, 2), {"w": torch.zeros(3, 2, 2), "s": torch.tensor(1.0)}
        )


class Recorder:
    """An interceptor that logs, optionally wraps the block, and delegates inward."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.calls = name, log, 0

    def scan_layers(self, block_fn, h, blocks, xs, inner):
        self.log.append(self.name)

        def counted(lp, c, x):
            self.calls += 1
            return block_fn(lp, c, x)

        return inner(counted, h, blocks, xs)


class Reversed:
    """An interceptor that does not delegate: it runs the layers last to first itself."""

    def scan_layers(self, block_fn, h, blocks, xs, inner):
        n = core.num_layers(blocks)
        for i in reversed(range(n)):
            h, _ = block_fn({k: v[i] for k, v in blocks.items()}, h, None)
        return h, None


def test_interceptors_run_innermost_first_and_delegate():
    blocks = make_blocks(3, 2, seed=0)
    h = torch.randn(1, 2)
    log: list[str] = []
    outer, inner = Recorder("outer", log), Recorder("inner", log)
    with core.context(outer), core.context(object()), core.context(inner):
        out = cf.scan_layers(block, h, blocks)
    assert log == ["inner", "outer"]
    assert inner.calls == outer.calls == 3  # each wrapped block ran once per layer
    assert torch.equal(out, loop(blocks, h))


def test_an_interceptor_decides_how_layers_run():
    blocks = make_blocks(3, 2, seed=1)
    h = torch.randn(1, 2)
    log: list[str] = []
    outer = Recorder("outer", log)
    with core.context(outer), core.context(Reversed()):
        out = cf.scan_layers(block, h, blocks)
    assert log == []  # the innermost frame did not delegate, so the outer one never ran
    torch.testing.assert_close(out, loop(blocks, h, order=[2, 1, 0]), rtol=0, atol=0)
    assert not torch.allclose(out, loop(blocks, h))
    assert torch.equal(cf.scan_layers(block, h, blocks), loop(blocks, h))  # stack popped


def test_context_stack_is_restored_after_exceptions():
    a, b = object(), object()
    before = core.frames()
    with pytest.raises(KeyError), core.context(a), core.context(b):
        assert core.frames()[-2:] == (a, b)
        raise KeyError("boom")
    assert core.frames() == before


def test_frames_exited_out_of_order_are_reported():
    a, b = object(), object()
    ctx_a, ctx_b = core.context(a), core.context(b)
    ctx_a.__enter__()
    ctx_b.__enter__()
    with pytest.raises(RuntimeError, match="corrupted"):
        ctx_a.__exit__(None, None, None)  # b is still on top
    assert core.frames() == (b,)  # a was removed all the same
    ctx_b.__exit__(None, None, None)  # b is innermost again: a clean exit
    assert core.frames() == ()


def test_innermost_and_threads():
    class Mesh:
        pass

    m1, m2 = Mesh(), Mesh()
    seen: list[object] = []
    with core.context(m1), core.context(object()), core.context(m2):
        assert core.innermost(Mesh) is m2
        thread = threading.Thread(target=lambda: seen.append(core.innermost(Mesh)))
        thread.start()
        thread.join()
    assert seen == [None]  # the stack is per thread
    assert core.innermost(Mesh) is None


def pre(params, batch):
    return batch["x"] @ params["embed"]


def post(params, h, batch):
    return ((h @ params["head"] - batch["y"]) ** 2).mean()


def test_layered_is_pre_then_scan_then_post():
    g = torch.Generator().manual_seed(0)
    params = {
        "embed": torch.randn(3, 4, generator=g),
        "blocks": make_blocks(2, 4, seed=2),
        "head": torch.randn(4, 1, generator=g),
    }
    batch = {"x": torch.randn(5, 3, generator=g), "y": torch.randn(5, 1, generator=g)}
    loss_fn = cf.layered(pre, block, post, name="toy")
    expected = post(params, loop(params["blocks"], pre(params, batch)), batch)
    assert torch.equal(loss_fn(params, batch), expected)
    assert "toy" in repr(loss_fn)


def test_layered_errors():
    loss_fn = cf.layered(pre, block, post, name="toy")
    with pytest.raises(ValueError, match="'blocks'") as info:
        loss_fn({"embed": torch.ones(1), "head": torch.ones(1)}, {})
    assert "['embed', 'head']" in str(info.value)
    with pytest.raises(ValueError, match="'blocks'"):
        loss_fn([torch.ones(1)], {})
    with pytest.raises(TypeError, match="post"):
        cf.layered(pre, block, None)


axis_names = st.sampled_from(["dp", "tp", "pp", "sp"])
entries = st.one_of(st.none(), axis_names, st.lists(axis_names, min_size=1, max_size=2).map(tuple))


@given(st.lists(entries, max_size=4))
def test_p_rejects_an_axis_used_twice(spec):
    named = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    if len(named) != len(set(named)):
        with pytest.raises(ValueError, match="used for two dims"):
            cf.P(*spec)
    else:
        p = cf.P(*spec)
        assert tuple(p) == tuple(spec) and p.axes() == tuple(named)
        assert eval(repr(p), {"P": cf.P}) == p


@pytest.mark.parametrize("bad", [3, "", ("dp", None), (None,), ("dp", 1)])
def test_p_rejects_bad_entries(bad):
    with pytest.raises(TypeError, match="dim 1"):
        cf.P(None, bad)


@given(
    seed=st.integers(0, 2**31),
    path=st.text(alphabet="abc.", min_size=1, max_size=8),
    shape=st.lists(st.integers(1, 4), max_size=3).map(tuple),
)
def test_random_is_a_function_of_seed_and_path(seed, path, shape):
    a = cfr.normal(seed, path, shape, std=0.5)
    assert torch.equal(a, cfr.normal(seed, path, shape, std=0.5))
    # the same stream as torch.randn from the documented key, scaled
    g = torch.Generator().manual_seed(cfr.key(seed, path))
    assert torch.equal(a, torch.randn(shape, generator=g) * 0.5)
    if a.numel() >= 4:
        assert not torch.equal(a, cfr.normal(seed, path + ".x", shape, std=0.5))
        assert not torch.equal(a, cfr.normal(seed + 1, path, shape, std=0.5))
    u = cfr.uniform(seed, path, shape, -2.0, 3.0)
    assert ((u >= -2.0) & (u < 3.0)).all()
    assert torch.equal(
        cfr.normal(seed, path, shape, 1.0, torch.bfloat16),
        cfr.normal(seed, path, shape, 1.0).bfloat16(),
    )


def test_random_values_do_not_depend_on_creation_order():
    paths = ["embed", "blocks.attn.wq", "blocks.mlp.w1", "head"]
    first = {p: cfr.normal(0, p, (3, 2), std=1.0) for p in paths}
    torch.randn(7)  # the global generator is not involved either
    second = {p: cfr.normal(0, p, (3, 2), std=1.0) for p in reversed(paths)}
    assert all(torch.equal(first[p], second[p]) for p in paths)
    keys = {cfr.key(s, p) for s in (0, 1) for p in paths}
    assert len(keys) == 2 * len(paths)


def test_random_values_are_pinned():
    # Keys and values are part of the contract: a run re-initialised on another machine or with
    # another version starts from the same weights.
    assert cfr.key(0, "embed") == 844691895346051316
    expected = torch.tensor([-0.00333096319809556, 0.7955376505851746, 0.43649256229400635])
    assert torch.equal(cfr.normal(0, "blocks.wq", (3,), std=1.0), expected)


def test_random_errors():
    with pytest.raises(TypeError, match="seed"):
        cfr.key("0", "w")
    with pytest.raises(ValueError, match="std"):
        cfr.normal(0, "w", (2,), std=-1.0)
    with pytest.raises(ValueError, match="low < high"):
        cfr.uniform(0, "w", (2,), 1.0, 1.0)


@given(
    layers=st.integers(1, 5),
    early=st.sets(st.integers(0, 4)),
    seed=st.integers(0, 2**16),
)
def test_layer_grads_hands_every_layer_over_early_ones_first(layers, early, seed):
    """A LayerGrads frame receives each scanned layer's gradients once: the layers it names
    early during the backward pass, the others together afterwards, last layer first; each
    is what autograd gives that layer's rows, and the stacked leaves get zeros."""
    early = {i for i in early if i < layers}
    blocks = make_blocks(layers, 4, seed)
    h = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    got: list[tuple[int, dict]] = []
    frame = core.LayerGrads(lambda i, g, p: got.append((i, g)), early=lambda paths, n: early)
    leaves = {k: v.clone().requires_grad_() for k, v in blocks.items()}
    frame.track(leaves)
    weights = torch.linspace(-1, 1, 12).view(3, 4)
    with core.context(frame):
        out = cf.scan_layers(block, h, leaves)
        stacked = torch.autograd.grad((out * weights).sum(), list(leaves.values()))
    assert all(torch.equal(s, torch.zeros_like(s)) for s in stacked)  # taken, zeros handed back
    order = [i for i, _ in got]
    assert sorted(order) == list(range(layers))  # each layer once
    late = [i for i in order if i not in early]
    assert order[: len(order) - len(late)] == sorted(early, reverse=True)  # early ones first
    assert late == sorted(late, reverse=True)
    # against autograd on a plain loop over the rows
    rows = {k: [r.clone().requires_grad_() for r in v] for k, v in blocks.items()}
    x = h
    for i in range(layers):
        x = block({"w": rows["w"][i], "b": rows["b"][i]}, x)
    ref = torch.autograd.grad((x * weights).sum(), [r for k in ("w", "b") for r in rows[k]])
    for i, grads in got:
        torch.testing.assert_close(grads["w"], ref[i], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grads["b"], ref[layers + i], rtol=1e-6, atol=1e-7)
