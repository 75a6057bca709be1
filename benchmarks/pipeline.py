"""Pipeline parallelism: ``cf.pipeline`` against ``torch.distributed.pipelining`` on gloo.

One gloo world of ``--pp`` processes runs, on the same GPT split into the same stages (the same
layers per stage, ``pre`` on the first, ``post`` and the loss on the last) and the same
microbatches, our forward-backward step and torch's schedule step (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with two stages per rank), timed interleaved: each
repetition runs every (schedule, implementation) pair once, in a rotating order, each after a
barrier. Torch's stages wrap the same pure model functions in ``nn.Module``\\ s, so both sides do
the same arithmetic; the loss of the first step is checked equal. Prints rank 0's median times
and the ratio ours/torch (goal: at most 1.0). Our zero-bubble schedule (ZB-H1) is timed against
torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB1P, the same schedule).
The machine may be shared: read the ratios, not the absolute times.

    python benchmarks/pipeline.py [--pp 2] [--microbatches 8] [--reps 8] [--width 256]
    colfunc bench pipeline
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

import colfunc as cf
from colfunc import core, models, optim, tree
from colfunc.sharding import Mesh, comm
from colfunc.transforms.pipeline import PipelineLayout

gpt = models.gpt
SCHEDULES = {  # ours -> (torch's schedule class, stages per rank)
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved": (ScheduleInterleaved1F1B, 2),
    "zero_bubble": (ScheduleInterleavedZeroBubble, 1),  # ZB1P: ZB-H1 with one stage per rank
}


class StageModule(nn.Module):
    """Stage ``s`` of ``stages``: the layers ``layers`` of the stacked blocks, with ``pre`` first
    on stage 0; the last stage returns the final hidden state, which ``loss`` turns into the
    loss with ``post`` (torch's schedules call it with the stage output and the target). Each
    layer's weights are parameters of their own, as in our runtime (and as torch's zero-bubble
    weight pass needs)."""

    def __init__(self, params: dict, layers: range, s: int, stages: int, loss: core.Layered):
        super().__init__()
        self.first, self.last, self.loss_fn = s == 0, s == stages - 1, loss
        rest = {k: v for k, v in params.items() if k != "blocks"}
        flat, self.rest_def = tree.flatten_with_paths(rest)
        bflat, self.blocks_def = tree.flatten_with_paths(params["blocks"])
        self.rest = nn.ParameterList([nn.Parameter(x.clone()) for _, x in flat])
        self.layers = nn.ModuleList(
            nn.ParameterList([nn.Parameter(x[i].clone()) for _, x in bflat]) for i in layers
        )

    def shared(self) -> Any:
        return tree.unflatten(self.rest_def, list(self.rest))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.loss_fn.pre(self.shared(), {"input_ids": x}) if self.first else x
        for layer in self.layers:
            h = self.loss_fn.block(tree.unflatten(self.blocks_def, list(layer)), h)
        return h

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn.post(self.shared(), h, {"labels": labels})


def torch_step(mesh: Mesh, params: dict, cfg: gpt.Config, name: str, m: int) -> Any:
    """A closure running torch's schedule for one batch; returns the loss on the last rank."""
    cls, v = SCHEDULES[name]
    p, r = mesh.axis_size("pp"), mesh.axis_index("pp")
    loss = gpt.loss(cfg)
    n = p * v
    layout = PipelineLayout(cfg.n_layer, p, v, "pp", None)
    group = mesh.world.process_group(mesh.group_ranks("pp"))
    mods = [StageModule(params, range(*layout.stages[s]), s, n, loss) for s in range(r, n, p)]
    stages = [
        PipelineStage(mod, s, n, torch.device("cpu"), group=group)
        for mod, s in zip(mods, range(r, n, p))
    ]
    last = mods[-1] if mods[-1].last else None

    def loss_fn(h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # every rank passes one (a schedule without it runs forward only); the last calls it
        assert last is not None
        return last.loss(h, labels)

    multi = cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
    schedule = cls(stages if multi else stages[0], m, loss_fn=loss_fn)

    def run(batch: dict) -> torch.Tensor | None:
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if r == 0:
            schedule.step(batch["input_ids"])
        elif last is not None:
            schedule.step(target=batch["labels"], losses=losses)
        else:
            schedule.step()
        return torch.stack(losses).mean() if losses else None

    return run


def ours_step(mesh: Mesh, params: dict, cfg: gpt.Config, name: str, m: int) -> Any:
    v = SCHEDULES[name][1]
    step = cf.pipeline(
        cf.train_step(gpt.loss(cfg), optim.sgd(0.01)), mesh.axis_size("pp"), m, name, v
    )
    state = step.init(params)

    def run(batch: dict) -> torch.Tensor:
        return step.forward_backward(state.params, batch, state.extra)[0]

    return run


def bench(mesh: Mesh, args: argparse.Namespace) -> dict:
    cfg = gpt.Config(
        vocab_size=256, n_layer=args.layers, n_head=4, d_model=args.width, max_seq_len=args.seq
    )
    params = gpt.init(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.microbatches * args.rows, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    runs = {}
    for name in args.schedules:
        runs[name, "ours"] = ours_step(mesh, params, cfg, name, args.microbatches)
        runs[name, "torch"] = torch_step(mesh, params, cfg, name, args.microbatches)
    keys = list(runs)
    losses = {}
    times: dict[Any, list[float]] = {k: [] for k in keys}
    for rep in range(args.reps + 1):  # the first repetition warms up
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for key in order:
            comm.all_reduce(torch.zeros(1), "pp", mesh=mesh)  # start together
            t = time.perf_counter()
            out = runs[key](batch)
            comm.all_reduce(torch.zeros(1), "pp", mesh=mesh)  # end when the last rank ends
            if rep:
                times[key].append(time.perf_counter() - t)
            elif out is not None:
                losses[key] = float(out.detach())
    return {"times": {k: statistics.median(ts) for k, ts in times.items()}, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved,zero_bubble")
    args = ap.parse_args(argv)
    args.schedules = args.schedules.split(",")
    t = time.time()
    results = cf.launch(
        functools.partial(bench, args=args), mesh={"pp": args.pp}, backend="gloo", timeout=600
    )
    times, losses = results[0]["times"], results[-1]["losses"]
    for name in args.schedules:
        a, b = losses[name, "ours"], losses[name, "torch"]
        if abs(a - b) > 1e-4 * abs(b):
            raise SystemExit(f"{name}: losses differ: ours {a} vs torch {b}")
    print(
        f"GPT d_model={args.width}, {args.layers} layers, seq {args.seq}, {args.pp} gloo processes, "
        f"{args.microbatches} microbatches of {args.rows} rows; medians of {args.reps} interleaved "
        f"repetitions ({time.time() - t:.0f} s)"
    )
    print(f"{'schedule':<13} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>11}")
    for name in args.schedules:
        ours, theirs = times[name, "ours"] * 1e3, times[name, "torch"] * 1e3
        print(f"{name:<13} {ours:9.1f} {theirs:9.1f} {ours / theirs:11.2f}")


if __name__ == "__main__":
    main()
