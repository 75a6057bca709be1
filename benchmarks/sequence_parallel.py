"""Sequence parallelism on gloo: Megatron, Ulysses, ring and zigzag against sequence length.

In one gloo world of P processes (P = 2 and 4) the tiny GPT (context stretched to the longest
length) trains one sequence per step, the sequence split over the mesh's single axis ``sp``:

- ``megatron``: ``cf.shard(step, mesh, plan, sequence_parallel=True)``, the model's ``tp_plan``
  on the ``sp`` axis: tensor parallelism with the sequence split between the matmuls;
- ``ulysses``, ``ring``, ``zigzag``: ``cf.shard(step, mesh, sequence_parallel=MODE)``, the
  parameters replicated and the whole model on the local part of the sequence.

The modes run in the same processes, interleaved step by step (the order rotates every step;
every rank starts each step at a barrier). Printed per length and mode, from rank 0: the median
step time, its ratio to Megatron's, and the bytes each rank sends per step by collective, from
the ledger of one more step. On a 2-core CPU machine the times are informative only (4 ranks
share two cores); the bytes are exact.

    python benchmarks/sequence_parallel.py [--lengths 1024,2048,4096,8192] [--procs 2,4]
                                           [--modes megatron,ulysses,ring,zigzag] [--steps 2]
    colfunc bench sequence_parallel
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import colfunc as cf
from colfunc import optim
from colfunc.core import P
from colfunc.models import gpt

MODES = ("megatron", "ulysses", "ring", "zigzag")


def _plan_on_sp() -> dict[str, P]:
    return {k: P(*("sp" if a == "tp" else a for a in spec)) for k, spec in gpt.tp_plan.items()}


def _job(mesh: Any, lengths: list[int], modes: list[str], steps: int) -> dict[str, Any]:
    cfg = gpt.Config(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=max(lengths))
    params = gpt.init(cfg, seed=0)
    base = cf.train_step(gpt.loss(cfg), optim.adamw(1e-4))
    steps_by_mode = {}
    for mode in modes:
        if mode == "megatron":
            s = cf.shard(base, mesh, _plan_on_sp(), batch_axis=None, sequence_parallel=True)
        else:
            s = cf.shard(base, mesh, batch_axis=None, sequence_parallel=mode)
        steps_by_mode[mode] = s
    out: dict[str, Any] = {}
    for T in lengths:
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, 256, (1, T), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        states = {m: s.init(params) for m, s in steps_by_mode.items()}
        for m, s in steps_by_mode.items():  # warm-up, and the bytes of one step
            with cf.sharding.recording(mesh) as led:
                led.reset()
                states[m], _ = s(states[m], batch)
            out[(T, m, "bytes")] = led.as_dict()
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(steps):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for m in order:
                dist.barrier()
                t0 = time.perf_counter()
                states[m], metrics = steps_by_mode[m](states[m], batch)
                float(metrics["loss"])
                times[m].append(time.perf_counter() - t0)
        for m in modes:
            out[(T, m, "time")] = statistics.median(times[m])
    return out


def _fmt_bytes(sent: dict) -> str:
    total = sum(sent.values())
    parts = {}
    for (op, _axis), n in sent.items():
        parts[op] = parts.get(op, 0) + n
    detail = ", ".join(f"{op} {n / 2**20:.2f}" for op, n in sorted(parts.items()))
    return f"{total / 2**20:8.2f} MiB ({detail})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    procs = [int(x) for x in args.procs.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode {unknown[0]!r}; the modes are {','.join(MODES)}")
    for n in procs:
        for T in lengths:
            if T % (2 * n):
                ap.error(f"length {T} is not divisible by 2 x {n} (zigzag's chunks)")
        job = functools.partial(_job, lengths=lengths, modes=modes, steps=args.steps)
        res = cf.launch(job, mesh={"sp": n}, backend="gloo", timeout=1800)[0]
        print(f"\n== {n} gloo ranks, tiny GPT, batch 1 ==")
        print(
            f"{'length':>7} {'mode':>9} {'step s':>8} {'/megatron':>9}  bytes sent per rank per step"
        )
        for T in lengths:
            ref = res.get((T, "megatron", "time"))
            for m in modes:
                t = res[(T, m, "time")]
                ratio = f"{t / ref:9.2f}" if ref else f"{'':>9}"
                print(f"{T:>7} {m:>9} {t:8.3f} {ratio}  {_fmt_bytes(res[(T, m, 'bytes')])}")


if __name__ == "__main__":
    main()
