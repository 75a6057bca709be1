"""Pipeline schedules as data, checked by the simulator against the published bubble fractions.

With equal unit costs (forward 1, backward 2 = input 1 + weight 1) the simulator must give every
rank the idle fraction of the papers: GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021)
``(p - 1) / (m + p - 1)``; interleaved 1F1B ``(p - 1) / (v * m + p - 1)``; ZB-H1 (Qi et al. 2023)
a third of 1F1B's idle time, ``(p - 1) / (3 * m + p - 1)`` of its makespan. Peak in-flight
microbatches: ``m`` for GPipe, ``p - r`` on rank ``r`` for 1F1B and ZB-H1, Megatron's warm-up
plus one for interleaved. Broken schedules are reported, not run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colfunc.transforms.pipeline import Action, Costs, Schedule, ScheduleError, build, simulate

pytestmark = pytest.mark.timeout(120)

ranks = st.integers(1, 8)
times = st.sampled_from([0.5, 1.0, 2.0, 3.0])


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@settings(max_examples=200)
@given(p=ranks, m=st.integers(1, 24), f=times, b=times)
def test_gpipe_and_1f1b_bubble_is_published_fraction(p: int, m: int, f: float, b: float) -> None:
    costs = Costs(forward=f, backward=b)
    for name in ("gpipe", "1f1b"):
        sim = simulate(build(name, p, m), costs)
        assert close(sim.makespan, (m + p - 1) * (f + b)), (name, sim.makespan)
        for bubble in sim.bubble:
            assert close(bubble, (p - 1) / (m + p - 1)), (name, sim.bubble)


@settings(max_examples=200)
@given(p=ranks, m=st.integers(1, 24))
def test_peak_in_flight_1f1b_is_p_where_gpipe_is_m(p: int, m: int) -> None:
    assert simulate(build("gpipe", p, m)).peak_in_flight == (m,) * p
    peaks = simulate(build("1f1b", p, m)).peak_in_flight
    assert peaks == tuple(min(p - r, m) for r in range(p))
    assert max(peaks) == min(p, m)


@settings(max_examples=200)
@given(p=ranks, rounds=st.integers(1, 4), v=st.integers(2, 4), unit=st.booleans())
def test_interleaved_bubble_is_published_fraction(p: int, rounds: int, v: int, unit: bool) -> None:
    m = rounds * p
    sim = simulate(build("interleaved", p, m, v), Costs(backward=1.0 if unit else 2.0))
    for bubble in sim.bubble:
        assert close(bubble, (p - 1) / (v * m + p - 1)), sim.bubble
    # Megatron's warm-up: (v - 1) * p + 2 * (p - 1 - r) forwards, then one more before a backward
    warm = [min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m) for r in range(p)]
    assert sim.peak_in_flight == tuple(warm)


@settings(max_examples=200)
@given(p=ranks, extra=st.integers(0, 20))
def test_zero_bubble_h1_is_a_third_of_1f1b(p: int, extra: int) -> None:
    m = p + extra
    zb = simulate(build("zero_bubble", p, m))
    ref = simulate(build("1f1b", p, m))
    for r in range(p):
        assert close(zb.bubble[r], (p - 1) / (3 * m + p - 1)), zb.bubble
        idle_zb = zb.makespan - zb.busy[r]
        idle_ref = ref.makespan - ref.busy[r]
        assert close(idle_zb, idle_ref / 3), (idle_zb, idle_ref)
    # the weight passes wait, but the activations kept are 1F1B's
    assert zb.peak_in_flight == ref.peak_in_flight


@settings(max_examples=100)
@given(p=st.integers(1, 6), m=st.integers(1, 12), f=times, b=times, c=times, o=times)
def test_gpipe_with_transfer_costs(p: int, m: int, f: float, b: float, c: float, o: float) -> None:
    # the fill and the drain each cross p - 1 links
    sim = simulate(build("gpipe", p, m), Costs(forward=f, backward=b, latency=c))
    assert close(sim.makespan, (m + p - 1) * (f + b) + 2 * (p - 1) * c)
    # a send is its sender's work: the first and last stages send one way, the others both
    sim = simulate(build("gpipe", p, m), Costs(forward=f, backward=b, send=o))
    sends = [(r > 0) + (r < p - 1) for r in range(p)]
    assert all(close(sim.busy[r], m * (f + b + k * o)) for r, k in enumerate(sends))
    assert sim.makespan >= (m + p - 1) * (f + b)


def test_measured_costs_as_a_function() -> None:
    # a slow last stage sets the pace of 1F1B's steady state: m * (its forward + backward)
    def slow(a: Action) -> float:
        if a.op.startswith(("SEND", "RECV")):
            return 0.0  # the callable also gives the transfers' latency
        return 3.0 if a.stage == 1 else 1.0

    sim = simulate(build("1f1b", 2, 4), slow)
    assert sim.busy == (8.0, 24.0)
    assert sim.makespan == 1.0 + 24.0 + 1.0  # rank 0's first forward, then rank 1, then the drain


def test_every_action_list_is_consistent() -> None:
    s = build("1f1b", 4, 8)
    assert s.actions[3][:3] == (Action("RECV_F", 3, 0), Action("F", 3, 0), Action("B", 3, 0))
    assert s.actions[0][:2] == (Action("F", 0, 0), Action("SEND_F", 0, 0))
    # interleaved on one rank: stages pass activations locally, no transfers
    local = build("interleaved", 1, 3, 2)
    assert all(a.op in "FB" for a in local.actions[0])
    assert simulate(local).bubble == (0.0,)


def _replace(s: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(s.actions)
    lists[rank] = tuple(actions)
    return Schedule(
        name="edited",
        ranks=s.ranks,
        virtual_stages=s.virtual_stages,
        microbatches=s.microbatches,
        actions=tuple(lists),
    )


def test_deadlock_is_reported_naming_each_rank() -> None:
    # rank 1 of 3 wants its second input before sending back the first gradient, while rank 0,
    # with no warm-up, waits for that gradient before sending the second input
    s = build("1f1b", 3, 3)
    rank0 = [a for a in s.actions[0] if a.op != "F" or a.mb == 0]
    rank0 += [Action("F", 0, j) for j in (1, 2)]
    rank0 = sorted(rank0, key=lambda a: (a.mb, a.op in ("RECV_B", "B")))
    bad = _replace(s, 0, rank0)
    with pytest.raises(ScheduleError, match="deadlock") as e:
        simulate(bad)
    assert "rank 0 waits at RECV_B0.0" in str(e.value)
    assert "rank 1 waits at RECV_F1.1" in str(e.value)


def test_compute_before_receive_and_missing_work_are_reported() -> None:
    s = build("gpipe", 2, 2)
    swapped = list(s.actions[1])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # F1.0 before RECV_F1.0
    with pytest.raises(ScheduleError, match=r"rank 1 at F1\.0.*needs its input"):
        simulate(_replace(s, 1, swapped))
    dropped = [a for a in s.actions[1] if a != Action("B", 1, 1)]
    dropped = [a for a in dropped if a != Action("SEND_B", 1, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):  # rank 0 waits for that gradient
        simulate(_replace(s, 1, dropped))
    twice = [*s.actions[0], Action("F", 0, 0)]
    with pytest.raises(ScheduleError, match="repeats"):
        simulate(_replace(s, 0, twice))
    no_w = build("zero_bubble", 2, 2)
    with pytest.raises(ScheduleError, match="each needs F and B, or F, I and W"):
        simulate(_replace(no_w, 0, [a for a in no_w.actions[0] if a != Action("W", 0, 1)]))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("sideways", 2, 4), "unknown schedule 'sideways'"),
        (("interleaved", 2, 4, 1), "needs virtual_stages >= 2"),
        (("interleaved", 2, 3, 2), "microbatches divisible by stages=2"),
        (("zero_bubble", 4, 2), "needs microbatches >= stages=4"),
        (("1f1b", 2, 4, 2), "virtual_stages=2 needs schedule='interleaved'"),
        (("1f1b", 0, 4), "stages must be a positive int, got 0"),
        (("gpipe", 2, 2.5), "microbatches must be a positive int, got 2.5"),
    ],
)
def test_bad_schedule_arguments_name_the_value(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_bad_costs_name_the_field() -> None:
    with pytest.raises(ValueError, match="forward must be a finite number >= 0, got -1"):
        Costs(forward=-1)
