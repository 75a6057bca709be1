"""Where chunks live: device budgets, the access trace of a step, and the eviction rule.

A step touches its parameter groups in an order that repeats from step to step: group 0 at the
start, layers ``1..L`` forward, ``L..1`` backward (each group again on recomputation under
``remat``). A :class:`Trace` records that order during the first (warm-up) step, with, for each
event, the peak of non-model bytes (activations, gradients in flight, workspace) on the device
until the next event. From then on the device holds, at each event, what fits in the budget less
that peak, evicting the chunks whose next use in the trace is farthest away (Belady's rule).
:func:`belady_bytes` runs the same rule offline over a trace: the traffic of the optimum that the
online placement is measured against.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import torch

__all__ = ["Event", "Trace", "belady_bytes", "device_budget", "next_uses"]

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_budget(
    budget: int | float | str | None, device: torch.device, *, whole: bool = False
) -> int:
    """``budget`` in bytes: an int (bytes), a string like ``"2GiB"`` or ``"512MB"``, or a float
    in (0, 1] (that fraction of the device's memory). None means the whole device, which needs
    one: on a machine without a GPU the "device" is the CPU, and a budget must be given, unless
    ``whole`` (a policy that keeps everything on the device, which streams nothing: the memory
    of the machine then)."""
    if budget is None:
        if device.type == "cpu" and not whole:
            raise ValueError(
                "offload: device_budget is required on a machine without a GPU (the CPU then "
                "stands for the device); pass bytes, a string like '2GiB', or a fraction"
            )
        return _device_memory(device)
    if isinstance(budget, bool):
        raise TypeError(
            f"offload: device_budget must be bytes, a string or a fraction, got {budget!r}"
        )
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in _UNITS):
            raise ValueError(
                f"offload: cannot read device_budget {budget!r}; write a number and a unit "
                f"such as '2GiB', '512MiB', '1.5GB' (units: {', '.join(_UNITS)})"
            )
        value = int(float(m.group(1)) * _UNITS[unit or "b"])
    elif isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"offload: a float device_budget is a fraction of the device's memory, in (0, 1]; "
                f"got {budget}"
            )
        value = int(budget * _device_memory(device))
    elif isinstance(budget, int):
        value = budget
    else:
        raise TypeError(
            f"offload: device_budget must be bytes, a string or a fraction, got {budget!r}"
        )
    if value <= 0:
        raise ValueError(f"offload: device_budget must be > 0 bytes, got {budget!r}")
    return value


@dataclasses.dataclass
class Event:
    """Group ``group`` needed on the device (``backward``: for the backward pass); ``nonmodel``
    is the peak of non-model device bytes from this event to the next."""

    group: int
    backward: bool
    nonmodel: int = 0


@dataclasses.dataclass
class Trace:
    """The events of one step, in order, and the non-model peak before the first of them (one
    trace per batch signature: another shape allocates differently)."""

    events: list[Event] = dataclasses.field(default_factory=list)
    head: int = 0  # non-model peak from the start of the step to the first event
    update: int = 0  # the update's peak of device bytes beyond the resident ones

    def groups(self) -> list[int]:
        return [e.group for e in self.events]


def next_uses(groups: Sequence[int]) -> list[dict[int, int]]:
    """For each position ``k`` of ``groups``, the position of every group's next use after
    ``k``, cycling into the next step (a group not used again this step is used at its first
    position plus the length of the trace)."""
    n = len(groups)
    first: dict[int, int] = {}
    for k, g in enumerate(groups):
        first.setdefault(g, k)
    nxt = {g: k + n for g, k in first.items()}
    out: list[dict[int, int]] = [{} for _ in range(n)]
    for k in range(n - 1, -1, -1):
        out[k] = dict(nxt)
        nxt[groups[k]] = k
    return out


def belady_bytes(
    groups: Sequence[int],
    sizes: dict[int, int],
    capacities: Sequence[int],
    resident: Sequence[int] = (),
) -> int:
    """Bytes loaded serving ``groups`` in order with a cache whose capacity at position ``k``
    is ``capacities[k]``, evicting the group used farthest in the future (Belady's rule, the
    offline optimum for one size; a bound for several). ``resident`` groups are loaded at start
    (a step starts with the cache empty since its parameters changed in the last update)."""
    uses = next_uses(groups)
    cache = set(resident)
    moved = 0
    for k, g in enumerate(groups):
        if g not in cache:
            moved += sizes[g]
            cache.add(g)
        while sum(sizes[h] for h in cache) > capacities[k]:
            victims = [h for h in cache if h != g]
            if not victims:
                break
            cache.discard(max(victims, key=lambda h: uses[k].get(h, 1 << 60)))
    return moved
