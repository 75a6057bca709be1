"""Checkpoint saving: how long a training step waits for a synchronous commit, and for an async one.

The state of a GPT-2 training run (parameters and AdamW moments, fp32) is committed to a
checkpoint store in a temporary folder, ``--repeats`` times each way, interleaved:

- ``sync``: :func:`colfunc.checkpoint.commit` (tensors, checksums, fsync, rename, pointer);
- ``async``: :meth:`colfunc.checkpoint.AsyncWriter.submit`, which copies the state to host
  memory and returns while a thread commits; the blocking time is what a step waits;
- ``copy``: the host copy alone (:meth:`AsyncWriter.snapshot`).

Goal: the async blocking time at most the host copy plus 10% of a synchronous save. Also printed:
the load time (checksums verified) and the checksum's share of a save.

    python benchmarks/checkpoint.py [--config small] [--repeats 5]
    colfunc bench checkpoint
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import colfunc as cf
from colfunc import checkpoint, models, optim, tree

gpt = models.gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = gpt.Config.tiny() if args.config == "tiny" else gpt.Config.small()
    step = cf.train_step(gpt.loss(cfg), optim.adamw(1e-3))
    state = step.init(gpt.init(cfg, seed=0))
    size = tree.size_bytes(tree.tensors(state))
    print(f"GPT-2 {args.config}: state of {size / 2**20:.1f} MiB (parameters + AdamW moments)")
    sync, blocking, copies, waits, loads, sums = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        writer = checkpoint.AsyncWriter()
        n = 0
        for _ in range(args.repeats):
            n += 1
            t0 = time.perf_counter()
            path = checkpoint.commit(root, n, state, keep_last=2)
            sync.append(time.perf_counter() - t0)

            n += 1
            t0 = time.perf_counter()
            writer.submit(root, n, state, keep_last=2)
            t1 = time.perf_counter()
            writer.wait()
            blocking.append(t1 - t0)
            waits.append(time.perf_counter() - t1)

            t0 = time.perf_counter()
            host = checkpoint.AsyncWriter.snapshot(state)
            copies.append(time.perf_counter() - t0)
            del host

            t0 = time.perf_counter()  # what a save computes: whole and per-block CRC-32s
            checkpoint.checksums._checksums({str(k): x for k, x in enumerate(tree.tensors(state))})
            sums.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            checkpoint.load(path)
            loads.append(time.perf_counter() - t0)
    med = statistics.median
    s, b, c = med(sync), med(blocking), med(copies)
    print(f"sync commit          {s * 1e3:8.1f} ms  ({size / s / 2**30:.2f} GiB/s)")
    print(f"async: step blocked  {b * 1e3:8.1f} ms  (then written in {med(waits) * 1e3:.1f} ms)")
    print(f"host copy alone      {c * 1e3:8.1f} ms")
    print(f"load (verified)      {med(loads) * 1e3:8.1f} ms")
    print(f"checksums            {med(sums) * 1e3:8.1f} ms  ({med(sums) / s:.0%} of a sync save)")
    bound = c + 0.1 * s
    verdict = "met" if b <= bound else "missed"
    print(
        f"async blocking {b * 1e3:.1f} ms vs goal <= copy + 10% of sync = {bound * 1e3:.1f} ms: "
        f"{verdict}; async blocks {b / s:.2f}x of a sync save"
    )


if __name__ == "__main__":
    main()
