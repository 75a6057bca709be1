"""The rule table: what a propagation rule sees (``Spec``), what it returns (``OpSharding``), and ``pick``.

A rule is one function registered for one or more ATen ops with :func:`rule`. It is called with
the op's arguments, each tensor replaced by a :class:`Spec` (global shape, placements, dtype, mesh,
whether it is a parameter), and returns either the output placements (the inputs are used as they
are) or an :class:`OpSharding`: the placements each tensor input must be redistributed to first, the
output placements, and, where the local computation differs from the op itself, the local
arguments or a ``compute`` function. Example, the whole rule for ``aten.mm``::

    @rule(aten.mm)
    def mm(a: Spec, b: Spec) -> OpSharding:
        return pick([a, b], [(R, (R, R)), (Shard(0), (Shard(0), R)), (Shard(1), (R, Shard(1))),
                             (Partial(), (Shard(1), Shard(0)))])

:func:`pick` chooses, independently per mesh axis, the cheapest of a rule's options: an option
is ``(output placement, input placements)`` valid on one axis, and its cost is the communication
needed to bring the inputs to it, after two preferences that keep the layout a whole model was
planned with (see :func:`pick`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import torch

from colfunc import torch_private
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

__all__ = [
    "RULES",
    "OpSharding",
    "Option",
    "R",
    "Spec",
    "gradient_arithmetic",
    "lookup",
    "pick",
    "rule",
]

R = Replicate()


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """What a rule sees of one tensor argument."""

    shape: tuple[int, ...]
    placements: Placements
    dtype: torch.dtype
    mesh: Mesh
    param: bool = False  # a parameter (a leaf that requires grad), or a view or cast of one

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
        return local_shape(
            self.shape, self.mesh, self.placements if placements is None else placements
        )

    def shard_range(self, dim: int, placements: Placements | None = None) -> tuple[int, int]:
        """``(offset, size)`` of this rank's part of ``dim``."""
        pl = self.placements if placements is None else placements
        return shard_range(self.shape[dim], self.mesh, pl, dim)


