"""The zero-bubble split of a stage's backward (Qi et al. 2023) into input and weight passes.

The input pass computes only the gradient of the stage input, which the previous stage waits
for, and records the gradient arriving at each *meeting point*: an autograd node that depends on
the input and also leads to a weight. The weight pass later runs the backward from those meeting
points to the weights alone, so it costs the weight half of the backward, not all of it again.
Weights whose paths share a meeting point are one group, run in one backward call; a layer's
weights are leaves of their own (see the runtime), so the groups stay small.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["input_pass", "weight_pass"]


class _Group:
    """Weights whose gradients flow in through the same meeting points."""

    def __init__(self, weights: set[int], meets: set[Node]) -> None:
        self.weights, self.meets = weights, meets
        self.grads: dict[Node, tuple[torch.Tensor | None, ...]] = {}


def _meeting_groups(
    outs: list[torch.Tensor], xs: list[torch.Tensor], weights: list[torch.Tensor]
) -> list[_Group]:
    """Group ``weights`` by the nodes where their gradient paths meet the ones from ``xs``."""
    roots = {get_gradient_edge(out).node for out in outs}
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = set(roots), list(roots)
    while stack:
        n = stack.pop()
        for nxt, _ in n.next_functions:
            if nxt is not None:
                users[nxt].append(n)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    x_nodes = {get_gradient_edge(x).node for x in xs}
    on_path, stack = set(x_nodes), list(x_nodes)  # the nodes whose output depends on an x
    while stack:
        for u in users[stack.pop()]:
            if u not in on_path:
                on_path.add(u)
                stack.append(u)
    by_meet: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for i, w in enumerate(weights):
        w_node = get_gradient_edge(w).node
        if w_node not in seen:
            continue  # not used by this stage
        meets: set[Node] = set()
        visited, stack = {w_node}, [w_node]
        while stack:
            for u in users[stack.pop()]:
                if u in on_path:
                    meets.add(u)
                elif u not in visited:
                    visited.add(u)
                    stack.append(u)
        group = _Group({i}, meets)
        for other in {id(by_meet[m]): by_meet[m] for m in meets if m in by_meet}.values():
            group.weights |= other.weights
            group.meets |= other.meets
            groups.remove(other)
        groups.append(group)
        for m in group.meets:
            by_meet[m] = group
    return groups


def input_pass(
    outs: list[torch.Tensor],
    gs: list[torch.Tensor] | None,
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], list[_Group]]:
    """The gradients of ``xs`` (seeding ``outs`` with ``gs``), and what the weight pass needs."""
    groups = _meeting_groups(outs, xs, weights)
    handles = []
    for group in groups:
        for node in group.meets:

            def keep(grads: tuple[Any, ...], group: _Group = group, node: Node = node) -> None:
                group.grads[node] = tuple(grads)

            handles.append(node.register_prehook(keep))
    try:
        gxs = torch.autograd.grad(outs, xs, gs, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return tuple(gxs), groups


def weight_pass(
    groups: list[_Group], weights: list[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``weights`` (None where unused), from an input pass's meeting points."""
    grads: list[torch.Tensor | None] = [None] * len(weights)
    for group in groups:
        edges, seeds = [], []
        for node, gs in group.grads.items():
            for k, gk in enumerate(gs):
                if gk is not None:
                    edges.append(GradientEdge(node, k))
                    seeds.append(gk)
        if not edges:
            continue
        # a meeting point downstream of another would also receive the other's gradient: hand
        # each exactly what it received in the input pass
        handles = [
            node.register_prehook(lambda _, saved=gs: saved) for node, gs in group.grads.items()
        ]
        order = sorted(group.weights)
        # A weight met at several points along the input's path (a per-layer input made from
        # one parameter, say) is reached from the later point back through the earlier one too,
        # across nodes that another group's pass also runs: every pass keeps the graph, which is
        # freed with the last reference to it, at the end of the stage's weight action.
        try:
            got = torch.autograd.grad(
                edges,
                [get_gradient_edge(weights[i]) for i in order],
                seeds,
                allow_unused=True,
                retain_graph=True,
            )
        finally:
            for h in handles:
                h.remove()
        for i, gi in zip(order, got):
            grads[i] = gi
    return tuple(grads)
