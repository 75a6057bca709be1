"""The optimizer starts on data-parallel gradients whose buckets have arrived, and changes no number.

Under plain data parallelism (``shard``'s, or ZeRO stage 0's own) a step's forward-backward may
return while its last buckets are still being reduced (``Step.overlap_update``); ``optim.adamw``
then updates each bucket's layers as soon as that bucket has arrived. The update is elementwise,
so the result must equal the same step run piece after piece bit for bit, and the single-device
step within fp64 rounding. The order is checked directly: each part's kernel runs after that
part has been waited for and before the next one is.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dp_overlap import TINY_BUCKET, _problem

import colfunc as cf
from colfunc import core, models, optim, torch_private
from colfunc.transforms.data_parallel import buckets

pytestmark = pytest.mark.timeout(240)


def _in_sequence(step: cf.Step) -> cf.Step:
    """``step`` running its pieces one after another (no update on gradients in flight)."""
    return dataclasses.replace(step, overlap_update=False)


def _norms(step, params, batches):
    state, norms = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        norms.append(float(metrics["grad_norm"]))
    return norms


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["gpt", "llama"]),
    dp=st.sampled_from([2, 4]),
    bucket_mb=st.sampled_from([TINY_BUCKET, 0.01, 0.05, 25.0]),
    via=st.sampled_from(["shard", "zero0", "zero0_alone"]),
    donate=st.booleans(),
    remat=st.sampled_from(["none", "full"]),
)
def test_update_on_arrival_equals_the_update_after_it_bitwise(
    name, dp, bucket_mb, via, donate, remat
) -> None:
    model, cfg, params, batches = _problem(name, steps=3)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2, weight_decay=0.1), donate=donate)

    def main(mesh):
        if via == "zero0_alone":  # zero's own buckets (every rank on the whole batch)
            step = cf.zero(ref, 0)
        else:
            step = cf.shard(ref, mesh, bucket_mb=bucket_mb)
            step = cf.zero(step, 0) if via == "zero0" else step
        step = cf.remat(step, remat)
        assert step.overlap_update
        cf.testing.assert_equivalent(step, _in_sequence(step), params, batches)  # rtol = atol = 0
        assert _norms(step, params, batches) == _norms(_in_sequence(step), params, batches)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": dp})


def test_each_part_is_updated_once_it_has_arrived(monkeypatch) -> None:
    """With a bucket per layer, the fused kernel runs once per bucket, each time after that
    bucket was waited for and before the next one is: the update overlaps the reductions."""
    model, cfg, params, batches = _problem(n_layer=3, steps=1)
    events: dict[int, list[tuple[str, int]]] = {}
    wait, fused = buckets.InFlight.wait, torch_private.fused_adamw_

    def spy_wait(self, part):
        for k in range(self.arrived, min(part, self.parts - 1) + 1):
            events.setdefault(threading.get_ident(), []).append(("wait", k))
        wait(self, part)

    def spy_fused(*args, **kwargs):
        events.setdefault(threading.get_ident(), []).append(("kernel", len(args[0])))
        return fused(*args, **kwargs)

    monkeypatch.setattr(buckets.InFlight, "wait", spy_wait)
    monkeypatch.setattr(torch_private, "fused_adamw_", spy_fused)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2), donate=True)

    def main(mesh):
        step = cf.shard(ref, mesh, bucket_mb=TINY_BUCKET)
        state = step.init(params)
        step(state, batches[0])

    cf.launch(main, mesh={"dp": 2})
    assert len(events) == 2  # the two ranks' threads
    per_layer = len(cf.tree.tensors(params["blocks"]))
    unscanned = len(cf.tree.tensors(params)) - per_layer
    for seen in events.values():
        waits = [k for what, k in seen if what == "wait"]
        kernels = [n for what, n in seen if what == "kernel"]
        assert waits == list(range(len(waits))) and len(waits) >= 3  # each part once, in order
        # every kernel right after a wait: its part's, before the next part is waited for
        assert all(seen[i - 1][0] == "wait" for i, e in enumerate(seen) if e[0] == "kernel")
        # buckets start last layer first: layers 2, 1, 0, then the unscanned leaves
        assert kernels[:3] == [per_layer] * 3
        assert sum(kernels) == 3 * per_layer + unscanned  # every piece updated once


def test_only_compositions_that_read_no_gradient_before_the_optimizer_overlap() -> None:
    model, cfg, _, _ = _problem()
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    mesh = cf.Mesh({"dp": 2, "tp": 2, "pp": 2}, 0)
    assert not ref.overlap_update  # one device: nothing in flight
    assert not cf.remat(ref).overlap_update  # no data-parallel reduction either
    assert cf.shard(ref, mesh).overlap_update
    assert cf.zero(cf.shard(ref, mesh), 0).overlap_update
    assert cf.remat(cf.shard(ref, mesh)).overlap_update
    assert not cf.shard(ref, mesh, overlap=False).overlap_update
    assert not cf.amp(cf.shard(ref, mesh), torch.bfloat16).overlap_update
    assert not cf.zero(cf.shard(ref, mesh), 2).overlap_update
    assert not cf.shard(ref, mesh, plan=models.gpt.tp_plan).overlap_update
    assert not cf.pipeline(cf.shard(ref, mesh), stages=2, microbatches=2).overlap_update
    # a piece swapped in by hand may read the gradients: the step then runs piece by piece
    step = cf.shard(ref, mesh)
    assert not step.replace(update=step.update).overlap_update


def test_a_piece_swapped_in_reads_reduced_gradients() -> None:
    """An update replaced by hand sees every gradient reduced, as the sequential step does."""
    model, cfg, params, batches = _problem(steps=1)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))

    def main(mesh):
        step = cf.shard(ref, mesh, bucket_mb=TINY_BUCKET)
        seen = []

        def update(grads, state):
            seen.append([g.clone() for g in cf.tree.tensors(grads)])
            return step.update(grads, state)

        custom = step.replace(update=update)
        custom(custom.init(params), batches[0])
        plain = cf.shard(ref, mesh, overlap=False)
        state = plain.init(params)
        _, grads = plain.forward_backward(state.params, batches[0], state.extra)
        for a, b in zip(seen[0], cf.tree.tensors(plain.sync(grads))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    cf.launch(main, mesh={"dp": 2})


def test_an_update_that_fails_waits_for_what_is_in_flight() -> None:
    """An optimizer that raises while gradients are in flight: the step raises its error on
    every rank, having waited for every bucket, and the next step runs as before."""
    model, cfg, params, batches = _problem(steps=2)
    adamw = optim.adamw(1e-2)
    calls = threading.local()

    def apply(grads, state, params, donate=False, arrival=None):
        calls.n = getattr(calls, "n", 0) + 1
        if calls.n == 1:
            raise RuntimeError("optimizer failed")
        return adamw.apply(grads, state, params, donate=donate, arrival=arrival)

    flaky = adamw._replace(apply=apply)
    ref = cf.train_step(model.loss(cfg), adamw)

    def main(mesh):
        step = cf.shard(cf.train_step(model.loss(cfg), flaky), mesh, bucket_mb=TINY_BUCKET)
        state = step.init(params)
        with pytest.raises(RuntimeError, match="optimizer failed"):
            step(state, batches[0])
        assert core.innermost(core.StepRun) is None
        # the failed call wrote nothing (no donation): run both batches from the same state
        state, _ = step(state, batches[0])
        state, _ = step(state, batches[1])
        want = ref.init(params)
        for b in batches:
            want, _ = ref(want, b)
        full = cf.full_state(state)
        cf.testing.assert_trees_close(full.params, want.params, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": 2})


def test_step_run_hands_gradients_only_where_it_takes_them() -> None:
    run = core.StepRun(overlap=False)
    with pytest.raises(RuntimeError, match="does not take"):
        run.hand(_Arrival({}))
    run = core.StepRun(overlap=True)
    first = _Arrival({"w": torch.zeros(2)})
    run.hand(first)
    with pytest.raises(RuntimeError, match="handed twice"):
        run.hand(_Arrival({}))
    assert run.arrival_for(first.grads) is first and not first.waited
    # other gradients than those handed over: what is in flight is waited for first
    assert run.arrival_for({"w": torch.zeros(2)}) is None and first.waited
    assert run.arrival is None


class _Arrival:
    def __init__(self, grads):
        self.grads, self.parts, self.waited = grads, 1, False

    def part_of(self, t):
        return 0

    def wait(self, part):
        pass

    def wait_for(self, t):
        pass

    def wait_all(self):
        self.waited = True


def _on_gloo(mesh):
    model, cfg, params, batches = _problem(n_layer=3, steps=3)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2, weight_decay=0.1), donate=True)
    step = cf.shard(ref, mesh, bucket_mb=TINY_BUCKET)
    cf.testing.assert_equivalent(step, _in_sequence(step), params, batches)
    return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)


def test_update_on_arrival_on_gloo_processes() -> None:
    results = cf.launch(_on_gloo, mesh={"dp": 2}, backend="gloo", timeout=180)
    assert results[0] == results[1]
