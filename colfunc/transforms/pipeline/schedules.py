"""Pipeline schedules as data: one list of actions per rank, for every schedule we run.

Legend: ``p`` ranks on the pipeline axis, ``v`` virtual stages (model chunks) per rank,
``S = p * v`` stages, ``m`` microbatches. Stage ``s`` is a contiguous run of layers in model
order and lives on rank ``s % p`` (round robin: rank ``r`` holds stages ``r, r + p, ...``), so
consecutive stages are on consecutive ranks and the last stage's successor wraps to rank 0.

Actions (``Action(op, stage, mb)``):

======== ====================================================================================
``F``     forward of ``stage`` on microbatch ``mb``
``B``     its whole backward (input and weight gradients)
``I``     the input-gradient half of the backward (zero bubble)
``W``     the deferred weight-gradient half
``SEND_F`` send ``stage``'s output to the rank of ``stage + 1``
``RECV_F`` receive ``stage``'s input from the rank of ``stage - 1``
``SEND_B`` send the gradient of ``stage``'s input to the rank of ``stage - 1``
``RECV_B`` receive the gradient of ``stage``'s output from the rank of ``stage + 1``
======== ====================================================================================

The builders write the compute order of each rank; :func:`with_comms` adds a receive right before
the computation that needs it and a send right after the one that produces it (none between
stages on one rank). Sends do not wait for their receiver; a receive waits for its message.
:mod:`.simulate` runs these lists; the runtime executes them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple

__all__ = ["SCHEDULES", "Action", "Schedule", "build", "with_comms"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class Action(NamedTuple):
    """One step of a rank's schedule: ``op`` on ``stage`` for microbatch ``mb``."""

    op: str
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.op}{self.stage}.{self.mb}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per-rank action lists (``actions[rank]``) of one schedule; see the module docstring."""

    name: str
    ranks: int
    virtual_stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return stage % self.ranks

    def compute(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s computations in order, without the transfers."""
        return tuple(a for a in self.actions[rank] if a.op in COMPUTE)

    def forward_only(self) -> Schedule:
        """This schedule's forward actions and their transfers, in the same order (the forward
        pass of an evaluation). Only receives wait, so dropping actions never adds a wait."""
        kept = tuple(
            tuple(a for a in acts if a.op in ("F", "SEND_F", "RECV_F")) for acts in self.actions
        )
        return dataclasses.replace(self, name=f"{self.name}/forward", actions=kept)


def check(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ``ValueError`` naming the value and the fix if the schedule cannot take these sizes."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {name!r}; use one of {SCHEDULES}")
    for field, value in (
        ("stages", ranks),
        ("microbatches", microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline: {field} must be a positive int, got {value!r}")
    if name == "interleaved":
        if virtual_stages < 2:
            raise ValueError(
                f"pipeline: schedule='interleaved' needs virtual_stages >= 2, got "
                f"{virtual_stages}; use schedule='1f1b' for one stage per rank"
            )
        if microbatches % ranks:
            # Megatron's interleaved order runs the microbatches in rounds of p
            raise ValueError(
                f"pipeline: schedule='interleaved' needs microbatches divisible by stages={ranks}, "
                f"got microbatches={microbatches}; use a multiple of {ranks}"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"pipeline: virtual_stages={virtual_stages} needs schedule='interleaved'; "
            f"schedule={name!r} runs one stage per rank"
        )
    if name == "zero_bubble" and microbatches < ranks:
        raise ValueError(
            f"pipeline: schedule='zero_bubble' needs microbatches >= stages={ranks}, got "
            f"microbatches={microbatches}; use at least {ranks}"
        )


def _gpipe(p: int, m: int, r: int) -> list[Action]:
    # all forwards, then all backwards (Huang et al. 2019): m microbatches in flight
    return [Action("F", r, j) for j in range(m)] + [Action("B", r, j) for j in range(m)]


def _one_f_one_b(p: int, m: int, r: int, split: bool = False) -> list[Action]:
    # PipeDream-flush (Narayanan et al. 2021): p - 1 - r warm-up forwards, then one forward and
    # one backward alternately, so at most p - r microbatches are in flight on rank r.
    # With ``split`` (ZB-H1, Qi et al. 2023) the backward is I then W, and rank r holds back r
    # weight gradients, which fill the cool-down bubble of the I passes flowing back.
    warm = min(p - 1 - r, m)
    out = [Action("F", r, j) for j in range(warm)]
    w = 0
    for k in range(m):
        if k + warm < m:
            out.append(Action("F", r, k + warm))
        out.append(Action("I" if split else "B", r, k))
        if split and k >= r:
            out.append(Action("W", r, w))
            w += 1
    out += [Action("W", r, j) for j in range(w, m)] if split else []
    return out


def _interleaved(p: int, v: int, m: int, r: int) -> list[Action]:
    # Megatron's interleaved 1F1B (Narayanan et al. 2021): rounds of p microbatches go through
    # the rank's v chunks in turn, forwards in chunk order and backwards in reverse.
    total = v * m
    warm = min((v - 1) * p + 2 * (p - 1 - r), total)
    count: dict[tuple[str, int], int] = defaultdict(int)

    def act(op: str, k: int) -> Action:
        chunk = (k // p) % v
        stage = (chunk if op == "F" else v - 1 - chunk) * p + r
        mb = count[op, stage]
        count[op, stage] += 1
        return Action(op, stage, mb)

    out = [act("F", k) for k in range(warm)]
    for k in range(total - warm):
        out += [act("F", warm + k), act("B", k)]
    out += [act("B", k) for k in range(total - warm, total)]
    return out


def with_comms(compute: list[list[Action]], ranks: int, virtual_stages: int) -> list[list[Action]]:
    """Each rank's list with its transfers: a receive before the consumer, a send after the producer."""
    last = ranks * virtual_stages - 1
    out = []
    for r, ops in enumerate(compute):
        acts: list[Action] = []
        for a in ops:
            s, j = a.stage, a.mb
            prev_remote = s > 0 and (s - 1) % ranks != r
            next_remote = s < last and (s + 1) % ranks != r
            if a.op == "F":
                acts += [Action("RECV_F", s, j)] if prev_remote else []
                acts.append(a)
                acts += [Action("SEND_F", s, j)] if next_remote else []
            elif a.op in ("B", "I"):
                acts += [Action("RECV_B", s, j)] if next_remote else []
                acts.append(a)
                acts += [Action("SEND_B", s, j)] if prev_remote else []
            else:
                acts.append(a)
        out.append(acts)
    return out


def build(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``).

    Examples:
        >>> s = build("1f1b", ranks=4, microbatches=8)
        >>> s.actions[3][:3]
        (RECV_F3.0, F3.0, B3.0)
    """
    check(name, ranks, microbatches, virtual_stages)
    p, m, v = ranks, microbatches, virtual_stages
    if name == "gpipe":
        compute = [_gpipe(p, m, r) for r in range(p)]
    elif name == "1f1b":
        compute = [_one_f_one_b(p, m, r) for r in range(p)]
    elif name == "zero_bubble":
        compute = [_one_f_one_b(p, m, r, split=True) for r in range(p)]
    else:
        compute = [_interleaved(p, v, m, r) for r in range(p)]
    actions = tuple(tuple(a) for a in with_comms(compute, p, v))
    return Schedule(name=name, ranks=p, virtual_stages=v, microbatches=m, actions=actions)
