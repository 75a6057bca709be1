"""Running one rank's pipeline schedule for one step: forwards and backwards per microbatch.

Each microbatch's forward on a stage keeps its autograd graph until that stage's backward, which
starts from the gradient received for the stage's output (the last stage starts from its loss,
scaled by ``loss_scale / microbatches`` so that the summed gradients are those of the mean loss).
Every layer gets its own parameter leaves, run through :func:`colfunc.scan_layers` one layer at a
time, so remat and ZeRO-3 still see each layer, and so a layer's weight gradients hang off the
graph independently of the others (what the weight pass below relies on).

Zero bubble splits a backward into an input pass and a deferred weight pass (:mod:`.split`).
A first stage has no input gradient to hurry: its ``I`` does nothing and its ``W`` runs the
whole backward. Transfers go through :class:`.link.Link`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from colfunc import core, tree
from colfunc.sharding import Mesh, ShardedTensor, comm
from colfunc.transforms.local import as_full
from colfunc.transforms.pipeline.link import Link
from colfunc.transforms.pipeline.schedules import Action, Schedule
from colfunc.transforms.pipeline.split import input_pass, weight_pass

__all__ = ["Runner", "Trace"]

PyTree = Any


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
        stage_span: dict[int, tuple[int, int]] | None = None,
        trainable: Callable[[str], bool] | None = None,
    ) -> None:
        self.schedule, self.rank, self.loss = schedule, rank, loss
        # each stage's layers in the whole model, for a loss's per-layer xs
        self.stage_span = stage_span if stage_span is not None else stage_layers
        self.microbatches = microbatches
        self.last = schedule.stages - 1
        self.scale = core.loss_scale() / len(microbatches)
        # which leaves train (None: every floating one); the others get no gradient at all
        self.trainable = trainable
        trains = (lambda path: True) if trainable is None else trainable
        rest = {k: v for k, v in params.items() if k != "blocks"}
        flat, self.rest_def = tree.flatten_with_paths(rest)
        self.rest_paths = [path for path, _ in flat]
        self.rest = [_leaf(x, trains(path)) for path, x in flat]
        bflat, self.blocks_def = tree.flatten_with_paths(params["blocks"])
        self.block_paths = [f"blocks.{path}" for path, _ in bflat]
        self.block_like = [x for _, x in bflat]
        self.block_trains = [trains(path) for path in self.block_paths]
        per_leaf = [x.detach().unbind(0) for x in self.block_like]
        n_local = len(per_leaf[0]) if per_leaf else 0
        # layers[l][k]: leaf k of local layer l
        self.layers = [
            [_leaf(xs[i], t) for xs, t in zip(per_leaf, self.block_trains)] for i in range(n_local)
        ]
        self.stage_layers = stage_layers
        self.link: Link | None = None
        self.mesh, self.axis = mesh, axis
        leaves = [*self.rest, *self.block_like]
        self.device = leaves[0].device if leaves else torch.device("cpu")
        if mesh is not None and schedule.ranks > 1:
            expected = [
                (self._peer(a.stage - 1), "F", self._tag("F", a.stage - 1, a.mb), a.stage - 1)
                if a.op == "RECV_F"
                else (self._peer(a.stage + 1), "B", self._tag("B", a.stage + 1, a.mb), a.stage + 1)
                for a in schedule.actions[rank]
                if a.op.startswith("RECV")
            ]
            self.link = Link(mesh, axis, expected)
        self.rest_params = tree.unflatten(self.rest_def, self.rest)
        # a stage's input and output are carries (pytrees); the gradients that travel back are
        # lists, one per carry leaf that needs a gradient, in leaf order
        self.inputs: dict[tuple[int, int], PyTree] = {}
        self.outputs: dict[tuple[int, int], PyTree] = {}
        self.received: dict[tuple[str, int, int], Any] = {}
        self.input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.deferred: dict[tuple[int, int], Any] = {}
        self.losses: list[torch.Tensor] = []
        # (stage, microbatch) -> what its forward pass reported (core.sow), by name
        self.sown: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        self.rest_grads = [_Sum() for _ in self.rest]
        # a plain stacked leaf's gradient is summed in place into its stacked buffer; a sharded
        # one per layer, stacked at the end
        self.stacked = [
            None if isinstance(x, ShardedTensor) or not t else torch.empty_like(x)
            for x, t in zip(self.block_like, self.block_trains)
        ]
        self.filled: set[tuple[int, int]] = set()
        self.layer_grads = [[_Sum() for _ in layer] for layer in self.layers]
        self.one_layer: dict[int, PyTree] = {}
        # with no frame intercepting scan_layers (remat, ZeRO-3) it is the plain loop: call the
        # block on each layer's leaves directly, sparing the copy that unbind's gradient makes
        self.direct = not any(isinstance(f, core.ScanInterceptor) for f in core.frames())
        self.grad = any(a.op in ("B", "I", "W") for acts in schedule.actions for a in acts)
        self.layer_trees = [tree.unflatten(self.blocks_def, layer) for layer in self.layers]

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
        self._report()
        total = None
        if self.losses:
            total = self.losses[0]
            for x in self.losses[1:]:
                total = total + x
        return total, self._grads()

    def _grads(self) -> PyTree:
        """The summed gradients, shaped like the parameters; with ``trainable``, of the
        trainable leaves only (a frozen leaf gets no gradient, not even zeros)."""
        every = self.trainable is None
        rest = {
            path: _grad_or_zeros(g.value, x)
            for path, x, g in zip(self.rest_paths, self.rest, self.rest_grads)
            if every or x.requires_grad
        }
        blocks = {}
        for k, like in enumerate(self.block_like):
            if not (every or (self.block_trains[k] and like.is_floating_point())):
                continue
            buf = self.stacked[k]
            if buf is not None:
                for layer in range(len(self.layers)):
                    if (layer, k) not in self.filled:
                        buf[layer].zero_()
                blocks[self.block_paths[k]] = buf
                continue
            per_layer = [
                _grad_or_zeros(g[k].value, layer[k])
                for layer, g in zip(self.layers, self.layer_grads)
            ]
            blocks[self.block_paths[k]] = (
                torch.stack(per_layer) if per_layer else torch.zeros_like(like)
            )
        if every:
            params = tree.unflatten(self.rest_def, list(rest.values()))
            return {**params, "blocks": tree.unflatten(self.blocks_def, list(blocks.values()))}
        got = {**rest, **blocks}
        whole = {
            **tree.unflatten(self.rest_def, self.rest),
            "blocks": tree.unflatten(self.blocks_def, self.block_like),
        }
        return tree.map_with_path(lambda p, _: got[p], tree.subset(whole, got.__contains__))

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

    def _layer_xs(self, s: int, batch: PyTree) -> list[PyTree] | None:
        """Stage ``s``'s rows of the loss's per-layer ``xs`` (None without xs)."""
        if self.loss.xs is None:
            return None
        a, b = self.stage_span[s]
        flat, treedef = tree.flatten_with_paths(self.loss.xs(self.rest_params, batch))
        return [tree.unflatten(treedef, [x[i] for _, x in flat]) for i in range(a, b)]

    def forward(self, s: int, j: int) -> None:
        if core.innermost(core.Sown) is None:
            self._forward(s, j)
            return
        with core.context(core.Sown()) as sown:  # (what the model reports: see _report)
            self._forward(s, j)
        self.sown[s, j] = sown.values

    def _report(self) -> None:
        """What the model reported (:func:`colfunc.core.sow`: sums, such as each expert's count
        of choices) to the step's frame as one device reports it: each stage's reports summed
        over the microbatches, and every stage's, in model order, on every rank of the axis."""
        outer = core.innermost(core.Sown)
        if outer is None:
            return
        mine: dict[str, dict[int, list[torch.Tensor]]] = {}
        for s in sorted({s for s, _ in self.sown}):
            runs = [self.sown.pop((s, j)) for j in range(len(self.microbatches))]
            for name in runs[0]:  # (made whole first: what another axis splits, the sum of it)
                summed = [as_full(sum(vs[1:], vs[0])) for vs in zip(*(r[name] for r in runs))]
                mine.setdefault(name, {})[s] = summed
        whole = (
            _every_stages(mine, self.mesh, self.axis, self.device)
            if self.mesh is not None and self.schedule.ranks > 1
            else {name: [v for s in sorted(by) for v in by[s]] for name, by in mine.items()}
        )
        for name, values in whole.items():
            outer.values.setdefault(name, []).extend(values)

    def _forward(self, s: int, j: int) -> None:
        batch = self.microbatches[j]
        with torch.enable_grad() if self.grad else torch.no_grad():
            if s == 0:
                h = self.loss.pre(self.rest_params, batch)
                if self.loss.xs is not None:  # the ys so far travel with the carry
                    h = {"carry": h, "ys": []}
            else:
                if self.schedule.rank_of(s - 1) == self.rank:
                    prev = self.outputs[s - 1, j] if self.grad else self.outputs.pop((s - 1, j))
                    x = tree.map(_input_leaf, prev)
                else:
                    x = self.received.pop(("F", s, j))
                if self.grad:
                    self.inputs[s, j] = x
                h = x
            start, stop = self.stage_layers[s]
            rows = self._layer_xs(s, batch)
            if rows is None:
                for i in range(start, stop):
                    if self.direct:
                        h = self.loss.block(self.layer_trees[i], h)
                    else:
                        h = core.scan_layers(self.loss.block, h, self._stacked(i))
            else:
                carry, ys = h["carry"], list(h["ys"])
                for i, x in zip(range(start, stop), rows):
                    if self.direct:
                        carry, y = self.loss.block(self.layer_trees[i], carry, x)  # type: ignore[call-arg]
                    else:
                        one = tree.map(lambda t: t[None], x)
                        carry, y1 = core.scan_layers(
                            self.loss.block, carry, self._stacked(i), xs=one
                        )
                        y = None if y1 is None else tree.map(lambda t: t[0], y1)
                    ys.append(y)
                h = {"carry": carry, "ys": ys}
            if s == self.last:
                if rows is None:
                    loss = self.loss.post(self.rest_params, h, batch)
                else:
                    stacked = _stack_rows(h["ys"])
                    loss = self.loss.post(self.rest_params, h["carry"], batch, stacked)  # type: ignore[call-arg]
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"the loss function must return a scalar tensor, got {loss!r}")
                self.losses.append(loss.detach())
                if not self.grad:
                    return
                out = loss * self.scale if self.scale != 1.0 else loss
            else:
                out = h
        self.outputs[s, j] = out

    def _seeds(self, s: int, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Stage ``s``'s outputs on microbatch ``j`` that need gradients, and those gradients
        (None for the last stage, whose output is the loss)."""
        out = self.outputs.pop((s, j))
        if s == self.last:
            return [out], None
        outs = _needing_grad(out)
        if self.schedule.rank_of(s + 1) == self.rank:
            gs = self.input_grads.pop((s + 1, j))
        else:
            gs = list(self.received.pop(("B", s, j)))
        return outs, gs

    def _inputs(self, s: int, j: int) -> list[torch.Tensor] | None:
        x = self.inputs.pop((s, j), None)
        return None if x is None else _needing_grad(x)

    def backward(self, s: int, j: int) -> None:
        outs, gs = self._seeds(s, j)
        xs = self._inputs(s, j)
        weights = self._weights(s)
        targets = weights if xs is None else [*xs, *weights]
        grads = torch.autograd.grad(outs, targets, gs, allow_unused=True)
        if xs is not None:
            self.input_grads[s, j] = [_grad_or_zeros(g, x) for g, x in zip(grads, xs)]
            grads = grads[len(xs) :]
        self._accumulate(s, grads)

    def backward_input(self, s: int, j: int) -> None:
        outs, gs = self._seeds(s, j)
        xs = self._inputs(s, j)
        if xs is None:  # the first stage: nothing waits for its input gradient
            self.deferred[s, j] = (outs, gs)
            return
        gxs, groups = input_pass(outs, gs, xs, self._weights(s))
        self.input_grads[s, j] = [_grad_or_zeros(g, x) for g, x in zip(gxs, xs)]
        self.deferred[s, j] = groups

    def backward_weight(self, s: int, j: int) -> None:
        deferred = self.deferred.pop((s, j))
        weights = self._weights(s)
        if isinstance(deferred, tuple):
            outs, gs = deferred
            self._accumulate(s, torch.autograd.grad(outs, weights, gs, allow_unused=True))
        else:
            self._accumulate(s, weight_pass(deferred, weights))

    # --- transfers -------------------------------------------------------------------------------
    def _tag(self, direction: str, stage: int, j: int) -> int:
        # tags below 2 * stages are the descriptors (one per sending stage and direction); then
        # one per (sending stage, microbatch, direction)
        base = 2 * self.schedule.stages
        return base + 2 * (stage * self.schedule.microbatches + j) + (direction == "B")

    def _peer(self, stage: int) -> int:
        return self.schedule.rank_of(stage)

    def send_forward(self, s: int, j: int) -> None:
        assert self.link is not None
        out = self.outputs[s, j] if self.grad else self.outputs.pop((s, j))
        self.link.send(out, self._peer(s + 1), "F", self._tag("F", s, j), s)

    def recv_forward(self, s: int, j: int) -> None:
        assert self.link is not None
        x = self.link.recv(self._peer(s - 1), "F", self._tag("F", s - 1, j), s - 1)
        self.received["F", s, j] = x

    def send_backward(self, s: int, j: int) -> None:
        assert self.link is not None
        grad = self.input_grads.pop((s, j))
        self.link.send(grad, self._peer(s - 1), "B", self._tag("B", s, j), s)

    def recv_backward(self, s: int, j: int) -> None:
        assert self.link is not None
        x = self.link.recv(self._peer(s + 1), "B", self._tag("B", s + 1, j), s + 1)
        self.received["B", s, j] = x


def _every_stages(
    mine: dict[str, dict[int, list[torch.Tensor]]], mesh: Mesh, axis: str, device: torch.device
) -> dict[str, list[torch.Tensor]]:
    """Each name's reports of every stage (each rank's ``mine``: name -> stage -> its reports),
    in stage order, on every rank of ``axis``: what each rank reports is described to the
    others first (names, stages, counts, shapes; a rank may report nothing), then each name's
    reports summed over the axis into their places."""
    desc = [
        [name, s, len(vs), list(vs[0].shape), str(vs[0].dtype).removeprefix("torch.")]
        for name, by in sorted(mine.items())
        for s, vs in sorted(by.items())  # (each list holds a report: sow appends one)
    ]
    data = torch.tensor(list(json.dumps(desc).encode()), dtype=torch.uint8, device=device)
    sizes = comm.all_gather(torch.tensor([data.numel()], device=device), axis, 0, mesh).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    every = comm.all_gather(padded, axis, 0, mesh).view(len(sizes), -1).cpu()
    places: dict[str, dict[int, tuple[int, tuple[int, ...], str]]] = {}
    for r, size in enumerate(sizes):
        for name, s, rows, shape, dtype in json.loads(bytes(every[r, :size].tolist())):
            places.setdefault(name, {})[s] = (rows, tuple(shape), dtype)
    out: dict[str, list[torch.Tensor]] = {}
    for name, by in sorted(places.items()):
        kinds = {(shape, dtype) for _, shape, dtype in by.values()}
        if len(kinds) != 1:
            raise ValueError(
                f"pipeline: the model reports {name!r} (core.sow) with different shapes or "
                f"dtypes on different stages: {sorted(kinds)}; report one shape per name"
            )
        ((shape, dtype),) = kinds
        start, total = {}, 0
        for s in sorted(by):
            start[s], total = total, total + by[s][0]
        buf = torch.zeros((total, *shape), dtype=getattr(torch, dtype), device=device)
        for s, vs in mine.get(name, {}).items():
            buf[start[s] : start[s] + len(vs)] = torch.stack(vs)
        out[name] = list(comm.all_reduce(buf, axis, "sum", mesh).unbind(0))
    return out


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


def _leaf(x: torch.Tensor, trains: bool = True) -> torch.Tensor:
    # a fresh leaf sharing the caller's storage: the caller's tensors are left untouched
    return x.detach().requires_grad_(trains and x.is_floating_point())


def _input_leaf(out: torch.Tensor) -> torch.Tensor:
    # the next stage's input: a fresh leaf, needing a gradient where the output did
    return out.detach().requires_grad_(out.requires_grad)


def _needing_grad(carry: PyTree) -> list[torch.Tensor]:
    """The carry's leaves that need a gradient, in leaf order (what crosses back)."""
    return [x for x in tree.leaves(carry) if isinstance(x, torch.Tensor) and x.requires_grad]


def _grad_or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _stack_rows(ys: list[PyTree]) -> PyTree:
    """Per-layer outputs stacked on a new leading layer axis (None if every one is None)."""
    if all(y is None for y in ys):
        return None
    flats = [tree.flatten_with_paths(y) for y in ys]
    treedef = flats[0][1]
    leaves = [torch.stack([f[0][k][1] for f in flats]) for k in range(len(flats[0][0]))]
    return tree.unflatten(treedef, leaves)
