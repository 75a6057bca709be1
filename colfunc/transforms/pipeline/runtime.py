"""Running one rank's pipeline schedule: forwards and backwards per microbatch, the transfers
between stages over the pipeline axis, and the zero-bubble split of the backward.

Each microbatch's forward on a stage keeps its autograd graph until that stage's backward, which
starts from the gradient received for the stage's output (the last stage starts from its loss,
scaled by ``loss_scale / microbatches`` so that the summed gradients are those of the mean loss).
Every layer gets its own parameter leaves, run through :func:`colfunc.scan_layers` one layer at a
time, so remat and ZeRO-3 still see each layer, and so a layer's weight gradients hang off the
graph independently of the others (what the weight pass below relies on).

Zero bubble (Qi et al. 2023) splits a backward in two. ``I`` computes only the gradient of the
stage input, which the previous stage waits for, and records the gradient arriving at each
*meeting point*: an autograd node that depends on the input and also leads to a weight.
``W`` later runs the backward from those meeting points to the weights alone, so it costs the
weight half of the backward, not all of it again. A first stage has no input gradient to hurry:
its ``I`` does nothing and its ``W`` runs the whole backward.

Transfers are point to point (``comm.send``/``comm.recv``), each message tagged by its direction,
stage and microbatch. A sharded tensor crosses as its local piece, to the rank of the next stage
with the same coordinates on the other axes. The first message of each direction between two
ranks in a step is preceded by a small descriptor (local shape, dtype, and a sharded tensor's
global shape and placements), since the receiver cannot know them before the model has run.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from colfunc import core, tree
from colfunc.sharding import Mesh, Partial, Replicate, Shard, ShardedTensor, comm
from colfunc.sharding.placement import PARTIAL_OPS
from colfunc.transforms.pipeline.schedules import Action, Schedule

__all__ = ["Runner", "Trace"]

PyTree = Any
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DESCRIPTOR = 32  # int64 entries, see _describe


class Trace:
    """A context frame that records when each action of this rank's schedule ran.

    ``events`` holds ``(action, start, end)`` in ``time.perf_counter()`` seconds, which on Linux
    is one clock for every process of the machine, so ranks' traces can be laid side by side.

    Example:
        >>> with cf.core.context(Trace()) as trace:
        ...     state, metrics = step(state, batch)
    """

    def __init__(self) -> None:
        self.events: list[tuple[Action, float, float]] = []


def _local(x: torch.Tensor) -> torch.Tensor:
    return x._local if isinstance(x, ShardedTensor) else x


Meta = tuple[tuple[int, ...], torch.dtype, Any]  # local shape, dtype, (shape, placements) or None


def _describe(x: torch.Tensor) -> torch.Tensor:
    """What a receiver needs to rebuild ``x``: its local shape and dtype, and for a sharded
    tensor its global shape and placements (each rank sends its own piece to the rank with the
    same coordinates on the other axes, so a piece stays a piece of the same tensor)."""
    local = _local(x)
    desc = [local.dim(), *local.shape, _DTYPES.index(local.dtype)]
    if isinstance(x, ShardedTensor):
        desc += [1, x.dim(), *x.shape, *(_placement_code(p) for p in x.placements)]
    if len(desc) > _DESCRIPTOR:
        raise ValueError(f"pipeline: cannot describe a stage output of shape {tuple(x.shape)}")
    return torch.tensor(desc + [0] * (_DESCRIPTOR - len(desc)), dtype=torch.int64)


def _read(desc: list[int], mesh: Mesh) -> Meta:
    n = desc[0]
    local, dtype, at = tuple(desc[1 : 1 + n]), _DTYPES[desc[1 + n]], 2 + n
    if not desc[at]:
        return local, dtype, None
    g = desc[at + 1]
    shape = tuple(desc[at + 2 : at + 2 + g])
    codes = desc[at + 2 + g : at + 2 + g + len(mesh.axis_names)]
    return local, dtype, (shape, tuple(_placement(c) for c in codes))


def _placement_code(p: Any) -> int:
    if isinstance(p, Shard):
        return 1 + p.dim
    if isinstance(p, Partial):
        return -1 - PARTIAL_OPS.index(p.op)
    return 0


def _placement(code: int) -> Any:
    if code > 0:
        return Shard(code - 1)
    return Partial(PARTIAL_OPS[-1 - code]) if code < 0 else Replicate()


class _Link:
    """This rank's transfers over the pipeline axis during one step.

    ``expected`` lists the ``(source, direction, tag)`` of this rank's receives in schedule
    order. The next ``AHEAD`` of them are kept posted, so that a message moves while this rank
    computes rather than when it asks. The first message of each direction between two ranks
    is preceded by its descriptor (tag 0 forward, 1 backward), posted as early as the message.
    """

    AHEAD = 4

    def __init__(self, mesh: Mesh, axis: str, expected: list[tuple[int, str, int]]) -> None:
        self.mesh, self.axis = mesh, axis
        self.meta: dict[tuple[int, str], Meta] = {}  # by (source, direction)
        self.headers: dict[tuple[int, str], Any] = {}  # posted descriptor receives
        self.told: set[tuple[int, str]] = set()
        self.sends: list[Any] = []
        self.expected = expected
        self.posted: dict[int, Any] = {}  # position in `expected` -> posted receive
        self.next = 0  # position of the next receive to hand out
        self._post_ahead()

    def send(self, x: torch.Tensor, dst: int, direction: str, tag: int) -> None:
        if (dst, direction) not in self.told:
            self.told.add((dst, direction))
            header = _describe(x)
            self.sends.append(
                comm.send(header, self.axis, dst, tag=int(direction == "B"), mesh=self.mesh)
            )
        local = _local(x).detach()
        self.sends.append(comm.send(local, self.axis, dst, tag=tag, mesh=self.mesh))

    def _post_header(self, key: tuple[int, str]) -> None:
        if key not in self.headers:
            src, direction = key
            tag = int(direction == "B")
            self.headers[key] = comm.recv(
                (_DESCRIPTOR,), torch.int64, self.axis, src, tag=tag, mesh=self.mesh
            )

    def _post(self, k: int) -> None:
        src, direction, tag = self.expected[k]
        shape, dtype, _ = self.meta[src, direction]
        self.posted[k] = comm.recv(shape, dtype, self.axis, src, tag=tag, mesh=self.mesh)

    def _post_ahead(self) -> None:
        for k in range(self.next, min(self.next + self.AHEAD, len(self.expected))):
            key = self.expected[k][:2]
            if k in self.posted:
                continue
            if key in self.meta:
                self._post(k)
            else:
                self._post_header(key)

    def recv(self, src: int, direction: str, tag: int) -> torch.Tensor:
        k = self.next
        if self.expected[k] != (src, direction, tag):
            raise RuntimeError(f"pipeline: receive {(src, direction, tag)} out of schedule order")
        key = (src, direction)
        if key not in self.meta:
            self._post_header(key)
            self.meta[key] = _read(self.headers.pop(key).wait().tolist(), self.mesh)
        if k not in self.posted:
            self._post(k)
        local = self.posted.pop(k).wait()
        self.next += 1
        self._post_ahead()
        sharded = self.meta[key][2]
        if sharded is None:
            return local
        return ShardedTensor(local, self.mesh, sharded[1], sharded[0])

    def finish(self) -> None:
        for r in self.sends:
            r.wait()
        self.sends.clear()


class _Group:
    """Weights whose gradients flow in through the same meeting points."""

    def __init__(self, weights: set[int], meets: set[Node]) -> None:
        self.weights, self.meets = weights, meets
        self.grads: dict[Node, tuple[torch.Tensor | None, ...]] = {}


def _meeting_groups(
    out: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor]
) -> list[_Group]:
    """Group ``weights`` by the nodes where their gradient paths meet the one from ``x``."""
    root = get_gradient_edge(out).node
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = {root}, [root]
    while stack:
        n = stack.pop()
        for nxt, _ in n.next_functions:
            if nxt is not None:
                users[nxt].append(n)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    x_node = get_gradient_edge(x).node
    on_path, stack = {x_node}, [x_node]  # the nodes whose output depends on x
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


class Runner:
    """Runs one rank's actions of ``schedule`` for one training step; see the module docstring.

    ``params`` are this rank's parameters as given to the step (the stacked ``blocks`` hold only
    this rank's layers); ``stage_layers[s]`` is the ``(start, stop)`` range of stage ``s`` in
    this rank's local layers.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        loss: core.Layered,
        params: PyTree,
        stage_layers: dict[int, tuple[int, int]],
        microbatches: list[PyTree],
        mesh: Mesh | None,
        axis: str,
    ) -> None:
        self.schedule, self.rank, self.loss = schedule, rank, loss
        self.microbatches = microbatches
        self.last = schedule.stages - 1
        self.scale = core.loss_scale() / len(microbatches)
        rest = {k: v for k, v in params.items() if k != "blocks"}
        flat, self.rest_def = tree.flatten_with_paths(rest)
        self.rest = [_leaf(x) for _, x in flat]
        bflat, self.blocks_def = tree.flatten_with_paths(params["blocks"])
        self.block_like = [x for _, x in bflat]
        per_leaf = [x.detach().unbind(0) for x in self.block_like]
        n_local = len(per_leaf[0]) if per_leaf else 0
        # layers[l][k]: leaf k of local layer l
        self.layers = [[_leaf(xs[i]) for xs in per_leaf] for i in range(n_local)]
        self.stage_layers = stage_layers
        self.link = None
        if mesh is not None and schedule.ranks > 1:
            expected = [
                (self._peer(a.stage - 1), "F", self._tag("F", a.stage - 1, a.mb))
                if a.op == "RECV_F"
                else (self._peer(a.stage + 1), "B", self._tag("B", a.stage + 1, a.mb))
                for a in schedule.actions[rank]
                if a.op.startswith("RECV")
            ]
            self.link = _Link(mesh, axis, expected)
        self.rest_params = tree.unflatten(self.rest_def, self.rest)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.deferred: dict[tuple[int, int], Any] = {}
        self.losses: list[torch.Tensor] = []
        self.rest_grads = [_Sum() for _ in self.rest]
        # a plain stacked leaf's gradient is summed in place into its stacked buffer; a sharded
        # one per layer, stacked at the end
        self.stacked = [
            None if isinstance(x, ShardedTensor) else torch.empty_like(x) for x in self.block_like
        ]
        self.filled: set[tuple[int, int]] = set()
        self.layer_grads = [[_Sum() for _ in layer] for layer in self.layers]
        self.one_layer: dict[int, PyTree] = {}

    # --- the step ------------------------------------------------------------------------------
    def run(self) -> tuple[torch.Tensor | None, PyTree]:
        """Run every action; this rank's summed loss (last stage only) and its gradients."""
        trace = core.innermost(Trace)
        ops: dict[str, Callable[[int, int], None]] = {
            "F": self.forward,
            "B": self.backward,
            "I": self.backward_input,
            "W": self.backward_weight,
            "SEND_F": self.send_forward,
            "RECV_F": self.recv_forward,
            "SEND_B": self.send_backward,
            "RECV_B": self.recv_backward,
        }
        for a in self.schedule.actions[self.rank]:
            start = time.perf_counter()
            ops[a.op](a.stage, a.mb)
            if trace is not None:
                trace.events.append((a, start, time.perf_counter()))
        if self.link is not None:
            self.link.finish()
        total = None
        if self.losses:
            total = self.losses[0]
            for x in self.losses[1:]:
                total = total + x
        return total, self._grads()

    def _grads(self) -> PyTree:
        rest = [_grad_or_zeros(g.value, x) for x, g in zip(self.rest, self.rest_grads)]
        blocks = []
        for k, like in enumerate(self.block_like):
            buf = self.stacked[k]
            if buf is not None:
                for layer in range(len(self.layers)):
                    if (layer, k) not in self.filled:
                        buf[layer].zero_()
                blocks.append(buf)
                continue
            per_layer = [
                _grad_or_zeros(g[k].value, layer[k])
                for layer, g in zip(self.layers, self.layer_grads)
            ]
            blocks.append(torch.stack(per_layer) if per_layer else torch.zeros_like(like))
        params = tree.unflatten(self.rest_def, rest)
        return {**params, "blocks": tree.unflatten(self.blocks_def, blocks)}

    # --- compute ---------------------------------------------------------------------------------
    def _weights(self, s: int) -> list[torch.Tensor]:
        """Stage ``s``'s differentiable leaves: the shared parameters, then its layers' leaves."""
        start, stop = self.stage_layers[s]
        ws = [x for x in self.rest if x.requires_grad]
        return ws + [x for layer in self.layers[start:stop] for x in layer if x.requires_grad]

    def _accumulate(self, s: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        start, stop = self.stage_layers[s]
        slots: list[tuple[int, int]] = [(-1, i) for i, x in enumerate(self.rest) if x.requires_grad]
        for layer in range(start, stop):
            slots += [(layer, k) for k, x in enumerate(self.layers[layer]) if x.requires_grad]
        for (layer, k), g in zip(slots, grads):
            if g is None:
                continue
            buf = self.stacked[k] if layer >= 0 else None
            if layer < 0:
                self.rest_grads[k].add(g)
            elif buf is None or isinstance(g, ShardedTensor):
                self.layer_grads[layer][k].add(g)
            elif (layer, k) in self.filled:
                buf[layer].add_(g)
            else:
                buf[layer].copy_(g)
                self.filled.add((layer, k))

    def _stacked(self, i: int) -> PyTree:
        """Local layer ``i`` as a stack of one layer, made once per step (in grad mode)."""
        if i not in self.one_layer:
            leaves = [w.unsqueeze(0) for w in self.layers[i]]
            self.one_layer[i] = tree.unflatten(self.blocks_def, leaves)
        return self.one_layer[i]

    def forward(self, s: int, j: int) -> None:
        batch = self.microbatches[j]
        with torch.enable_grad():
            if s == 0:
                h = self.loss.pre(self.rest_params, batch)
            else:
                if self.schedule.rank_of(s - 1) == self.rank:
                    x = _input_leaf(self.outputs[s - 1, j])
                else:
                    x = self.received.pop(("F", s, j))
                self.inputs[s, j] = x
                h = x
            start, stop = self.stage_layers[s]
            for i in range(start, stop):
                h = core.scan_layers(self.loss.block, h, self._stacked(i))
            if s == self.last:
                loss = self.loss.post(self.rest_params, h, batch)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"the loss function must return a scalar tensor, got {loss!r}")
                self.losses.append(loss.detach())
                out = loss * self.scale if self.scale != 1.0 else loss
            else:
                out = h
        self.outputs[s, j] = out

    def _output_grad(self, s: int, j: int) -> torch.Tensor | None:
        if s == self.last:
            return None
        if self.schedule.rank_of(s + 1) == self.rank:
            return self.input_grads.pop((s + 1, j))
        return self.received.pop(("B", s, j))

    def backward(self, s: int, j: int) -> None:
        out, g = self.outputs.pop((s, j)), self._output_grad(s, j)
        x = self.inputs.pop((s, j), None)
        weights = self._weights(s)
        targets = weights if x is None else [x, *weights]
        grads = torch.autograd.grad(out, targets, g, allow_unused=True)
        if x is not None:
            self.input_grads[s, j] = _grad_or_zeros(grads[0], x)
            grads = grads[1:]
        self._accumulate(s, grads)

    def backward_input(self, s: int, j: int) -> None:
        out, g = self.outputs.pop((s, j)), self._output_grad(s, j)
        x = self.inputs.pop((s, j), None)
        if x is None:  # the first stage: nothing waits for its input gradient
            self.deferred[s, j] = (out, g)
            return
        groups = _meeting_groups(out, x, self._weights(s))
        handles = []
        for group in groups:
            for node in group.meets:

                def keep(grads: tuple[Any, ...], group: _Group = group, node: Node = node) -> None:
                    group.grads[node] = tuple(grads)

                handles.append(node.register_prehook(keep))
        try:
            (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        self.input_grads[s, j] = _grad_or_zeros(gx, x)
        self.deferred[s, j] = groups

    def backward_weight(self, s: int, j: int) -> None:
        deferred = self.deferred.pop((s, j))
        weights = self._weights(s)
        if isinstance(deferred, tuple):
            out, g = deferred
            self._accumulate(s, torch.autograd.grad(out, weights, g, allow_unused=True))
            return
        grads: list[torch.Tensor | None] = [None] * len(weights)
        for group in deferred:
            edges, seeds = [], []
            for node, gs in group.grads.items():
                for k, gk in enumerate(gs):
                    if gk is not None:
                        edges.append(GradientEdge(node, k))
                        seeds.append(gk)
            if not edges:
                continue
            # a meeting point downstream of another would also receive the other's gradient:
            # hand each exactly what it received in the input pass
            handles = [
                node.register_prehook(lambda _, saved=gs: saved) for node, gs in group.grads.items()
            ]
            order = sorted(group.weights)
            try:
                got = torch.autograd.grad(
                    edges, [get_gradient_edge(weights[i]) for i in order], seeds, allow_unused=True
                )
            finally:
                for h in handles:
                    h.remove()
            for i, gi in zip(order, got):
                grads[i] = gi
        self._accumulate(s, tuple(grads))

    # --- transfers -------------------------------------------------------------------------------
    def _tag(self, direction: str, stage: int, j: int) -> int:
        # tags 0 and 1 are the descriptors; then one per (sending stage, microbatch, direction)
        return 2 + 2 * (stage * self.schedule.microbatches + j) + (direction == "B")

    def _peer(self, stage: int) -> int:
        return self.schedule.rank_of(stage)

    def send_forward(self, s: int, j: int) -> None:
        assert self.link is not None
        self.link.send(self.outputs[s, j], self._peer(s + 1), "F", self._tag("F", s, j))

    def recv_forward(self, s: int, j: int) -> None:
        assert self.link is not None
        x = self.link.recv(self._peer(s - 1), "F", self._tag("F", s - 1, j))
        self.received["F", s, j] = x.requires_grad_(x.is_floating_point())

    def send_backward(self, s: int, j: int) -> None:
        assert self.link is not None
        grad = self.input_grads.pop((s, j))
        self.link.send(grad, self._peer(s - 1), "B", self._tag("B", s, j))

    def recv_backward(self, s: int, j: int) -> None:
        assert self.link is not None
        x = self.link.recv(self._peer(s + 1), "B", self._tag("B", s + 1, j))
        self.received["B", s, j] = x


class _Sum:
    """A running sum of gradients: the first as given, then a buffer of its own, added in place."""

    __slots__ = ("owned", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.owned = False

    def add(self, g: torch.Tensor) -> None:
        if self.value is None:
            self.value = g
        elif self.owned and not isinstance(self.value, ShardedTensor):
            self.value.add_(g)
        else:
            self.value = self.value + g
            self.owned = True


def _leaf(x: torch.Tensor) -> torch.Tensor:
    # a fresh leaf sharing the caller's storage: the caller's tensors are left untouched
    return x.detach().requires_grad_(x.is_floating_point())


def _input_leaf(out: torch.Tensor) -> torch.Tensor:
    return out.detach().requires_grad_(out.is_floating_point())


def _grad_or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
