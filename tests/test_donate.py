"""A donating step reuses the state's buffers and computes exactly what the plain step does.

``train_step(..., donate=True)`` lets AdamW's fused kernel write the new parameters and moments
into the buffers of the state passed in. The parameters given to ``init`` are never written (the
state copies what it shares with them), also when the ranks of the threads backend are handed
the same tensors. Every loss and parameter equals the non-donating step's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import colfunc as cf
from colfunc import models, optim

pytestmark = pytest.mark.timeout(240)

ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))


def _problem():
    model = models.gpt
    cfg = model.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
    params = model.init(cfg, seed=1)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def test_donating_step_updates_in_place_and_equals_the_plain_step() -> None:
    model, cfg, params, batches = _problem()
    before = cf.tree.map(torch.clone, params)
    plain = cf.train_step(model.loss(cfg), ADAM_CLIP)
    donating = cf.train_step(model.loss(cfg), ADAM_CLIP, donate=True)
    state = donating.init(params)
    first = [x.data_ptr() for x in cf.tree.tensors(state.params)]
    moments = [x.data_ptr() for x in cf.tree.tensors(state.opt_state[1].exp_avg)]
    cf.testing.assert_equivalent(donating, plain, params, batches)  # rtol = atol = 0
    for batch in batches:
        state, _ = donating(state, batch)
    # the same buffers, written in place
    assert [x.data_ptr() for x in cf.tree.tensors(state.params)] == first
    assert [x.data_ptr() for x in cf.tree.tensors(state.opt_state[1].exp_avg)] == moments
    cf.testing.assert_trees_close(params, before, what="the params given to init")


def test_plain_step_leaves_its_state_alone() -> None:
    model, cfg, params, batches = _problem()
    plain = cf.train_step(model.loss(cfg), ADAM_CLIP)
    state = plain.init(params)
    kept = cf.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    plain(state, batches[0])
    cf.testing.assert_trees_close(state.params, kept.params, what="params")
    cf.testing.assert_trees_close(state.opt_state, kept.opt_state, what="opt_state")


@pytest.mark.parametrize(
    ("shape", "stage", "tp"),
    [
        ({"dp": 2}, None, False),
        ({"dp": 2}, 1, False),
        ({"dp": 2}, 3, False),
        ({"dp": 2, "tp": 2}, 2, True),
    ],
)
def test_donating_under_a_mesh_equals_the_plain_step(shape, stage, tp) -> None:
    model, cfg, params, batches = _problem()
    before = cf.tree.map(torch.clone, params)

    def build(mesh, donate):
        step = cf.train_step(model.loss(cfg), ADAM_CLIP, donate=donate)
        step = cf.shard(step, mesh, plan=model.tp_plan if tp else None)
        return step if stage is None else cf.zero(step, stage)

    def main(mesh):
        # every rank is handed the same parameter tensors: none may write into them
        return cf.testing.assert_equivalent(build(mesh, True), build(mesh, False), params, batches)

    cf.launch(main, mesh=shape)
    cf.testing.assert_trees_close(params, before, what="the params given to init")


def test_a_placed_state_is_owned_by_each_donating_rank() -> None:
    """Every rank lays out the same full state (a checkpoint): a donating rank must not write
    into it, nor into what another rank uses."""
    model, cfg, params, batches = _problem()
    plain = cf.train_step(model.loss(cfg), ADAM_CLIP)
    full = plain.init(params)
    full, _ = plain(full, batches[0])
    kept = cf.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, full)

    def main(mesh, donate):
        step = cf.shard(cf.train_step(model.loss(cfg), ADAM_CLIP, donate=donate), mesh)
        state = step.place_state(full)
        for batch in batches[1:]:
            state, _ = step(state, batch)
        return cf.full_state(state)

    donated = cf.launch(lambda m: main(m, True), mesh={"dp": 2})
    plain_runs = cf.launch(lambda m: main(m, False), mesh={"dp": 2})
    for a, b in zip(donated, plain_runs):
        cf.testing.assert_trees_close(a.params, b.params, what="params")
        cf.testing.assert_trees_close(a.opt_state, b.opt_state, what="opt_state")
    cf.testing.assert_trees_close(full.opt_state, kept.opt_state, what="the full state given")


@settings(max_examples=6)
@given(composition=cf.testing.compositions(cf.testing.meshes(sizes=(1, 2), max_ranks=4)))
def test_donating_equals_plain_for_drawn_compositions(composition) -> None:
    model, cfg, params, batches = _problem()

    def main(mesh):
        steps = [
            cf.testing.compose(
                cf.train_step(model.loss(cfg), ADAM_CLIP, donate=donate),
                mesh,
                composition,
                plan=model.tp_plan,
            )
            for donate in (True, False)
        ]
        return cf.testing.assert_equivalent(*steps, params, batches)

    cf.launch(main, mesh=composition["mesh"], timeout=120)
