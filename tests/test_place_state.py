"""A state gathered under one mesh continues under another.

``cf.full_state`` gathers parameters and optimizer states into the single-device layout (ZeRO's
chunks, pipeline stages, tensor-parallel shards); ``step.place_state`` lays such a state out for
any other composition. Two steps under a drawn composition, then two under another drawn
composition, must equal four single-device steps, parameters and Adam moments alike (fp64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import colfunc as cf
from colfunc import models, optim

pytestmark = pytest.mark.timeout(240)

ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))


def _problem(steps=4):
    model = models.gpt
    cfg = model.Config(vocab_size=64, n_layer=4, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _reference(ref, params, batches):
    state = ref.init(params)
    for batch in batches:
        state, _ = ref(state, batch)
    return state


def _run(composition, ref, plan, full, batches):
    """``full`` placed under ``composition``, trained on ``batches``; rank 0's full state."""

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=plan)
        state = step.place_state(full)
        for batch in batches:
            state, _ = step(state, batch)
        return cf.full_state(state)

    return cf.launch(main, mesh=composition["mesh"], timeout=120)[0]


def _assert_same_state(got, want):
    cf.testing.assert_trees_close(got.params, want.params, rtol=1e-9, atol=1e-12, what="params")
    cf.testing.assert_trees_close(
        got.opt_state, want.opt_state, rtol=1e-9, atol=1e-12, what="opt_state"
    )
    assert got.step == want.step


MESHES = cf.testing.meshes(sizes=(1, 2), max_ranks=4)


@settings(max_examples=5)
@given(
    first=cf.testing.compositions(MESHES, remat_policies=("none",)),
    second=cf.testing.compositions(MESHES, remat_policies=("none", "full")),
)
def test_saved_under_one_composition_continues_under_another(first, second) -> None:
    model, cfg, params, batches = _problem()
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    start = ref.init(params)
    half = _run(first, ref, model.tp_plan, start, batches[:2])
    _assert_same_state(half, _reference(ref, params, batches[:2]))
    end = _run(second, ref, model.tp_plan, half, batches[2:])
    _assert_same_state(end, _reference(ref, params, batches))


def test_pipeline_stages_and_back() -> None:
    model, cfg, params, batches = _problem()
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    piped = {
        "mesh": {"dp": 2, "pp": 2},
        "zero": 1,
        "remat": "none",
        "order": ("shard", "zero", "remat"),
        "pipeline": {"schedule": "1f1b", "microbatches": 2, "virtual_stages": 1},
    }
    half = _run(piped, ref, model.tp_plan, ref.init(params), batches[:2])
    _assert_same_state(half, _reference(ref, params, batches[:2]))
    flat = {"mesh": {"dp": 2, "tp": 2}, "zero": 3, "remat": "none", "order": ("shard", "zero")}
    end = _run(flat, ref, model.tp_plan, half, batches[2:])
    _assert_same_state(end, _reference(ref, params, batches))


def test_amp_keeps_its_loss_scale() -> None:
    model, cfg, params, _ = _problem()
    params = cf.tree.map(lambda x: x.float(), params)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-3))

    def main(mesh):
        step = cf.amp(cf.zero(cf.shard(ref, mesh), 2), torch.float16, "dynamic", init_scale=8.0)
        state = step.init(params)
        state = state._replace(extra={**state.extra, "loss_scale": 4.0, "good_steps": 7})
        again = step.place_state(cf.full_state(state))
        return again.extra["loss_scale"], again.extra["good_steps"], type(again.extra["zero"])

    for scale, good, layout in cf.launch(main, mesh={"dp": 2}):
        assert (scale, good) == (4.0, 7)
        assert layout.__name__ == "ZeroLayout"


def test_full_state_round_trips_bitwise() -> None:
    model, cfg, params, batches = _problem()
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)

    def main(mesh):
        step = cf.zero(cf.shard(ref, mesh, plan=model.tp_plan), 2)
        state, _ = step(step.init(params), batches[0])
        full = cf.full_state(state)
        again = cf.full_state(step.place_state(full))
        cf.testing.assert_trees_close(again.opt_state, full.opt_state, what="opt_state")
        cf.testing.assert_trees_close(again.params, full.params, what="params")

    cf.launch(main, mesh={"dp": 2, "tp": 2})


def test_another_optimizer_is_a_value_error() -> None:
    model, cfg, params, _ = _problem()
    sgd = cf.train_step(model.loss(cfg), optim.sgd(0.1, momentum=0.9))
    adam = cf.train_step(model.loss(cfg), optim.adamw(1e-3))
    with pytest.raises(ValueError, match="optimizer state does not match"):
        adam.place_state(sgd.init(params))
    with pytest.raises(TypeError, match="TrainState"):
        adam.place_state(params)
