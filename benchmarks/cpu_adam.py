"""CPU AdamW: colfunc.ops.cpu_adamw_ (C++) vs torch.optim.AdamW(fused=True), against memory bandwidth.

Both update the same number of fp32 parameters; steps are timed interleaved (ours, theirs, copy,
theirs, ours, copy, ...) in one process, so drift in a shared machine's load hits all alike.
Prints per size the median time of each, the median ratio theirs/ours (goal: at least 1.0), and
the effective bandwidth of each: bytes read and written per step (param, grad, exp_avg, exp_avg_sq
read; param, exp_avg, exp_avg_sq written: 28 bytes a parameter with fp32 grads, 26 with bf16)
over time, as a share of the copy bandwidth measured the same way (read plus write of a large
``copy_``; goal: 80%).

    python benchmarks/cpu_adam.py [--sizes 16M,128M] [--reps 9] [--grads fp32|bf16] [--simd|--no-simd]
    colfunc bench cpu_adam
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from colfunc.ops import AdamWHyper, cpu_adamw_

HP: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].isalpha() else int(text)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(n: int, reps: int, grad_dtype: torch.dtype, simd: bool) -> dict[str, float]:
    """Median seconds per step of ours and of torch's fused AdamW, and of an fp32 copy of n."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    theirs = param.clone().requires_grad_()
    theirs.grad = grad.float()
    opt = torch.optim.AdamW(
        [theirs],
        fused=True,
        lr=HP["lr"],
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        weight_decay=HP["weight_decay"],
    )
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    step = [0]

    def ours() -> None:
        step[0] += 1
        hyper = AdamWHyper(step=step[0], **HP)
        cpu_adamw_([param], [grad], [exp_avg], [exp_avg_sq], hyper, simd=simd)

    runs: dict[str, Callable[[], object]] = {
        "ours": ours,
        "torch": opt.step,
        "copy": lambda: dst.copy_(src),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: thread pools, page faults, the C++ build
        fn()
    for r in range(reps):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(_seconds(runs[name]))
    ratios = [t / o for t, o in zip(times["torch"], times["ours"])]
    result = {name: statistics.median(ts) for name, ts in times.items()}
    result["ratio"] = statistics.median(ratios)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16M,128M", help="parameter counts, e.g. 16M,128M")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--grads", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--simd", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    grad_dtype = torch.float32 if args.grads == "fp32" else torch.bfloat16
    grad_bytes = 4 if grad_dtype == torch.float32 else 2
    step_bytes = 4 * 3 + grad_bytes + 4 * 3  # read p, g, m, v; write p, m, v
    print(
        f"threads {torch.get_num_threads()}, grads {args.grads}, simd {args.simd}, "
        f"median of {args.reps} interleaved repetitions"
    )
    header = f"{'params':>8} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>10} "
    print(header + f"{'ours GB/s':>10} {'torch GB/s':>10} {'copy GB/s':>10} {'ours/copy':>9}")
    for text in args.sizes.split(","):
        n = _size(text)
        r = bench(n, args.reps, grad_dtype, args.simd)
        copy_gbs = 2 * 4 * n / r["copy"] / 1e9  # read + write of one fp32 buffer
        ours_gbs = step_bytes * n / r["ours"] / 1e9
        torch_gbs = 28 * n / r["torch"] / 1e9  # torch reads the grads as fp32
        print(
            f"{text:>8} {1e3 * r['ours']:9.1f} {1e3 * r['torch']:9.1f} {r['ratio']:9.2f}x "
            f"{ours_gbs:10.1f} {torch_gbs:10.1f} {copy_gbs:10.1f} {ours_gbs / copy_gbs:8.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
