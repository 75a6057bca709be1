"""Tensor parallelism on gloo: 1D (Megatron) against 2D, 2.5D and 3D at 4 and 8 ranks.

In one gloo world of P processes the GPT trains on one batch per step under each mode, every
mode on a mesh of its own built over the same processes (``cf.Mesh(axes, rank, world=...)``):

- P = 4: ``1d`` (tp=4), ``2d`` (2 x 2), ``2.5d`` (depth 1, 2 x 2);
- P = 8: ``1d`` (tp=8), ``2.5d`` (depth 2, 2 x 2), ``3d`` (2 x 2 x 2).

A mode whose sizes the model's heads do not divide (1D at 8 ranks for 4 heads, or at 4 and 8 for
the small config's 6) is listed as not applicable, and the ratios are then to the first mode that
runs. The matmul column for 3D also holds the vocabulary head's all-gather and the embedding's
reduce-scatter, which share the ops; per layer the ledger equals the formula exactly
(``tests/test_tensor_grid.py``).

The modes run interleaved step by step (the order rotates every step; every rank starts each
step at a barrier). Printed per config and mode, from rank 0: the median step time and its
ratio to 1D's, the bytes each rank sends per step (from the ledger of one more step), the
bytes of the mode's matmuls against the papers' closed form for them (they must be at most
it), and the parameter bytes a rank holds. On a 2-core CPU machine the times are informative
only (4 or 8 ranks share two cores); the bytes are exact.

    python benchmarks/tensor_parallel.py [--procs 4,8] [--configs tiny,small] [--steps 2]
                                         [--batch 8] [--seq 128]
    colfunc bench tensor_parallel
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import colfunc as cf
from colfunc import optim
from colfunc.models import gpt
from colfunc.nn.plans import grid_axes

MODES = {4: [("1d", None), ("2d", None), ("2.5d", 1)], 8: [("1d", None), ("2.5d", 2), ("3d", None)]}
MATMUL_OPS = {"2d": ("broadcast", "reduce"), "2.5d": ("broadcast", "reduce")}


def _matmul_formula(cfg: gpt.Config, mode: str, P: int, depth: int | None, M: int) -> float:
    """Bytes one rank sends per step in the mode's matmuls (see tests/test_tensor_grid.py)."""
    D, Fw, s = cfg.d_model, cfg.d_ff, 4
    assert Fw is not None
    column, row = [(D, D)] * 3 + [(D, Fw)], [(D, D), (Fw, D)]
    total = 0.0
    if mode in ("2d", "2.5d"):
        d = depth or 1
        q = math.isqrt(P // d)
        for K, N in column + row:
            total += 3 * (q - 1) * M * K * s / (d * q * q) + 3 * (q - 1) * K * N * s / (q * q)
    elif mode == "3d":
        q = round(P ** (1 / 3))
        c = (q - 1) * s / q**3
        for K, N in column + row:
            total += 3 * M * K * c + 2 * M * N * c + 3 * K * N * c
    return total * cfg.n_layer


def _job(mesh: Any, configs: list[str], steps: int, batch: int, seq: int) -> dict[Any, Any]:
    P = mesh.size
    meshes = {}
    for mode, depth in MODES[P]:
        axes = {"dp": 1, **grid_axes(mode, P, depth)}
        mesh.world.add_layout(axes)  # this layout's process groups, on every rank alike
        meshes[mode] = cf.Mesh(axes, mesh.rank, world=mesh.world)
    out: dict[Any, Any] = {}
    for name in configs:
        cfg = getattr(gpt.Config, name)()
        params = gpt.init(cfg, seed=0)
        base = cf.train_step(gpt.loss(cfg), optim.adamw(1e-4))
        steps_by_mode = {}
        for m in meshes:
            try:
                steps_by_mode[m] = cf.shard(base, meshes[m], gpt.tp_plans[m], tensor_mode=m)
            except ValueError as e:  # e.g. 6 heads on 4 or 8 ranks of 1D
                out[(name, m, "skip")] = str(e).split(";")[0]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        data = {"input_ids": ids, "labels": ids}
        states = {m: s.init(params) for m, s in steps_by_mode.items()}
        for m, s in steps_by_mode.items():  # warm-up, and the bytes of one step
            with cf.sharding.recording(meshes[m]) as led:
                led.reset()
                states[m], _ = s(states[m], data)
            out[(name, m, "bytes")] = led.as_dict()
            out[(name, m, "params")] = sum(
                (x.to_local() if hasattr(x, "to_local") else x).numel() * 4
                for x in cf.tree.leaves(states[m].params)
            )
        modes = list(steps_by_mode)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(steps):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for m in order:
                dist.barrier()
                t0 = time.perf_counter()
                states[m], metrics = steps_by_mode[m](states[m], data)
                float(metrics["loss"])
                times[m].append(time.perf_counter() - t0)
        for m in modes:
            out[(name, m, "time")] = statistics.median(times[m])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="4,8")
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    procs = [int(x) for x in args.procs.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    bad = [p for p in procs if p not in MODES]
    if bad:
        ap.error(f"--procs takes 4 and 8 (the sizes every mode fits), got {bad[0]}")
    for c in configs:
        if c not in ("tiny", "small"):
            ap.error(f"unknown config {c!r}; use tiny or small")
    if args.batch % 4:
        ap.error(f"--batch must be a multiple of 4 (3D and 2.5D split it 4 ways), got {args.batch}")
    for P in procs:
        job = functools.partial(
            _job, configs=configs, steps=args.steps, batch=args.batch, seq=args.seq
        )
        res = cf.launch(job, mesh={"w": P}, backend="gloo", timeout=3600)[0]
        print(f"\n== {P} gloo ranks, GPT, batch {args.batch} x {args.seq} ==")
        print(
            f"{'config':>6} {'mode':>5} {'step s':>8} {'ratio':>6} {'sent MiB':>9} "
            f"{'matmul MiB':>10} {'formula':>8} {'params MiB':>10}"
        )
        for name in configs:
            cfg = getattr(gpt.Config, name)()
            ran = [m for m, _ in MODES[P] if (name, m, "time") in res]
            ref = res[(name, ran[0], "time")]
            if ran[0] != "1d":
                print(f"{name:>6} times relative to {ran[0]} (1d does not fit)")
            for mode, depth in MODES[P]:
                if (name, mode, "skip") in res:
                    print(f"{name:>6} {mode:>5}  n/a: {res[(name, mode, 'skip')]}")
                    continue
                sent = res[(name, mode, "bytes")]
                total = sum(sent.values())
                ops = MATMUL_OPS.get(mode, ("all_gather", "reduce_scatter"))
                matmul = sum(n for (op, axis), n in sent.items() if op in ops and axis != "dp")
                formula = _matmul_formula(cfg, mode, P, depth, args.batch * args.seq)
                shown = f"{formula / 2**20:8.2f}" if mode != "1d" else f"{'':>8}"
                mm = f"{matmul / 2**20:10.2f}" if mode != "1d" else f"{'':>10}"
                t = res[(name, mode, "time")]
                print(
                    f"{name:>6} {mode:>5} {t:8.3f} {t / ref:6.2f} {total / 2**20:9.2f} {mm} "
                    f"{shown} {res[(name, mode, 'params')] / 2**20:10.2f}"
                )


if __name__ == "__main__":
    main()