Outputs: TypeAlias = Placements | tuple[Placements, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class OpSharding:
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


Rule: TypeAlias = Callable[..., "OpSharding | Outputs"]
RULES: dict[Any, Rule] = {}


F = TypeVar("F", bound=Rule)


def rule(*ops: Any) -> Callable[[F], F]:
    """Register the decorated function as the rule of ``ops`` (overload packets or overloads)."""

    def register(fn: F) -> F:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def lookup(func: torch._ops.OpOverload) -> Rule | None:
    """The rule of ``func``: one registered for the overload, else for its packet."""
    return RULES.get(func) or RULES.get(func.overloadpacket)


def gradient_arithmetic() -> bool:
    """Whether the op being placed computes gradients: autograd is running a backward node and
    not recording (remat recomputing a layer inside the backward pass records: a forward). A
    rule may place such an op differently (a gradient sum keeps its pending reduction, see
    :func:`pick`'s ``defer``), so the dispatcher's memo keys on it too."""
    return not torch.is_grad_enabled() and torch_private.in_backward()


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


def _moves(src: Placement, dst: Placement | None) -> bool:
    """Whether ``src -> dst`` communicates: it undoes a split or reduces a Partial."""
    return dst is not None and src != dst and not isinstance(src, Replicate)


def _preference(
    specs: Sequence[Spec], wants: Sequence[Placement | None], a: int
) -> tuple[int, int]:
    """What an option gives up on axis ``a``, worst first: (moves a parameter, splits anew)."""
    srcs = [s.placements[a] for s in specs]
    moves_param = any(s.param and _moves(p, w) for s, p, w in zip(specs, srcs, wants))
    held = {w for p, w in zip(srcs, wants) if isinstance(w, Shard) and p == w}
    splits_anew = any(
        isinstance(w, Shard) and _moves(p, w) and (isinstance(p, Shard) or w not in held)
        for p, w in zip(srcs, wants)
    )
    return int(moves_param), int(splits_anew)


def pick(
    specs: Sequence[Spec],
    candidates: Sequence[Option],
    *,
    out_numel: int | Sequence[int] | None = None,
    partial_cost: float = 2.0,
    defer: bool = False,
) -> OpSharding:
    """The cheapest option on each mesh axis, combined into an OpSharding (ties: the earlier option).

    An option's cost is the communication that brings the inputs to it, plus, for each Partial
    output, the all_reduce that will reduce it later (``partial_cost`` times its size
    ``out_numel``, default the largest input's; 0 for ops that merely copy). Without that price a
    Partial would ride through every linear op unreduced (Megatron reduces right after the
    row-parallel layer). With ``defer`` (the elementwise rules of gradient arithmetic, see
    :func:`gradient_arithmetic`) a Partial input carried to a Partial output owes no new
    reduction, only its own, moved: a gradient sum ``Partial + R`` then stays Partial rather than
    reducing now, so that the input gradients of weights that read one activation (a LoRA
    adapter's beside its base weight, q's beside k's) are reduced once, where they all meet. The
    forward pass keeps Megatron's placement (equal to one device bit for bit where the sums allow).

    Two preferences come before the cost, in this order; an option that breaks one is taken only
    when every option does:

    - *Parameters stay where the tensor-parallel plan put them* (Megatron-LM's layout). Gathering a weight looks
      cheap by bytes whenever the activations outweigh it (a small model, a long batch), but it is
      paid again every step, and the weight's gradient is then computed whole on every rank: the
      backward ``grad_out[Shard(1)] @ w.T[Shard(0)]`` of a column-parallel layer leaves a Partial
      input gradient (one all_reduce of the activation for q, k and v together) rather than
      gathering both.
    - *No new split of a split or Partial input* (all_to_all, reduce_scatter), unless another
      input of the option already holds that split: such a new layout is cheap for this op but
      every later op pays for it (a norm that cannot keep its input's split should gather it, not
      move the split to the batch dim), while reducing a Partial onto the split that the other
      operand has is Megatron's reduce_scatter under sequence parallelism.
    """
    mesh = specs[0].mesh
    n_out = len(candidates[0][0]) if isinstance(candidates[0][0], tuple) else 1
    if out_numel is None:
        out_numel = max(s.numel for s in specs)
    sizes = [out_numel] * n_out if isinstance(out_numel, int) else list(out_numel)

    def cost(a: int, opt: Option) -> float:
        outs = opt[0] if isinstance(opt[0], tuple) else (opt[0],)
        later = sum(n for o, n in zip(outs, sizes) if isinstance(o, Partial))
        if defer and later:  # a Partial input carried on: its pending reduction moves, no new one
            carried = sum(
                s.numel
                for s, w in zip(specs, opt[1])
                if isinstance(w, Partial) and s.placements[a] == w
            )
            later = max(later - carried, 0)
        return partial_cost * later + sum(
            s.numel * _cost(s.placements[a], w) for s, w in zip(specs, opt[1])
        )

    ins: list[list[Placement]] = [[] for _ in specs]
    outs: list[OptionOut] = []
    for a, axis in enumerate(mesh.axis_names):
        if mesh.axis_size(axis) == 1:  # every option is free; keep the inputs as they are
            best: Option = candidates[0]
            for opt in candidates:
                if all(w is None or w == s.placements[a] for s, w in zip(specs, opt[1])):
                    best = opt
                    break
        else:
            best = min(candidates, key=lambda opt: (*_preference(specs, opt[1], a), cost(a, opt)))
        for i, (s, w) in enumerate(zip(specs, best[1])):
            ins[i].append(s.placements[a] if w is None else w)
        outs.append(best[0])
    by_output = tuple(zip(*outs)) if isinstance(outs[0], tuple) else tuple(outs)
    return OpSharding(outputs=cast(Outputs, by_output), inputs=[tuple(p) for p in ins])
