"""Offload on the CPU: the cost of the machinery, and how much larger a model fits a budget.

1. Step time of ``cf.offload(policy="auto")`` at a device budget of a quarter of the model states
   (parameters, gradients, Adam moments) against the in-memory step, both under ``cf.remat``,
   timed interleaved (ours, in-memory, ours, ...) in one process. Device and host are the same
   memory here, so the ratio is the price of chunking, fetching, the exact account and the CPU
   Adam (goal: at most 1.3). The two losses are checked equal, so the runs compute the same.
2. The largest GPT (in layers, width fixed) that trains within a fixed budget: in memory (the
   "device" policy, whose account refuses a budget the step exceeds) against ``"auto"`` with
   remat, found by doubling then bisecting the depth; reported as the ratio of model states
   (goal: at least 20).
3. Against the peer: PyTorch FSDP2 (``fully_shard`` on every block and the root) with
   ``CPUOffloadPolicy`` on one rank, the same GPT as an ``nn.Module`` (``single_device.GPT``,
   each block checkpointed as ``cf.remat`` does) from the same weights on the same batches,
   timed interleaved, which side goes first alternating every step; ours is ``"auto"`` at a
   quarter of the model states. Reported as the step time ratio and each side's tokens/s. On a GPU (when there is one) both run there, FSDP2 with
   pinned host memory and NCCL; on the CPU, FSDP2's "device" is the CPU as ours is.

    python benchmarks/offload.py [--steps 8] [--budget-mb 8] [--skip-fsdp2]
    colfunc bench offload
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import colfunc as cf
from colfunc import models, optim

gpt = models.gpt


def _batch(cfg: gpt.Config, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g)
    return {"input_ids": t[:, :-1], "labels": t[:, 1:]}


def _states_bytes(params: object) -> int:
    return 16 * sum(x.numel() for x in cf.tree.leaves(params))  # fp32 params, grads, 2 moments


def step_time(steps: int) -> None:
    cfg = gpt.Config(vocab_size=256, n_layer=8, n_head=4, d_model=192, max_seq_len=128)
    params = gpt.init(cfg)
    batch = _batch(cfg, 4)
    budget = _states_bytes(params) // 4
    loss = gpt.loss(cfg)
    ours = cf.remat(cf.offload(cf.train_step(loss, optim.adamw(1e-4)), "auto", budget))
    theirs = cf.remat(cf.train_step(loss, optim.adamw(1e-4), donate=True))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    s_ours, _ = ours(s_ours, batch)  # warm-up: records the trace
    s_theirs, _ = theirs(s_theirs, batch)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(steps):
        t = time.perf_counter()
        s_ours, m_ours = ours(s_ours, batch)
        times["ours"].append(time.perf_counter() - t)
        t = time.perf_counter()
        s_theirs, m_theirs = theirs(s_theirs, batch)
        times["theirs"].append(time.perf_counter() - t)
    diff = abs(m_ours["loss"].item() - m_theirs["loss"].item())
    ratio = statistics.median(a / b for a, b in zip(times["ours"], times["theirs"], strict=True))
    print(
        f"step time, auto at a quarter of the model states ({budget / 2**20:.1f} MiB of "
        f"{4 * budget / 2**20:.1f}): {ratio:.3f}x in-memory (goal <= 1.3); "
        f"device peak {m_ours['offload/device_peak_bytes'] / 2**20:.1f} MiB, "
        f"h2d {m_ours['offload/h2d_bytes'] / 2**20:.1f} MiB/step, loss diff {diff:.1e}"
    )


def _fits(policy: str, n_layer: int, budget: int) -> int | None:
    """The model states of an ``n_layer`` GPT if two steps run within ``budget``, else None."""
    cfg = gpt.Config(vocab_size=256, n_layer=n_layer, n_head=2, d_model=64, max_seq_len=64)
    params = gpt.init(cfg)
    step = cf.offload(cf.train_step(gpt.loss(cfg), optim.adamw(1e-4)), policy, budget)
    step = cf.remat(step)
    try:
        state = step.init(params)
        for _ in range(2):
            state, m = step(state, _batch(cfg, 2))
    except ValueError:
        return None
    return _states_bytes(params) if m["offload/device_peak_bytes"] <= budget else None


def _largest(policy: str, budget: int, cap: int) -> tuple[int, int]:
    """(layers, model-state bytes) of the deepest model that fits, by doubling then bisection."""
    lo, lo_bytes, hi = 0, 0, 1
    while hi <= cap and (b := _fits(policy, hi, budget)) is not None:
        lo, lo_bytes, hi = hi, b, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > max(1, lo // 8):  # to within an eighth
        mid = (lo + hi) // 2
        b = _fits(policy, mid, budget)
        if b is None:
            hi = mid
        else:
            lo, lo_bytes = mid, b
    return lo, lo_bytes


def capacity(budget_mb: float) -> None:
    budget = int(budget_mb * 2**20)
    mem_layers, mem_bytes = _largest("device", budget, cap=64)
    off_layers, off_bytes = _largest("auto", budget, cap=1024)
    ratio = off_bytes / mem_bytes if mem_bytes else float("inf")
    print(
        f"largest model at a {budget_mb:g} MiB budget (width 64, remat): in memory "
        f"{mem_layers} layers ({mem_bytes / 2**20:.1f} MiB of model states), auto "
        f"{off_layers} layers ({off_bytes / 2**20:.1f} MiB): {ratio:.1f}x (goal >= 20)"
    )


class _Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in the backward pass (as ``cf.remat``)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def versus_fsdp2(steps: int) -> None:
    import os
    import socket

    import torch.distributed as dist
    from single_device import GPT  # the nn.Module peer, beside this file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with socket.socket() as sock:  # a free port for the one-rank group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        cfg = gpt.Config(vocab_size=256, n_layer=8, n_head=4, d_model=192, max_seq_len=128)
        params = gpt.init(cfg)
        budget = _states_bytes(params) // 4
        model = GPT(cfg)
        model.load_colfunc(params)  # type: ignore[operator]
        model.blocks = torch.nn.ModuleList(_Checkpointed(b) for b in model.blocks)
        model.to(device)
        mesh = init_device_mesh(device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=cuda)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        # the host update: torch's AdamW on the CPU (FSDP2 keeps the optimizer's states there)
        torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        loss = gpt.loss(cfg)
        ours = cf.remat(cf.offload(cf.train_step(loss, optim.adamw(1e-4)), "auto", budget))
        state = ours.init(params)
        g = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        gap, rows, T = 0.0, 4, cfg.max_seq_len

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def run_ours(ids: torch.Tensor) -> torch.Tensor:
            nonlocal state
            state, metrics = ours(state, {"input_ids": ids, "labels": ids})
            return metrics["loss"]

        def run_theirs(ids: torch.Tensor) -> torch.Tensor:
            torch_opt.zero_grad(set_to_none=True)
            loss_ = model(ids, ids)
            loss_.backward()
            torch_opt.step()
            return loss_.detach()

        sides = {"ours": run_ours, "theirs": run_theirs}
        for i in range(steps + 1):  # the first of each: warm-up (our trace, FSDP2's buffers)
            ids = torch.randint(0, cfg.vocab_size, (rows, T), generator=g).to(device)
            losses = {}
            # the order alternates every step, so that drift in the machine hits both alike
            for side in ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"):
                sync()
                t0 = time.perf_counter()
                losses[side] = sides[side](ids)
                sync()
                if i:
                    times[side].append(time.perf_counter() - t0)
            gap = max(gap, abs(float(losses["ours"]) - float(losses["theirs"])))
    finally:
        dist.destroy_process_group()
    ratio = statistics.median(a / b for a, b in zip(times["ours"], times["theirs"], strict=True))
    tokens = rows * T
    print(
        f"vs FSDP2 + CPUOffloadPolicy on {device.type} (8-layer GPT, {rows}x{T} tokens, both "
        f"checkpointed): step time ours/FSDP2 {ratio:.3f}; ours "
        f"{tokens / statistics.median(times['ours']):.0f} tok/s, FSDP2 "
        f"{tokens / statistics.median(times['theirs']):.0f} tok/s; ours at a "
        f"{budget / 2**20:.1f} MiB device budget; max loss gap {gap:.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-mb", type=float, default=8.0)
    parser.add_argument("--skip-fsdp2", action="store_true", help="leave out the peer")
    args = parser.parse_args()
    torch.manual_seed(0)
    step_time(args.steps)
    capacity(args.budget_mb)
    if not args.skip_fsdp2:
        versus_fsdp2(args.steps)


if __name__ == "__main__":
    main()
