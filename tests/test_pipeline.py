"""Pipeline parallelism on the threads backend equals the single-device step.

Every schedule, with pp in {2, 4} and microbatches in {pp, 2 pp, 3 pp}, runs 3 steps of the tiny
GPT and LLaMA: the losses, the reported gradient norms and the final parameters (gathered with
``cf.full_state``) must equal the single-device reference's, fp32 with SGD at relative 1e-5.
The headline composition ``zero(shard(pipeline(...), plan=tp_plan), stage=1)`` on an 8-rank
``{"dp": 2, "pp": 2, "tp": 2}`` mesh and drawn compositions with ZeRO 0-3, remat and amp are held
to fp64 Adam with clipping at relative 1e-9 (clipping by the norm of every stage's gradients).
Then the point-to-point transfers the runtime uses, and bad input.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import colfunc as cf
from colfunc import models, optim
from colfunc.sharding import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    Partial,
    RankFailedError,
    Replicate,
    Shard,
    ShardedTensor,
    comm,
)
from colfunc.transforms.pipeline import PipelineLayout, pipeline_from_config
from colfunc.transforms.pipeline.link import _describe, _read

pytestmark = pytest.mark.timeout(240)

MODELS = {"gpt": models.gpt, "llama": models.llama}
ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
SGD = optim.sgd(0.1, momentum=0.9)


def _problem(name: str, n_layer: int = 4, rows: int = 8, dtype=torch.float32, steps: int = 3):
    model = MODELS[name]
    cfg = model.Config(vocab_size=64, n_layer=n_layer, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.to(dtype), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(rows)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (rows, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _run(step, params, batches):
    """Losses, reported gradient norms and final full parameters of ``step`` over ``batches``."""
    state = step.init(params)
    losses, norms = [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, cf.full_state(state).params


def _assert_same(got, want, rtol, atol) -> None:
    for k, what in enumerate(("loss", "grad_norm")):
        for i, (a, b) in enumerate(zip(got[k], want[k])):
            assert abs(a - b) <= atol + rtol * abs(b), f"{what} at step {i}: {a!r} != {b!r}"
    cf.testing.assert_trees_close(got[2], want[2], rtol=rtol, atol=atol, what="params")


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_every_schedule_equals_single_device(schedule: str, pp: int) -> None:
    v = 2 if schedule == "interleaved" else 1
    cases = []  # (model, microbatches, problem, reference result)
    for name in sorted(MODELS):
        for m in (pp, 2 * pp, 3 * pp):
            model, cfg, params, batches = _problem(name, n_layer=max(4, pp * v), rows=m)
            ref = cf.train_step(model.loss(cfg), SGD)
            cases.append((name, m, ref, params, batches, _run(ref, params, batches)))

    def main(mesh):
        return [
            _run(cf.pipeline(ref, pp, m, schedule, v), params, batches)
            for _, m, ref, params, batches, _ in cases
        ]

    results = cf.launch(main, mesh={"pp": pp}, timeout=120)
    for rank, per_case in enumerate(results):
        for (name, m, *_, want), got in zip(cases, per_case):
            try:
                _assert_same(got, want, rtol=1e-5, atol=1e-6)
            except AssertionError as e:
                raise AssertionError(f"{name}, microbatches={m}, rank {rank}: {e}") from None


@pytest.mark.parametrize(
    ("name", "opt", "dtype", "rtol", "atol"),
    [
        ("gpt", ADAM_CLIP, torch.float64, 1e-9, 1e-12),
        pytest.param("llama", SGD, torch.float32, 1e-5, 1e-6, marks=pytest.mark.slow),  # 16 s
    ],
)
def test_headline_composition_on_eight_ranks(name, opt, dtype, rtol, atol) -> None:
    model, cfg, params, batches = _problem(name, rows=16, dtype=dtype)
    ref = cf.train_step(model.loss(cfg), opt)
    want = _run(ref, params, batches)

    def main(mesh):
        step = cf.zero(cf.shard(cf.pipeline(ref, 2, 4), mesh, plan=model.tp_plan), stage=1)
        return _run(step, params, batches)

    cf.sharding.reset_fallback_counts()
    for got in cf.launch(main, mesh={"dp": 2, "pp": 2, "tp": 2}, timeout=120):
        _assert_same(got, want, rtol, atol)
    assert cf.sharding.fallback_counts() == {}, "the tensor-parallel hot path fell back"


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@settings(max_examples=5)
@given(
    composition=cf.testing.compositions(
        cf.testing.meshes(axes=("dp", "pp", "tp"), sizes=(1, 2)), schedules=SCHEDULES
    )
)
def test_drawn_compositions_equal_single_device_fp64(composition) -> None:
    model, cfg, params, batches = _problem("gpt", rows=24, dtype=torch.float64, steps=2)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    want = _run(ref, params, batches)

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=model.tp_plan)
        return _run(step, params, batches)

    for got in cf.launch(main, mesh=composition["mesh"], timeout=120):
        _assert_same(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("schedule", "stage", "policy"),
    [("zero_bubble", 3, "full"), ("interleaved", 2, "save_matmuls"), ("1f1b", 0, "none")],
)
def test_zero_and_remat_around_the_pipeline(schedule, stage, policy) -> None:
    model, cfg, params, batches = _problem("llama", rows=8, dtype=torch.float64, steps=2)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    want = _run(ref, params, batches)
    v = 2 if schedule == "interleaved" else 1

    def main(mesh):
        step = cf.remat(cf.zero(cf.shard(cf.pipeline(ref, 2, 4, schedule, v), mesh), stage), policy)
        return _run(step, params, batches)

    for got in cf.launch(main, mesh={"dp": 2, "pp": 2}, timeout=120):
        _assert_same(got, want, rtol=1e-9, atol=1e-12)


def test_amp_around_the_pipeline() -> None:
    """A fixed loss scale in fp32 must cancel exactly; bf16 compute must stay near the reference."""
    model, cfg, params, batches = _problem("gpt", rows=8, steps=2)
    ref = cf.train_step(model.loss(cfg), SGD)
    scaled_ref = _run(cf.amp(ref, "fp32", loss_scale=1024.0), params, batches)
    bf16_ref = _run(cf.amp(ref, torch.bfloat16), params, batches)

    def main(mesh):
        scaled = cf.amp(cf.pipeline(ref, 2, 4, "zero_bubble"), "fp32", loss_scale=1024.0)
        bf16 = cf.amp(cf.pipeline(ref, 2, 4, "1f1b"), torch.bfloat16)
        return _run(scaled, params, batches), _run(bf16, params, batches)

    for scaled, bf16 in cf.launch(main, mesh={"pp": 2}, timeout=120):
        _assert_same(scaled, scaled_ref, rtol=1e-5, atol=1e-6)
        # bf16 keeps 8 bits: microbatching changes the order of the bf16 sums
        _assert_same(bf16, bf16_ref, rtol=3e-2, atol=3e-3)


def test_uneven_split_and_one_stage() -> None:
    model, cfg, params, batches = _problem("gpt", n_layer=5, rows=6)
    ref = cf.train_step(model.loss(cfg), SGD)
    want = _run(ref, params, batches)
    # one stage needs no mesh: the pipeline is then microbatching alone
    _assert_same(_run(cf.pipeline(ref, 1, 3), params, batches), want, rtol=1e-5, atol=1e-6)

    def main(mesh):
        step = cf.pipeline(ref, 2, 3, "1f1b")
        layout = step.init(params).extra["pipeline"]
        return _run(step, params, batches), layout.describe()

    for got, described in cf.launch(main, mesh={"pp": 2}):
        _assert_same(got, want, rtol=1e-5, atol=1e-6)
        assert "stage 0: layers 0-2 on rank 0" in described
        assert "uneven: 5 layers do not divide into 2 stages" in described


def test_each_rank_keeps_its_stages_layers_round_robin() -> None:
    model, cfg, params, _ = _problem("gpt", n_layer=8)
    wq = params["blocks"]["attn"]["wq"]

    def main(mesh):
        state = cf.pipeline(cf.train_step(model.loss(cfg), SGD), 2, 2, "interleaved", 2).init(
            params
        )
        return state.params["blocks"]["attn"]["wq"], state.params["embed"]["tokens"]

    (w0, e0), (w1, e1) = cf.launch(main, mesh={"pp": 2})
    # 4 stages of 2 layers: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert torch.equal(w0, wq[[0, 1, 4, 5]]) and torch.equal(w1, wq[[2, 3, 6, 7]])
    assert torch.equal(e0, params["embed"]["tokens"]) and torch.equal(e1, e0)


# --- point-to-point transfers ----------------------------------------------------------------


def test_send_recv_by_tag_in_any_order_and_counted() -> None:
    def main(mesh):
        with cf.sharding.recording() as led:
            if mesh.rank == 0:
                reqs = [comm.send(torch.full((2, 3), float(t)), "pp", 1, tag=t) for t in (1, 2)]
                for r in reqs:
                    r.wait()
                return led.bytes("send", "pp")
            late = comm.recv((2, 3), torch.float32, "pp", 0, tag=2)
            early = comm.recv((2, 3), torch.float32, "pp", 0, tag=1)
            return early.wait()[0, 0].item(), late.wait()[0, 0].item(), led.bytes("send", "pp")

    sent, got = cf.launch(main, mesh={"pp": 2})
    assert sent == 2 * 6 * 4 and got == (1.0, 2.0, 0)


def test_recv_of_the_wrong_shape_or_from_a_returned_rank_is_named() -> None:
    def wrong_shape(mesh):
        if mesh.rank == 0:
            comm.send(torch.zeros(3), "pp", 1, tag=5).wait()
        else:
            comm.recv((4,), torch.float32, "pp", 0, tag=5).wait()

    with pytest.raises(RankFailedError, match="rank 1") as e:
        cf.launch(wrong_shape, mesh={"pp": 2})
    assert isinstance(e.value.__cause__, CollectiveMismatchError)
    assert "sent shape (3,)" in str(e.value)

    def nothing_sent(mesh):
        if mesh.rank == 1:
            comm.recv((4,), torch.float32, "pp", 0, tag=5).wait()

    with pytest.raises(RankFailedError, match="rank 0 returned") as e:
        cf.launch(nothing_sent, mesh={"pp": 2}, timeout=30)
    assert isinstance(e.value.__cause__, CollectiveTimeoutError)

    def to_itself(mesh):
        comm.send(torch.zeros(1), "pp", mesh.axis_index("pp"))

    with pytest.raises(RankFailedError, match="is this rank itself"):
        cf.launch(to_itself, mesh={"pp": 2})


def test_descriptor_carries_shape_dtype_and_placements() -> None:
    mesh = cf.Mesh({"pp": 2, "tp": 2})
    for placements, shape in [
        ((Replicate(), Shard(1)), (2, 6, 4)),
        ((Replicate(), Partial("sum")), (2, 3, 4)),
        ((Replicate(), Replicate()), (2, 3, 4)),
    ]:
        x = ShardedTensor(torch.zeros(2, 3, 4, dtype=torch.bfloat16), mesh, placements, shape)
        got = _read(_describe(x).tolist(), mesh)
        assert got == ((2, 3, 4), torch.bfloat16, (shape, placements))
    assert _read(_describe(torch.zeros(5, 7)).tolist(), mesh) == ((5, 7), torch.float32, None)


# --- bad input -------------------------------------------------------------------------------


def test_bad_input_is_named() -> None:
    model, cfg, params, batches = _problem("gpt", n_layer=3)
    ref = cf.train_step(model.loss(cfg), SGD)
    with pytest.raises(ValueError, match=r"loss must be a cf\.layered"):
        cf.pipeline(cf.train_step(lambda p, b: model.loss(cfg)(p, b), SGD), 2, 4)
    with pytest.raises(ValueError, match="schedule='zero_bubble' needs microbatches >= stages=4"):
        cf.pipeline(ref, 4, 2, "zero_bubble")
    with pytest.raises(ValueError, match="microbatches divisible by stages=2"):
        cf.pipeline(ref, 2, 3, "interleaved", 2)
    # any order means the same step: pipeline over remat is remat over pipeline
    assert (
        cf.pipeline(cf.remat(ref), 2, 4).composition == cf.remat(cf.pipeline(ref, 2, 4)).composition
    )
    with pytest.raises(ValueError, match="already has pipeline applied; apply it once"):
        cf.pipeline(cf.pipeline(ref, 2, 4), 2, 4)
    with pytest.raises(ValueError, match="unknown key 'stage'"):
        pipeline_from_config(ref, {"stage": 2, "microbatches": 4})
    with pytest.raises(ValueError, match="3 layers, fewer than stages=2 x virtual_stages=2"):
        PipelineLayout(3, 2, 2, "pp", None)

    def too_few_layers(mesh):
        cf.pipeline(ref, 4, 4).init(params)

    with pytest.raises(RankFailedError, match="3 layers, fewer than stages=4"):
        cf.launch(too_few_layers, mesh={"pp": 4})

    def indivisible_batch(mesh):
        step = cf.pipeline(ref, 2, 4)
        step(step.init(params), {k: v[:6] for k, v in batches[0].items()})

    with pytest.raises(RankFailedError, match="6 rows, not divisible by microbatches=4"):
        cf.launch(indivisible_batch, mesh={"pp": 2})

    def wrong_axis_size(mesh):
        cf.pipeline(ref, 2, 4).init(params)

    with pytest.raises(RankFailedError, match="needs a mesh axis 'pp' of size 2"):
        cf.launch(wrong_axis_size, mesh={"pp": 1, "dp": 2})


def test_config_entry_builds_the_same_step() -> None:
    model, cfg, params, batches = _problem("gpt", rows=4, steps=1)
    ref = cf.train_step(model.loss(cfg), SGD)

    def main(mesh):
        a = _run(cf.pipeline(ref, 2, 4, "gpipe"), params, batches)
        conf = {"stages": 2, "microbatches": 4, "schedule": "gpipe"}
        b = _run(pipeline_from_config(ref, conf), params, batches)
        return a, b

    for a, b in cf.launch(main, mesh={"pp": 2}):
        _assert_same(a, b, rtol=0.0, atol=0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["save_matmuls", "full"])
def test_zero_bubble_with_selective_remat(policy) -> None:
    """ZB-H1 differentiates each microbatch twice (input, then weight gradients); selective
    checkpointing allows one backward pass, so under the split it checkpoints fully instead."""
    model = models.gpt
    cfg = model.Config(vocab_size=64, n_layer=4, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 64, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))

    def main(mesh):
        step = cf.remat(cf.shard(cf.pipeline(ref, 2, 2, "zero_bubble"), mesh), policy)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"pp": 2})
