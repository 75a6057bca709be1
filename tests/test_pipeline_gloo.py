"""Pipeline parallelism on real processes over gloo.

Two launches (each spawns its processes once): the headline composition on 8 processes
(``{"dp": 2, "pp": 2, "tp": 2}``, zero stage 1 around shard with the tensor-parallel plan around
a 1F1B pipeline), which must equal the single-device step computed in each process (fp64, Adam
with clipping, relative 1e-9), with the point-to-point transfers checked on the way; and the
measured bubble on 2 processes, one per core, with balanced stages: each rank's idle fraction
must be within 10 percentage points of what the simulator predicts from the measured op times
and transfer latency. The machine is shared, so the measurement takes the median of five steps.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import colfunc as cf
from colfunc import core, models, optim
from colfunc.sharding import comm
from colfunc.transforms.pipeline import Trace, build, simulate

pytestmark = pytest.mark.timeout(300)


def _headline(mesh):
    # the transfers the runtime uses, first: out of order by tag, counted in the ledger
    pp, i = mesh.axis_size("pp"), mesh.axis_index("pp")
    peer = 1 - i
    reqs = [comm.send(torch.full((3,), 10.0 * mesh.rank + t), "pp", peer, tag=t) for t in (1, 2)]
    late = comm.recv((3,), torch.float32, "pp", peer, tag=2)
    early = comm.recv((3,), torch.float32, "pp", peer, tag=1)
    other = mesh.group_ranks("pp")[peer]
    assert early.wait().tolist() == [10.0 * other + 1] * 3
    assert late.wait().tolist() == [10.0 * other + 2] * 3
    for r in reqs:
        r.wait()
    assert pp == 2

    model = models.gpt
    cfg = model.Config(vocab_size=64, n_layer=4, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (16, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
    ref = cf.train_step(model.loss(cfg), opt)
    step = cf.zero(cf.shard(cf.pipeline(ref, 2, 4), mesh, plan=model.tp_plan), stage=1)
    losses = cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
    return losses, cf.sharding.fallback_counts(mesh)


def test_headline_composition_on_gloo_processes() -> None:
    results = cf.launch(_headline, mesh={"dp": 2, "pp": 2, "tp": 2}, backend="gloo", timeout=240)
    assert len(results) == 8
    for losses, fallbacks in results:
        assert fallbacks == {}
        assert losses == results[0][0]  # every rank reports the same losses


# --- the measured bubble ---------------------------------------------------------------------

RUNS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))
M = 8


def _measure(mesh):
    model = models.gpt
    # 4 equal layers, wide enough that an op (tens of milliseconds) takes well over a transfer:
    # on two shared cores a message can wait a few milliseconds for the sender's core, where the
    # transport thread takes turns with the computation, and the simulator's latency is the one
    # measured between idle ranks
    cfg = model.Config(vocab_size=64, n_layer=4, n_head=4, d_model=384, max_seq_len=64)
    params = model.init(cfg, seed=1)
    ids = torch.randint(0, 64, (M * 4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    x = torch.zeros(4, 64, cfg.d_model)  # one microbatch's activation
    peer = 1 - mesh.axis_index("pp")
    pings = []
    for _ in range(10):  # one-way latency of an activation, from round trips
        t = time.perf_counter()
        if peer == 1:
            comm.send(x, "pp", peer, tag=1).wait()
            comm.recv(x.shape, x.dtype, "pp", peer, tag=2).wait()
        else:
            y = comm.recv(x.shape, x.dtype, "pp", peer, tag=1).wait()
            comm.send(y, "pp", peer, tag=2).wait()
        pings.append((time.perf_counter() - t) / 2)
    out = {"latency": statistics.median(pings)}
    for schedule, v in RUNS:
        step = cf.pipeline(cf.train_step(model.loss(cfg), optim.sgd(0.01)), 2, M, schedule, v)
        state = step.init(params)
        traces = []
        for _ in range(6):
            comm.all_reduce(torch.zeros(1), "pp", mesh=mesh)  # start together
            with core.context(Trace()) as trace:
                step.forward_backward(state.params, batch, state.extra)
            traces.append(trace.events)
        out[schedule] = traces[1:]  # the first step warms up
    return out


def _compare(per_rank: list, schedule: str, v: int, latency: float) -> tuple[list, list]:
    """Measured and simulated idle fractions per rank, medians over the steps.

    Idle is waiting for a message: computing and sending are the rank's own work, in the
    measurement as in the simulator, which replays each step with the time every computation
    and send took in it, and the measured latency of a transfer.
    """
    measured: list[list[float]] = [[], []]
    simulated: list[list[float]] = [[], []]
    for k in range(len(per_rank[0])):
        events = [per_rank[r][k] for r in range(2)]
        start = min(e[0][1] for e in events)
        end = max(e[-1][2] for e in events)
        took = {}
        for r, ev in enumerate(events):
            work = [(a, t1 - t0) for a, t0, t1 in ev if not a.op.startswith("RECV")]
            measured[r].append(1 - sum(t for _, t in work) / (end - start))
            took.update(work)
        sim = simulate(build(schedule, 2, M, v), lambda a, took=took: took.get(a, latency))
        for r in range(2):
            simulated[r].append(sim.bubble[r])
    return [statistics.median(m) for m in measured], [statistics.median(s) for s in simulated]


@pytest.mark.slow  # (timed runs of each schedule; the simulator's bubbles are tested exactly)
def test_measured_bubble_matches_the_simulator_on_gloo() -> None:
    per_rank = cf.launch(_measure, mesh={"pp": 2}, backend="gloo", timeout=240)
    latency = max(r["latency"] for r in per_rank)
    report = []
    for schedule, v in RUNS:
        measured, simulated = _compare([r[schedule] for r in per_rank], schedule, v, latency)
        report.append((schedule, measured, simulated))
    for schedule, measured, simulated in report:
        for r in range(2):
            assert abs(measured[r] - simulated[r]) <= 0.10, (schedule, r, report, latency)
