"""Data-parallel gradient buckets start during the backward pass, and change no number.

The probe: a block whose backward pass reads this rank's ledger. The backward pass reaches
layer ``i`` after layers ``L-1 .. i+1``; with one-byte buckets each layer's gradients are sent as
soon as they exist, so at layer ``i`` the ledger must already hold exactly the ``all_reduce``
bytes of the later layers. Reducing after the backward pass (``overlap=False``) shows zero there.
The reduced numbers must equal those of the reduction after the backward pass bit for bit (the
same sums in the same order), and the single-device step within fp64 rounding.
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
TINY_BUCKET = 1e-6  # megabytes: one byte, so every layer's gradients start their own reduction


def _problem(name="gpt", dtype=torch.float64, n_layer=3, d_model=32, steps=2):
    model = {"gpt": models.gpt, "llama": models.llama}[name]
    cfg = model.Config(vocab_size=64, n_layer=n_layer, n_head=4, d_model=d_model, max_seq_len=32)
    params = cf.tree.map(lambda x: x.to(dtype), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


class _Probe(torch.autograd.Function):
    """Identity whose backward records what the ledger holds at that moment."""

    @staticmethod
    def forward(h, read, log):
        return h.view_as(h)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.read, ctx.log = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.read())
        return g, None, None


def _probed(loss: core.Layered, read, log) -> core.Layered:
    block = lambda layer, h: _Probe.apply(loss.block(layer, h), read, log)  # noqa: E731
    return core.layered(loss.pre, block, loss.post, name=loss.name, divisors=loss.divisors)


def _sent_during_backward(mesh, transform, params, batch, cfg, model):
    """The dp all_reduce bytes in the ledger as the backward pass reaches each layer (last first)."""
    log: list[int] = []
    read = lambda: mesh.ledger.bytes("all_reduce", "dp")  # noqa: E731
    step = transform(cf.train_step(_probed(model.loss(cfg), read, log), optim.sgd(0.1)))
    state = step.init(params)
    with cf.sharding.recording(mesh):
        before = read()
        step(state, batch)
    return [v - before for v in log]


def _layer_bytes(params, tp: int = 1) -> int:
    blocks = cf.tree.tensors(params["blocks"])
    return sum(x[0].numel() * x.element_size() for x in blocks)


def test_buckets_start_while_the_backward_pass_runs() -> None:
    model, cfg, params, batches = _problem(n_layer=4)
    layer = _layer_bytes(params)

    def main(mesh):
        got = {}
        for overlap in (True, False):
            t = lambda s, o=overlap: cf.shard(s, mesh, bucket_mb=TINY_BUCKET, overlap=o)  # noqa: E731
            got[overlap] = _sent_during_backward(mesh, t, params, batches[0], cfg, model)
        return got

    for got in cf.launch(main, mesh={"dp": 2}):
        # 2 ranks: a ring all_reduce sends 2 * (n - 1) / n = 1 times the bucket
        assert got[True] == [k * layer for k in range(4)]
        assert got[False] == [0, 0, 0, 0]


def test_zero_stage0_and_tensor_parallel_overlap_too() -> None:
    model, cfg, params, batches = _problem(n_layer=3)

    def main(mesh):
        t0 = lambda s: cf.zero(cf.shard(s, mesh, bucket_mb=TINY_BUCKET), 0)  # noqa: E731
        t_tp = lambda s: cf.shard(s, mesh, plan=model.tp_plan, bucket_mb=TINY_BUCKET)  # noqa: E731
        return (
            _sent_during_backward(mesh, t0, params, batches[0], cfg, model),
            _sent_during_backward(mesh, t_tp, params, batches[0], cfg, model),
        )

    for zero0, tp in cf.launch(main, mesh={"dp": 2, "tp": 2}):
        for log in (zero0, tp):
            assert log[0] == 0 and 0 < log[1] < log[2], log


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_2_reduce_scatter_while_the_backward_pass_runs(stage) -> None:
    model, cfg, params, batches = _problem(n_layer=4)
    layer = _layer_bytes(params)

    def main(mesh):
        log: list[int] = []
        read = lambda: mesh.ledger.bytes("reduce_scatter", "dp")  # noqa: E731
        fn = _probed(model.loss(cfg), read, log)
        step = cf.zero(
            cf.shard(cf.train_step(fn, optim.sgd(0.1)), mesh, bucket_mb=TINY_BUCKET), stage
        )
        state = step.init(params)
        with cf.sharding.recording(mesh):
            before = read()
            step(state, batches[0])
        return [v - before for v in log]

    for got in cf.launch(main, mesh={"dp": 2}):
        # a reduce_scatter over 2 sends half of what it is given: one layer's bytes per layer
        assert got == [k * layer // 2 for k in range(4)]


@settings(max_examples=6)
@given(
    name=st.sampled_from(["gpt", "llama"]),
    dp=st.sampled_from([2, 4]),
    bucket_mb=st.sampled_from([TINY_BUCKET, 0.01, 0.05, 25.0]),
    remat=st.sampled_from(["none", "full", "save_matmuls"]),
)
def test_overlapped_equals_reduce_after_backward_bitwise(name, dp, bucket_mb, remat) -> None:
    model, cfg, params, batches = _problem(name)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)

    def main(mesh):
        a = cf.remat(cf.shard(ref, mesh, bucket_mb=bucket_mb), remat)
        b = cf.remat(cf.shard(ref, mesh, overlap=False), remat)
        cf.testing.assert_equivalent(a, b, params, batches)  # rtol = atol = 0
        return cf.testing.assert_equivalent(a, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": dp})


def test_amp_reduces_in_the_master_dtype_bitwise() -> None:
    model, cfg, params, batches = _problem(dtype=torch.float32, steps=3)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-3))

    def main(mesh):
        a = cf.amp(cf.shard(ref, mesh, bucket_mb=TINY_BUCKET), torch.bfloat16, "dynamic")
        b = cf.amp(cf.shard(ref, mesh, overlap=False), torch.bfloat16, "dynamic")
        cf.testing.assert_equivalent(a, b, params, batches)
        state = a.init(params)
        _, grads = a.forward_backward(state.params, batches[0], state.extra)
        return {g.dtype for g in cf.tree.tensors(grads)}

    for dtypes in cf.launch(main, mesh={"dp": 2}):
        assert dtypes == {torch.float32}  # reduced wide, as after the backward pass


@pytest.mark.parametrize("stage", [None, 2])
@pytest.mark.parametrize("use", ["scanned_twice", "penalised_outside_the_scan", "not_blocks"])
def test_stacked_leaves_used_more_than_once(use, stage) -> None:
    """Every contribution to a stacked leaf's gradient is reduced: a second scan's and that of a
    term outside the scan (an L2 penalty on the blocks)."""
    model, cfg, params, batches = _problem()
    loss = model.loss(cfg)

    def twice(p, batch):
        h = loss.pre(p, batch)
        h = core.scan_layers(loss.block, core.scan_layers(loss.block, h, p["blocks"]), p["blocks"])
        return loss.post(p, h, batch)

    # every stacked leaf but the key bias: its gradient is zero in exact arithmetic (softmax is
    # shift-invariant), so with the penalty Adam drives it by its rounding noise alone, which
    # any change of summation order (a column-major weight's matmul) redraws
    penalty = [k for k, _ in cf.tree.flatten_with_paths(params["blocks"])[0] if k != "attn.bk"]

    def penalised(p, batch):
        blocks = dict(cf.tree.flatten_with_paths(p["blocks"])[0])
        return loss(p, batch) + 1e-2 * sum((blocks[k] ** 2).sum() for k in penalty)

    def not_blocks(p, batch):  # stacked layers kept under another name: cut whole by ZeRO
        h = loss.pre(p, batch)
        h = core.scan_layers(loss.block, h, p["layers"])
        return loss.post(p, h, batch)

    fn = {"scanned_twice": twice, "penalised_outside_the_scan": penalised}.get(use, not_blocks)
    if use == "not_blocks":
        params = {**{k: v for k, v in params.items() if k != "blocks"}, "layers": params["blocks"]}
    ref = cf.train_step(fn, ADAM_CLIP)

    def main(mesh):
        step = cf.shard(ref, mesh, bucket_mb=TINY_BUCKET)
        step = step if stage is None else cf.zero(step, stage)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": 2})


def test_bad_bucket_size_is_a_value_error() -> None:
    model, cfg, _, _ = _problem()
    ref = cf.train_step(model.loss(cfg), optim.sgd(0.1))

    def main(mesh):
        for bad in (0, -1.0, True, "25"):
            with pytest.raises(ValueError, match="bucket_mb"):
                cf.shard(ref, mesh, bucket_mb=bad)

    cf.launch(main, mesh={"dp": 2})


def _overlap_on_gloo(mesh):
    model, cfg, params, batches = _problem(n_layer=3)
    t = lambda s: cf.shard(s, mesh, bucket_mb=TINY_BUCKET)  # noqa: E731
    log = _sent_during_backward(mesh, t, params, batches[0], cfg, model)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    losses = cf.testing.assert_equivalent(t(ref), ref, params, batches, rtol=1e-9, atol=1e-12)
    zero2 = cf.zero(t(ref), 2)  # reduce-scatters started during the backward pass
    cf.testing.assert_equivalent(zero2, ref, params, batches, rtol=1e-9, atol=1e-12)
    x = torch.arange(6.0) * (mesh.rank + 1)
    pending = [cf.sharding.comm.all_reduce_async(x.clone(), "dp", op) for op in ("sum", "avg")]
    blocking = [cf.sharding.comm.all_reduce(x, "dp", op) for op in ("sum", "avg")]
    for p, b in zip(pending, blocking):
        torch.testing.assert_close(p.wait(), b, rtol=0, atol=0)
    return log, _layer_bytes(params), losses


def test_overlap_on_gloo_processes() -> None:
    results = cf.launch(_overlap_on_gloo, mesh={"dp": 2}, backend="gloo", timeout=180)
    for log, layer, losses in results:
        assert log == [0, layer, 2 * layer]
        assert losses == results[0][2]
