"""ZeRO-3 gathers each layer ``prefetch`` layers ahead of its use, frees it after use, and gathers
it again for the backward pass without recomputing the layer.

The probes read this rank's ledger as the forward pass enters each layer and as the backward
pass reaches it: the all_gather bytes recorded by then must be exactly those of the layers that
``prefetch`` says have been started. Memory: at most ``2 + prefetch`` gathered layers are alive
at once (the activations aside), where keeping the gathered weights for the backward pass would
hold all of them. Results equal the single-device step in fp64, for every prefetch depth and
remat policy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import core, models, optim

pytestmark = pytest.mark.timeout(240)

ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))


def _problem(name="gpt", dtype=torch.float64, n_layer=4, steps=2, rows=8):
    model = {"gpt": models.gpt, "llama": models.llama}[name]
    cfg = model.Config(vocab_size=64, n_layer=n_layer, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.to(dtype), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (rows, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


@settings(max_examples=6)
@given(
    name=st.sampled_from(["gpt", "llama"]),
    dp=st.sampled_from([2, 4]),
    prefetch=st.integers(0, 3),
    remat=st.sampled_from(["none", "full", "save_matmuls"]),
)
def test_prefetch_equals_single_device(name, dp, prefetch, remat) -> None:
    model, cfg, params, batches = _problem(name)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)

    def main(mesh):
        step = cf.remat(cf.zero(cf.shard(ref, mesh), 3, prefetch=prefetch), remat)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": dp})


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_tensor_parallel_inside_zero3_without_recomputing(name) -> None:
    """dp=2 x tp=2: the saved tensor-parallel weights are ShardedTensors, known by their local
    pieces' storage and rewrapped as they were, with and without sequence parallelism."""
    model, cfg, params, batches = _problem(name, n_layer=3)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)

    def main(mesh):
        for sp in (False, True):
            step = cf.zero(
                cf.shard(ref, mesh, plan=model.tp_plan, sequence_parallel=sp), 3, prefetch=1
            )
            cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
        return cf.sharding.fallback_counts(mesh)

    cf.sharding.reset_fallback_counts()
    assert cf.launch(main, mesh={"dp": 2, "tp": 2}) == [{}] * 4


class _Probe(torch.autograd.Function):
    """Records the ledger when the forward pass enters a layer and when the backward leaves it."""

    @staticmethod
    def forward(h, read, log):
        log.append(("forward", read()))
        return h.view_as(h)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.read, ctx.log = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(("backward", ctx.read()))
        return g, None, None


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_layers_are_gathered_prefetch_layers_ahead(prefetch) -> None:
    L = 4
    model, cfg, params, batches = _problem(n_layer=L)
    loss = model.loss(cfg)
    per_layer = sum(x[0].numel() * x.element_size() for x in cf.tree.tensors(params["blocks"]))

    def probed(mesh):
        log: list = []
        read = lambda: mesh.ledger.bytes("all_gather", "dp")  # noqa: E731
        block = lambda layer, h: loss.block(layer, _Probe.apply(h, read, log))  # noqa: E731
        fn = core.layered(loss.pre, block, loss.post, name=loss.name)
        step = cf.zero(cf.shard(cf.train_step(fn, optim.sgd(0.1)), mesh), 3, prefetch=prefetch)
        state = step.init(params)
        with cf.sharding.recording(mesh):
            step(state, batches[0])
        if mesh.rank == 0:
            return list(log)
        return None

    got = cf.launch(probed, mesh={"dp": 2})[0]
    # 2 ranks: a gathered layer is received as its own chunk's bytes, half the layer (padding
    # aside: every size here is even), and the parameters outside the layers come first
    half = per_layer // 2
    fwd = [b for kind, b in got if kind == "forward"]
    bwd = [b for kind, b in got if kind == "backward"]
    rest = fwd[0] - half * min(L, 1 + prefetch)
    assert fwd == [rest + half * min(L, i + 1 + prefetch) for i in range(L)]
    # the backward pass leaves layer i (last first) once it and the layers after it were
    # gathered again, and the `prefetch` before it started
    want = [fwd[-1] + half * (L - i + min(prefetch, i)) for i in reversed(range(L))]
    assert bwd == want


def test_at_most_two_plus_prefetch_gathered_layers_are_alive() -> None:
    cfg = models.gpt.Config(n_layer=8)  # the 8-layer tiny GPT
    params = models.gpt.init(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    ref = cf.train_step(models.gpt.loss(cfg), optim.adamw(1e-3))
    layer = sum(x[0].numel() * x.element_size() for x in cf.tree.tensors(params["blocks"]))
    with cf.memory.track(params) as t:  # one rank's half of the batch, on one device
        _, grads = ref.forward_backward(params, {k: v[:2] for k, v in batch.items()}, {})
    activations = t.peak - cf.tree.size_bytes(grads)

    def main(mesh):
        out = {}
        for prefetch in (0, 1, 2):
            step = cf.zero(cf.shard(ref, mesh), 3, prefetch=prefetch)
            state = step.init(params)
            with cf.memory.track(state) as t:
                _, grads = step.forward_backward(state.params, batch, state.extra)
            out[prefetch] = t.peak - cf.tree.size_bytes(grads)
        return out

    for held in cf.launch(main, mesh={"dp": 2}):
        for prefetch, extra in held.items():
            # kept for the backward pass, the gathered weights would add all 8 layers
            assert extra - activations <= (2 + prefetch) * layer, (prefetch, extra, activations)


def _zero3_on_gloo(mesh):
    model, cfg, params, batches = _problem(n_layer=3)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    plan = model.tp_plan if "tp" in mesh.shape else None
    step = cf.zero(cf.shard(ref, mesh, plan=plan), 3, prefetch=1)
    losses = cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
    x = torch.arange(4.0) + 10 * mesh.rank
    got = cf.sharding.comm.all_gather_async(x, "dp").wait()
    torch.testing.assert_close(got, cf.sharding.comm.all_gather(x, "dp"), rtol=0, atol=0)
    return losses


@pytest.mark.parametrize("shape", [{"dp": 2}, {"dp": 2, "tp": 2}])
def test_zero3_prefetch_on_gloo_processes(shape) -> None:
    results = cf.launch(_zero3_on_gloo, mesh=shape, backend="gloo", timeout=180)
    assert all(r == results[0] for r in results)


def test_bad_prefetch_is_a_value_error() -> None:
    model, cfg, _, _ = _problem()
    ref = cf.train_step(model.loss(cfg), optim.sgd(0.1))
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="prefetch"):
            cf.zero(ref, 3, prefetch=bad)
