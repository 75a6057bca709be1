"""Run every rank's action list with given op costs: time line, idle time (the bubble), peak
in-flight microbatches, and deadlocks.

Each rank runs its list in order. A computation takes its cost, and so does a send (the
sender's own work, zero by default); a message can be used ``latency`` after its send ends (the
cost of the receive action), and a receive waits until then.
Every computation checks that what it consumes is there (the input of a forward, the output
gradient of a backward, the input-gradient pass before its weight pass): a list that computes
before it receives is a broken schedule, and ranks that all wait on messages no one will send are
a deadlock. Both raise :class:`ScheduleError` naming each rank and the action it is stuck at.

Idle time is measured against the makespan (the last rank's finish): rank ``r`` is busy for the
sum of its computations and sends and idle for the rest, waiting for messages, so
``bubble[r] = 1 - busy[r] / makespan``. A microbatch
is in flight on a rank from the forward of one of its stages until that stage's backward (``B``
or ``I``): the activations a rank keeps, in units of one stage's activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from colfunc.transforms.pipeline.schedules import Action, Schedule

__all__ = ["Costs", "ScheduleError", "Simulation", "simulate"]


class ScheduleError(ValueError):
    """A schedule that deadlocks, computes before it receives, or misses or repeats work."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """The time of each op on one stage (one model chunk), of a send on its sender, and the
    latency from the end of a send to when the receiver can use the message.

    The defaults are the unit costs of the papers: a backward is two forwards, and its two
    halves (input and weight gradients) one each; transfers are free.
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    send: float = 0.0
    latency: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"Costs: {f.name} must be a finite number >= 0, got {value!r}")

    def __call__(self, action: Action) -> float:
        if action.op.startswith("RECV"):
            return self.latency
        return {
            "F": self.forward,
            "B": self.backward,
            "I": self.backward_input,
            "W": self.backward_weight,
        }.get(action.op, self.send)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Simulation:
    """What :func:`simulate` found; per-rank tuples are indexed by rank."""

    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]  # idle fraction of the makespan
    peak_in_flight: tuple[int, ...]
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]  # computations and sends


def _message(a: Action, last: int) -> tuple[str, int, int]:
    """The message a transfer carries: (direction, the stage that sends it, microbatch)."""
    if a.op == "SEND_F":
        return ("F", a.stage, a.mb)
    if a.op == "RECV_F":
        return ("F", a.stage - 1, a.mb)
    if a.op == "SEND_B":
        return ("B", a.stage, a.mb)
    return ("B", a.stage + 1, a.mb)  # RECV_B


def simulate(schedule: Schedule, costs: Costs | Callable[[Action], float] = Costs()) -> Simulation:
    """Run ``schedule`` with ``costs``: a :class:`Costs`, or ``action -> time`` for measured
    ones (for a receive, the latency of its message).

    Example:
        >>> sim = simulate(build("1f1b", ranks=4, microbatches=8))
        >>> sim.bubble[0]  # (p - 1) / (m + p - 1)
        0.2727...
    """
    p, last = schedule.ranks, schedule.stages - 1
    lists = schedule.actions
    pc = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]  # (op, stage, mb) per rank
    arrived: dict[tuple[str, int, int], float] = {}
    received: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]
    in_flight = [0] * p
    peak = [0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]

    def fail(r: int, a: Action, why: str) -> ScheduleError:
        return ScheduleError(f"{schedule.name}: rank {r} at {a!r} (action {pc[r]}): {why}")

    def needs(r: int, a: Action) -> str | None:
        """What ``a`` consumes that rank ``r`` does not have yet, or None."""
        s, j = a.stage, a.mb
        have = done[r]
        if schedule.rank_of(s) != r:
            return f"stage {s} lives on rank {schedule.rank_of(s)}"
        if a.op == "F" and s > 0:
            if schedule.rank_of(s - 1) == r:
                return None if ("F", s - 1, j) in have else f"the forward F{s - 1}.{j}"
            return None if ("F", s - 1, j) in received[r] else f"its input (RECV_F{s}.{j})"
        if a.op in ("B", "I"):
            if ("F", s, j) not in have:
                return f"its forward F{s}.{j}"
            if s < last:
                if schedule.rank_of(s + 1) == r:
                    ok = ("B", s + 1, j) in have or ("I", s + 1, j) in have
                    return None if ok else f"the backward of stage {s + 1}, microbatch {j}"
                if ("B", s + 1, j) not in received[r]:
                    return f"its output gradient (RECV_B{s}.{j})"
        if a.op == "W" and ("I", s, j) not in have:
            return f"its input-gradient pass I{s}.{j}"
        if a.op.startswith("SEND"):
            op = "F" if a.op == "SEND_F" else ("B", "I")
            if not any((o, s, j) in have for o in op):
                return f"the computation that produces it ({op[0]}{s}.{j})"
        return None

    while True:
        moved = False
        for r in range(p):
            while pc[r] < len(lists[r]):
                a = lists[r][pc[r]]
                if a.op.startswith("RECV"):
                    msg = _message(a, last)
                    if msg not in arrived:
                        break  # wait for the sender
                    clock[r] = max(clock[r], arrived[msg] + costs(a))
                    received[r].add(msg)
                else:
                    missing = needs(r, a)
                    if missing is not None:
                        raise fail(r, a, f"needs {missing}, which this rank does not have yet")
                    cost = costs(a)
                    timeline[r].append((a, clock[r], clock[r] + cost))
                    clock[r] += cost
                    busy[r] += cost
                    if a.op.startswith("SEND"):
                        msg = _message(a, last)
                        if msg in arrived:
                            raise fail(r, a, "sends the same message twice")
                        arrived[msg] = clock[r]  # usable `latency` later
                    else:
                        key = (a.op, a.stage, a.mb)
                        if key in done[r]:
                            raise fail(r, a, "repeats a computation")
                        done[r].add(key)
                        in_flight[r] += a.op == "F"
                        in_flight[r] -= a.op in ("B", "I")
                        peak[r] = max(peak[r], in_flight[r])
                pc[r] += 1
                moved = True
        if all(pc[r] == len(lists[r]) for r in range(p)):
            break
        if not moved:
            stuck = [
                f"rank {r} waits at {lists[r][pc[r]]!r} (action {pc[r]})"
                for r in range(p)
                if pc[r] < len(lists[r])
            ]
            raise ScheduleError(f"{schedule.name}: deadlock: " + "; ".join(stuck))
    _check_complete(schedule, done)
    makespan = max(clock)
    return Simulation(
        makespan=makespan,
        busy=tuple(busy),
        bubble=tuple(1 - b / makespan if makespan else 0.0 for b in busy),
        peak_in_flight=tuple(peak),
        timeline=tuple(tuple(t) for t in timeline),
    )


def _check_complete(schedule: Schedule, done: list[set[tuple[str, int, int]]]) -> None:
    for s in range(schedule.stages):
        r = schedule.rank_of(s)
        for j in range(schedule.microbatches):
            has = {op for op in "FBIW" if (op, s, j) in done[r]}
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                raise ScheduleError(
                    f"{schedule.name}: rank {r} runs {sorted(has)} for stage {s}, microbatch {j}; "
                    "each needs F and B, or F, I and W"
                )
