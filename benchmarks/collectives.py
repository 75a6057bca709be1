"""Collectives: ``colfunc.sharding.comm`` against the same raw torch.distributed call, on gloo.

For each op and size, in one gloo world of N processes, three ways of running the collective on
the same process group are timed interleaved (the order rotates every repetition), each call after
a barrier so that all ranks start together; the tables show rank 0's medians:

- ``ours``: the ``comm`` function, which returns a new tensor;
- ``raw``: the same raw call doing the same work, i.e. allocating its output the way a caller
  who wants a new tensor must (and copying the input first for the in-place all_reduce and
  broadcast). ``ours/raw`` is the overhead of our layer: goal at most 1.05 from 1 MB up;
- ``raw in place``: the raw call writing into buffers made once. ``ours/in place`` is the price
  of returning new tensors, mostly page faults on fresh memory (large buffers come straight
  from mmap).

SIZE is the bytes of the full tensor: the all_reduce / reduce_scatter / all_to_all / broadcast /
ppermute input, the all_gather output. Bandwidth is SIZE / median time. Then the threads
backend's bandwidth at the same sizes.

    python benchmarks/collectives.py [--procs 2,4] [--sizes 4K,64K,1M,16M,64M] [--reps-scale 1]
    colfunc bench collectives
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from colfunc.sharding import Mesh, comm, launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")
_RAW_SINGLE = {
    "all_gather": getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
    "reduce_scatter": getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
}


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def show_size(n: int) -> str:
    for unit, f in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= f:
            return f"{n / f:g}{unit}"
    return str(n)


def reps_for(size: int, scale: float) -> int:
    base = 40 if size <= 2**20 else 10 if size <= 16 * 2**20 else 6
    return max(3, round(base * scale))


def ours(op: str, mesh: Mesh, full: torch.Tensor) -> Callable[[], Any]:
    """Our collective ``op`` over the mesh's one axis, on ``full`` (the all_gather output size)."""
    n = mesh.size
    if op == "all_gather":
        x = full[: full.numel() // n].clone()
        return lambda: comm.all_gather(x, "x", mesh=mesh)
    if op == "ppermute":
        ring = [(k, (k + 1) % n) for k in range(n)]
        return lambda: comm.ppermute(full, "x", ring, mesh=mesh)
    if op == "all_to_all":
        return lambda: comm.all_to_all(full, "x", 0, 0, mesh=mesh)
    return lambda: getattr(comm, op)(full, "x", mesh=mesh)


def raw(op: str, mesh: Mesh, full: torch.Tensor, fresh: bool) -> Callable[[], Any]:
    """The same collective as one raw torch.distributed call on the same process group; with
    ``fresh``, on a new output (or input copy, for the in-place ops) per call."""
    n, i, numel = mesh.size, mesh.rank, full.numel()
    pg = mesh.world.process_group(mesh.group_ranks("x"))
    kept = torch.empty(numel)

    def out(k: int) -> torch.Tensor:
        return torch.empty(k) if fresh else kept[:k]

    if op == "all_gather":
        x = full[: numel // n].clone()
        return lambda: _RAW_SINGLE[op](out(numel), x, group=pg)
    if op == "reduce_scatter":
        return lambda: _RAW_SINGLE[op](out(numel // n), full, group=pg)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out(numel), full, group=pg)
    if op == "ppermute":

        def shift() -> None:
            p2p = [
                dist.P2POp(dist.isend, full, (i + 1) % n, group=pg),
                dist.P2POp(dist.irecv, out(numel), (i - 1) % n, group=pg),
            ]
            for w in dist.batch_isend_irecv(p2p):
                w.wait()

        return shift
    kept.copy_(full)

    def buf() -> torch.Tensor:
        return full.clone() if fresh else kept

    if op == "broadcast":
        return lambda: dist.broadcast(buf(), 0, group=pg)
    return lambda: dist.all_reduce(buf(), group=pg)


VARIANTS = ("ours", "raw", "in place")


def gloo_worker(
    mesh: Mesh, sizes: list[int], scale: float
) -> list[tuple[str, int, dict[str, float]]]:
    """On every rank: (op, size, {variant: median s, "variant min": min s}), interleaved."""
    rows = []
    for size in sizes:
        for op in OPS:
            full = torch.randn(size // 4)
            fns = [ours(op, mesh, full), raw(op, mesh, full, True), raw(op, mesh, full, False)]
            times: list[list[float]] = [[] for _ in fns]
            for fn in fns:
                fn()  # warm-up: connections, allocator
            for rep in range(reps_for(size, scale)):
                for k in range(len(fns)):
                    v = (k + rep) % len(fns)
                    dist.barrier()
                    t0 = time.perf_counter()
                    fns[v]()
                    times[v].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) for name, t in zip(VARIANTS, times)}
            low = {f"{name} min": min(t) for name, t in zip(VARIANTS, times)}
            rows.append((op, size, med | low))
    return rows


def threads_bandwidth(n: int, sizes: list[int], scale: float) -> list[tuple[str, int, float]]:
    """(op, size, median s) of each collective on the threads backend with ``n`` ranks."""
    barrier = threading.Barrier(n)

    def fn(mesh: Mesh) -> list[tuple[str, int, float]]:
        rows = []
        for size in sizes:
            full = torch.randn(size // 4)
            for op in OPS:
                run = ours(op, mesh, full)
                run()
                ts = []
                for _ in range(reps_for(size, scale)):
                    barrier.wait()
                    t0 = time.perf_counter()
                    run()
                    ts.append(time.perf_counter() - t0)
                rows.append((op, size, statistics.median(ts)))
        return rows

    return launch(fn, {"x": n}, backend="threads", timeout=600)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", default="2,4", help="gloo world sizes, comma-separated")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="tensor sizes in bytes (K, M)")
    ap.add_argument("--reps-scale", type=float, default=1.0, help="multiply the repetitions")
    ap.add_argument("--no-threads", action="store_true", help="skip the threads backend")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of interleaved reps\n"
    )
    print(
        "| ranks | op | size | ours ms | raw ms | in place ms | ours/raw | ours/raw (min) "
        "| ours/in place | in place GB/s |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    worst: dict[int, float] = {}
    for n in procs:
        job = functools.partial(gloo_worker, sizes=sizes, scale=args.reps_scale)
        rows = launch(job, {"x": n}, backend="gloo", timeout=1800)[0]  # rank 0's view
        for op, size, t in rows:
            ratio = t["ours"] / t["raw"]
            if size >= 2**20:
                worst[n] = max(worst.get(n, 0.0), ratio)
            print(
                f"| {n} | {op} | {show_size(size)} | {t['ours'] * 1e3:.3f} | {t['raw'] * 1e3:.3f} | "
                f"{t['in place'] * 1e3:.3f} | {ratio:.3f} | {t['ours min'] / t['raw min']:.3f} | "
                f"{t['ours'] / t['in place']:.3f} | {size / t['in place'] / 1e9:.2f} |"
            )
    for n, w in worst.items():
        print(f"\n{n} ranks: worst median ours/raw from 1M up = {w:.3f} (goal <= 1.05)")
    if not args.no_threads:
        print("\n| ranks | op | size | threads ms | threads GB/s |")
        print("| ---: | --- | ---: | ---: | ---: |")
        for n in procs:
            for op, size, t in threads_bandwidth(n, sizes, args.reps_scale):
                print(f"| {n} | {op} | {show_size(size)} | {t * 1e3:.3f} | {size / t / 1e9:.2f} |")


if __name__ == "__main__":
    main()
