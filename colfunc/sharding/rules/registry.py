"""The rule table: what a propagation rule sees (``Spec``), what it returns (``Plan``), and ``pick``.

A rule is one function registered for one or more ATen ops with :func:`rule`. It is called with
the op's arguments, each tensor replaced by a :class:`Spec` (global shape, placements, dtype, mesh),
and returns either the output placements (the inputs are used as they are) or a :class:`Plan`:
the placements each tensor input must be redistributed to first, the output placements, and,
where the local computation differs from the op itself, the local arguments or a ``compute``
function. Example, the whole rule for ``aten.mm``::

    @rule(aten.mm)
    def mm(a: Spec, b: Spec) -> Plan:
        return pick([a, b], [(R, (R, R)), (Shard(0), (Shard(0), R)), (Shard(1), (R, Shard(1))),
                             (Partial(), (Shard(1), Shard(0)))])

:func:`pick` chooses, independently per mesh axis, the cheapest of a rule's options: an option
is ``(output placement, input placements)`` valid on one axis, and its cost is the communication
needed to bring the inputs to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import (
    Partial,
    Placement,
    Placements,
    Replicate,
    Shard,
    local_shape,
    shard_range,
)

__all__ = ["R", "RULES", "Option", "Plan", "Spec", "lookup", "pick", "rule"]

R = Replicate()


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """What a rule sees of one tensor argument."""

    shape: tuple[int, ...]
    placements: Placements
    dtype: torch.dtype
    mesh: Mesh

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def axes_on(self, dim: int, placements: Placements | None = None) -> tuple[str, ...]:
        """The mesh axes that split tensor dim ``dim`` (major first)."""
        pl = self.placements if placements is None else placements
        return tuple(a for a, p in zip(self.mesh.axis_names, pl) if p == Shard(dim))

    def local_shape(self, placements: Placements | None = None) -> tuple[int, ...]:
        return local_shape(self.shape, self.mesh, self.placements if placements is None else placements)

    def shard_range(self, dim: int, placements: Placements | None = None) -> tuple[int, int]:
        """``(offset, size)`` of this rank's part of ``dim``."""
        pl = self.placements if placements is None else placements
        return shard_range(self.shape[dim], self.mesh, pl, dim)


Outputs: TypeAlias = Placements | tuple[Placements, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """How to run one op on local shards.

    ``outputs``: the output placements, or one placements tuple per output of a tuple-returning
    op (one tuple for a list-returning op applies to every element). ``inputs``: per tensor
    argument in argument order, the placements to redistribute it to (None: as it is). ``args``,
    ``kwargs``: the arguments of the local call (tensors given as their Specs) when they differ
    from the op's (local sizes, say). ``compute``: called instead of the op on the local
    arguments.
    """

    outputs: Outputs
    inputs: Sequence[Placements | None] | None = None
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    compute: Callable[..., Any] | None = None


Rule: TypeAlias = Callable[..., "Plan | Outputs"]
RULES: dict[Any, Rule] = {}


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule of ``ops`` (overload packets or overloads)."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def lookup(func: torch._ops.OpOverload) -> Rule | None:
    """The rule of ``func``: one registered for the overload, else for its packet."""
    return RULES.get(func) or RULES.get(func.overloadpacket)


# --- choosing placements per axis -------------------------------------------------------------

OptionOut: TypeAlias = Placement | tuple[Placement, ...]
Option: TypeAlias = tuple[OptionOut, Sequence[Placement | None]]


def _cost(src: Placement, dst: Placement | None) -> float:
    """Communication to turn ``src`` into ``dst`` on one axis, in tensor sizes."""
    if dst is None or src == dst:
        return 0.0
    if isinstance(src, Replicate):
        return 1e-3  # a local slice or zero fill
    if isinstance(src, Shard):
        return 0.5 if isinstance(dst, Shard) else 1.0 + (1e-3 if isinstance(dst, Partial) else 0)
    # Partial -> anything: an all_reduce. A reduce_scatter is priced like the all_reduce it
    # becomes once its shards are gathered again, so that a Partial is not scattered along a dim
    # that no later op asked for (the earlier, replicated option wins the tie).
    return 2.0


def pick(specs: Sequence[Spec], options: Sequence[Option]) -> Plan:
    """The cheapest option on each mesh axis, combined into a Plan (ties: the earlier option)."""
    mesh = specs[0].mesh
    ins: list[list[Placement]] = [[] for _ in specs]
    outs: list[OptionOut] = []
    for a, axis in enumerate(mesh.axis_names):
        if mesh.axis_size(axis) == 1:  # every option is free; keep the inputs as they are
            best: Option = options[0]
            for opt in options:
                if all(w is None or w == s.placements[a] for s, w in zip(specs, opt[1])):
                    best = opt
                    break
        else:
            best = min(
                options,
                key=lambda opt: sum(
                    s.numel * _cost(s.placements[a], w) for s, w in zip(specs, opt[1])
                ),
            )
        for i, (s, w) in enumerate(zip(specs, best[1])):
            ins[i].append(s.placements[a] if w is None else w)
        outs.append(best[0])
    if isinstance(outs[0], tuple):
        outputs: Outputs = tuple(zip(*outs))  # type: ignore[arg-type]
    else:
        outputs = tuple(outs)  # type: ignore[arg-type]
    return Plan(outputs=outputs, inputs=[tuple(p) for p in ins])
