"""``step.evaluate``: the forward-only step under any composition.

It equals the single-device loss for every drawn composition (``assert_equivalent`` checks it
before every step), and it gathers nothing the composition's forward pass does not: no
all_gather at all below ZeRO-3, and under ZeRO-3 exactly the per-layer gathers plus the
non-stacked parameters, once each; ``colfunc train`` validates with it on every rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import colfunc as cf
from colfunc import models, optim, parallel, resume
from colfunc.sharding.ledger import ring_bytes

pytestmark = pytest.mark.timeout(300)


def _problem(name: str = "gpt"):
    model = getattr(models, name)
    cfg = model.Config(vocab_size=64, n_layer=3, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=2))
    ids = torch.randint(0, cfg.vocab_size, (24, 8), generator=torch.Generator().manual_seed(3))
    return model, cfg, params, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["gpt", "llama"])
@settings(max_examples=6)
@given(
    composition=cf.testing.compositions(
        cf.testing.meshes(axes=("dp", "pp", "tp"), sizes=(1, 2)),
        schedules=("gpipe", "1f1b", "interleaved", "zero_bubble"),
    )
)
def test_evaluate_equals_the_single_device_loss(name, composition) -> None:
    model, cfg, params, batch = _problem(name)
    if composition["pipeline"]["virtual_stages"] * composition["mesh"]["pp"] > cfg.n_layer:
        composition["pipeline"]["virtual_stages"] = 1
        composition["pipeline"]["schedule"] = "1f1b"
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    expected = float(model.loss(cfg)(params, batch))

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=model.tp_plan)
        state = step.init(params)
        with torch.enable_grad():  # evaluate turns gradients off itself
            got = step.evaluate(state, batch)["loss"]
        assert not got.requires_grad
        return float(got)

    for got in cf.launch(main, mesh=composition["mesh"], timeout=120):
        assert abs(got - expected) <= 1e-12 + 1e-9 * abs(expected)


def _gathered_bytes(mesh, step, params, batch) -> tuple[int, int]:
    state = step.init(params)
    with cf.sharding.recording(mesh) as led:
        led.reset()
        step.evaluate(state, batch)
        evaluated = led.bytes("all_gather")
        led.reset()
        step(state, batch)
        trained = led.bytes("all_gather")
    return evaluated, trained


@pytest.mark.parametrize("stage", [None, 0, 1, 2, 3])
def test_evaluate_gathers_no_more_than_the_forward_pass(stage) -> None:
    model, cfg, params, batch = _problem("gpt")
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    pc = parallel.ParallelConfig(data=2, zero=stage) if stage is not None else None

    def main(mesh):
        step = cf.shard(ref, mesh) if pc is None else parallel.build(ref, mesh, pc, None)
        return _gathered_bytes(mesh, step, params, batch)

    for evaluated, trained in cf.launch(main, mesh={"dp": 2}):
        if stage != 3:
            assert evaluated == 0  # nothing gathered to validate
            continue
        # ZeRO-3: the layers once (the training step gathers them again for the backward
        # pass) and the non-stacked parameters once
        n = cf.tree.size_bytes(params) - cf.tree.size_bytes(params["blocks"])
        layers = cf.tree.size_bytes(params["blocks"])
        assert evaluated == ring_bytes("all_gather", layers + n, 2)
        assert trained > evaluated


def test_parallel_train_validates_without_gathering_the_model(tmp_path, monkeypatch) -> None:
    """``colfunc train`` under a mesh: the validation runs ``step.evaluate`` on every rank, and
    the only full_state gathers left are the checkpoint's."""
    calls: list[int] = []
    real = resume.full_state

    def counted(state):
        calls.append(1)
        return real(state)

    monkeypatch.setattr(resume, "full_state", counted)
    evaluated: list[float] = []
    real_eval = cf.Step.evaluate

    def spy(self, state, batch):
        out = real_eval(self, state, batch)
        evaluated.append(float(out["loss"]))
        return out

    monkeypatch.setattr(cf.Step, "evaluate", spy)
    monkeypatch.chdir(tmp_path)
    from colfunc import cli

    code = cli.main(
        [
            "train",
            "--set", "train.steps=2", "--set", "train.eval_every=1", "--set", "train.eval_batches=2",
            "--set", "parallel.data=2", "--set", "parallel.zero=1", "--name", "v", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    checkpoints = 1  # the last step's
    assert len(calls) == 2 * checkpoints  # one gather per rank for the checkpoint, none to validate
    assert len(evaluated) >= 2 * 2 * 2  # two ranks, two batches, at least two evaluations
