"""Data and tensor parallel training steps on gloo: colfunc against PyTorch's own, side by side.

In one gloo world of N processes (N = 2 and 4), each colfunc scheme runs with its PyTorch peer on
the same GPT-2 weights and the same global batches, in the same processes, interleaved step by
step (the order alternates every step; every rank starts each side's step at a barrier):

- ``dp``: ``cf.shard(step, mesh)`` on ``{"dp": N}`` against ``DistributedDataParallel``; both
  start bucketed all_reduces during the backward pass, and ours also updates the layers of each
  bucket that has arrived while the last ones are still being reduced (``Step.overlap_update``);
- ``dp_after``: the same with ``overlap=False`` (buckets reduced after the backward pass), against
  DDP again, to show what the overlap is worth;
- ``zero0``: ``cf.zero(cf.shard(step, mesh), stage=0)`` on ``{"dp": N}`` against
  ``DistributedDataParallel``;
- ``zero2``: ``cf.zero(cf.shard(step, mesh), stage=2)`` against DDP: the same bytes (reduce-scatter
  and all-gather instead of all-reduce), half the optimizer work per rank with 2 ranks;
- ``zero3``: ``cf.zero(cf.shard(step, mesh), stage=3)`` on ``{"dp": N}`` against FSDP2,
  ``fully_shard`` on every block and then on the root;
- ``tp2``: ``cf.shard(step, mesh, plan=gpt.tp_plan)`` on ``{"tp": 2}`` (``{"dp": N/2, "tp": 2}``
  for N = 4) against DTensor ``parallelize_module`` with ``ColwiseParallel`` on q/k/v/fc and
  ``RowwiseParallel`` on o/proj (wrapped in DDP over ``dp`` for N = 4). The peer keeps the tied
  embedding replicated, where ``gpt.tp_plan`` splits it over the vocabulary.

The peer is the nn.Module GPT-2 of ``single_device.py`` with fused ``torch.optim.AdamW``; it
takes its rank's slice of the global batch. Printed per scheme, from rank 0: median step times,
the median over steps of the ratio ours/torch (goal: at most 1.0), bytes each rank sends per
step, collectives per step, and the largest gap between the two sides' losses (the global-batch
mean on both). Beside the wall-clock ratio, the same median over each step's main-thread CPU
time (``time.thread_time``): on a shared machine whose hypervisor takes cycles away (steal time),
that one moves less, and it tells compute and overhead apart from waiting on the wire. Our
bytes come from the colfunc ledger. Torch's are counted from the collectives PyTorch issues in
one step (a dispatch mode sees them, those of DDP's C++ reducer included) and sized with the
ledger's ring formulas, so the two columns compare like with like; the same counter run over our
step checks our ledger where it can see our collectives. Bytes and calls come from one extra
untimed step after the timed ones (the counter slows a step down).

The ``overhead`` config (width 16, 16 positions, batch 4) makes a step almost all per-step
overhead: its CPU ratio is what colfunc's Python adds over DDP's C++ reducer and hooks.

With 4 processes on a 2-core machine every rank gets one thread and two ranks share each core:
those timings are contended and say more about scheduling than about either library.

``--peer-weights in_out`` builds the DDP peers' blocks from :class:`InOutLinear` layers, whose
weights are stored ``[in, out]`` as colfunc's models store theirs: the same matmuls on both
sides, so the ratio measures the data-parallel machinery (buckets, hooks, the update) alone.

``--control`` also times two identical colfunc ``dp`` steps against each other, and two identical
DDP peers, interleaved the same way: how far from 1.0 a ratio between equal sides lands in this
harness on this machine (memory placement alone moves a step by a percent or two), so that a
ratio within that distance of 1.0 is read as parity. Its instances are placed as ``--placement``
places the compared sides.

``--runs R`` repeats each world R times, each in fresh processes (fresh memory placement, fresh
core assignment), and reports the median over runs of each run's median ratio, with every run's
ratio beside it: one run's ratio carries that run's placement luck (a few percent either way on
this machine), which only separate runs average out. Each run also builds each side's state at
a drawn offset in the heap (``--placement drawn``, the default; :func:`shift_heap`): fresh
processes alone repeat the offsets within their pages. With 5 runs or more, each scheme's list
ends with a distribution-free interval for the median (:func:`median_interval`): a ratio whose
interval holds 1.0 is at parity as far as those runs can tell.

``--process-warmup STEPS`` first runs, in every process, a ``dp`` comparison of that many timed
steps (after the config's warm-up steps, and with its byte-counting step) and drops its
figures: the scheme timed first in a process came out slower for ours than the one timed
second (small, 2 ranks, 27 runs each: 1.011 [1.000, 1.016] against 0.995 [0.991, 1.011]), and
with 6 such steps first, dp and zero0 measured 1.002 [0.998, 1.008] and 0.996 [0.979, 1.007]
(9 runs).

Both sides run in the ranks ``cf.launch`` starts, which keep freed host memory for the next step
(:mod:`colfunc.sharding.host_malloc`); ``COLFUNC_MALLOC=system`` runs them on glibc's defaults.

    python benchmarks/data_parallel.py [--configs tiny,small,overhead]
                                       [--schemes dp,dp_after,zero0,zero2,zero3,tp2]
                                       [--procs 2,4] [--steps 10] [--warmup 3] [--control]
                                       [--peer-weights out_in|in_out] [--runs 1]
                                       [--placement drawn|fixed] [--process-warmup 0]
    colfunc bench data_parallel
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from single_device import GPT, Block  # the nn.Module peer, beside this file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import colfunc as cf
from colfunc import core, models, optim
from colfunc.models.gpt import Config
from colfunc.sharding.ledger import Ledger, ring_bytes
from colfunc.sharding.torch_dist import TorchWorld

gpt = models.gpt
# the hyperparameters of single_device.py
ADAMW: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCHEMES = {
    "dp": "DDP",
    "dp_after": "DDP",
    "zero0": "DDP",
    "zero2": "DDP",
    "zero3": "FSDP2",
    "tp2": "DTensor TP",
}


def overhead_config() -> Config:
    """Width 16, 4 layers, 16 positions: a step that is nearly all per-step overhead (Python,
    hooks, launches), so its ratio shows what each library adds to a step, not its kernels."""
    return Config(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=16)


# config -> (batch size, world sizes, timed steps, warm-up steps): small runs on 2 processes only,
# so that the whole benchmark stays within about five minutes on 2 cores. Small warms up for
# two steps: its second step still grows the heap on both sides (2 gloo ranks: 1.26 s ours,
# 1.46 s DDP's, against about 0.95 s from the third step on)
SIZES = {
    "tiny": (Config.tiny, 16, (2, 4), 10, 3),
    "small": (Config.small, 8, (2,), 4, 2),
    "overhead": (overhead_config, 4, (2,), 60, 10),
}


# --- the tensor-parallel peer ----------------------------------------------------------------


class HeadsBlock(Block):
    """``Block`` that reads the head count off its q/k/v outputs, so it runs on this rank's heads
    when q/k/v are column-parallel (and on all of them when they are not)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.head_dim = cfg.d_model // cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        E = self.head_dim
        q, k, v = (m(h).unflatten(-1, (-1, E)).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).flatten(2))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class HeadsGPT(GPT):
    """``GPT`` built from ``HeadsBlock``s, for tensor parallelism."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(HeadsBlock(cfg) for _ in range(cfg.n_layer))


class InOutLinear(nn.Module):
    """``nn.Linear`` with its weight stored ``[in, out]``, as colfunc's models store theirs (and
    Hugging Face's GPT-2 ``Conv1D``): ``F.linear(x, weight.t(), bias)``, the matmuls our step
    runs. On this CPU that layout's backward is a few percent slower than ``nn.Linear``'s, so a
    DDP peer built from these compares the data-parallel machinery alone."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().t().contiguous())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t(), self.bias)


PEER_WEIGHTS = ("out_in", "in_out")  # nn.Linear's layout, or colfunc's (InOutLinear)


def torch_peer(
    scheme: str, cfg: Config, params: Any, shape: dict[str, int], weights: str = "out_in"
) -> Any:
    """(model, optimizers, data-parallel process group) of the PyTorch peer of ``scheme``;
    ``weights="in_out"`` gives a DDP peer's blocks :class:`InOutLinear` layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP

    model: nn.Module = (HeadsGPT if scheme == "tp2" else GPT)(cfg)
    model.load_colfunc(params)  # type: ignore[operator]
    dp_group = dist.group.WORLD
    if scheme in ("zero0", "zero2", "dp", "dp_after"):
        if weights == "in_out":
            for block in model.blocks:  # type: ignore[union-attr]
                for name in ("q", "k", "v", "o", "fc", "proj"):
                    setattr(block, name, InOutLinear(getattr(block, name)))
        model = DDP(model)
    elif scheme == "zero3":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        plan: dict[str, Any] = {}
        for i in range(cfg.n_layer):
            plan |= {f"blocks.{i}.{m}": ColwiseParallel() for m in ("q", "k", "v", "fc")}
            plan |= {f"blocks.{i}.{m}": RowwiseParallel() for m in ("o", "proj")}
        parallelize_module(model, mesh["tp"], plan)
        if "dp" in shape:
            _pre_dp_module_transform(model)  # DDP takes local tensors, not DTensors
            dp_group = mesh["dp"].get_group()
            model = DDP(model, process_group=dp_group)
        else:
            dp_group = None
    # fused AdamW takes plain tensors or DTensors, not both at once: one optimizer for each kind
    kinds: dict[bool, list[nn.Parameter]] = {}
    for p in model.parameters():
        kinds.setdefault(isinstance(p, DTensor), []).append(p)
    opts = [torch.optim.AdamW(ps, fused=True, **ADAMW) for ps in kinds.values()]
    return model, opts, dp_group


def peer_step(peer: Any, ids: torch.Tensor, mesh: cf.Mesh) -> torch.Tensor:
    """One step of a ``torch_peer`` (model, optimizers, group) on this rank's ``dp`` slice of
    the global batch ``ids``; its loss on that slice."""
    model, opts, _ = peer
    local = ids.chunk(mesh.shape.get("dp", 1), dim=0)[mesh.coords.get("dp", 0)]
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss = model(local, local)
    loss.backward()
    for opt in opts:
        opt.step()
    return loss.detach()


def ours(scheme: str, cfg: Config, mesh: cf.Mesh) -> cf.Step:
    """The colfunc step of ``scheme`` on ``mesh`` (donating its state, as the training loop
    does: the peers update in place too)."""
    ref = cf.train_step(gpt.loss(cfg), optim.adamw(**ADAMW), donate=True)
    if scheme == "tp2":
        return cf.shard(ref, mesh, plan=gpt.tp_plan)
    if scheme in ("dp", "dp_after"):
        return cf.shard(ref, mesh, overlap=scheme == "dp")
    return cf.zero(cf.shard(ref, mesh), stage=int(scheme[-1]))


# --- counting torch's collectives ------------------------------------------------------------

# c10d op -> (ledger op, index of the tensor(s) whose size the ring formula names, index of the
# process group); the gathered size of a list-form all_gather is n times its input
_C10D = {
    "allreduce_": ("all_reduce", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
}
_FUNCTIONAL = {  # _c10d_functional op -> (ledger op, index of its group name)
    "all_reduce": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2),
}


_NO_PAYLOAD = {"barrier", "wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(y) for y in x) if isinstance(x, list | tuple) else 0


class CollectiveCounter(TorchDispatchMode):
    """Counts the bytes this rank sends in every collective dispatched under it, per (op, axis),
    with the ledger's ring formulas. ``axes`` names process groups by their ordered ranks."""

    def __init__(self, axes: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.axes, self.ledger, self.calls = axes, Ledger(), 0
        self.unknown: set[str] = set()

    def record(self, op: str, group: Any, size_of: Any, gathered: bool = False) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        nbytes = _nbytes(size_of) * (len(ranks) if gathered else 1)
        sends = op != "broadcast" or dist.get_rank() != ranks[-1]
        key = self.axes.get(ranks, str(ranks))
        self.calls += 1
        self.ledger.record(op, key, ring_bytes(op, nbytes, len(ranks), sends=sends))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d" and name in _C10D:
            op, at, pg = _C10D[name]
            self.record(op, dist.ProcessGroup.unbox(args[pg]), args[at], name == "allgather_")
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            op, at = _FUNCTIONAL[name]
            group = dist.distributed_c10d._resolve_process_group(args[at])
            self.record(op, group, args[0], op == "all_gather")
        elif func.namespace in ("c10d", "_c10d_functional") and name not in _NO_PAYLOAD:
            self.unknown.add(str(func))
        return func(*args, **(kwargs or {}))


def _axes_by_group(mesh: cf.Mesh) -> dict[tuple[int, ...], str]:
    names = {tuple(range(mesh.size)): "world"}
    for axis in mesh.axis_names:
        names[mesh.group_ranks(axis)] = axis
    return names


def _show(led: Ledger) -> str:
    parts = [f"{op} {axis} {b / 1e6:.3f}" for (op, axis), b in sorted(led.as_dict().items()) if b]
    return "; ".join(parts) or "none"


# --- one comparison --------------------------------------------------------------------------


def compare(
    mesh: cf.Mesh,
    scheme: str,
    cfg: Config,
    batch_size: int,
    steps: int,
    warmup: int,
    peer_weights: str = "out_in",
    placement: int | None = None,
) -> dict[str, Any]:
    """Run ``scheme`` and its torch peer interleaved on every rank; rank 0's timings and bytes.

    ``steps`` timed steps follow ``warmup`` untimed ones, and one more step counts the bytes.
    With ``placement`` (a seed), each side builds its state after a block of a drawn size
    (:func:`shift_heap`).
    """
    params = gpt.init(cfg, seed=0)
    held = shift_heap(placement, mesh.rank, scheme, "ours")
    step = ours(scheme, cfg, mesh)
    state = step.init(params)
    held += shift_heap(placement, mesh.rank, scheme, "torch")
    peer = torch_peer(scheme, cfg, params, mesh.shape, peer_weights)
    dp_group = peer[2]
    g = torch.Generator().manual_seed(0)
    T = cfg.max_seq_len

    ours_t, theirs_t, gap = [], [], 0.0
    ours_c, theirs_c = [], []  # this rank's main-thread CPU seconds per step
    counter, check = (
        CollectiveCounter(_axes_by_group(mesh)),
        CollectiveCounter(_axes_by_group(mesh)),
    )
    with cf.sharding.recording(mesh) as led:
        for i in range(warmup + steps + 1):
            ids = torch.randint(0, cfg.vocab_size, (batch_size, T), generator=g)
            batch = {"input_ids": ids, "labels": ids}
            last = i == warmup + steps  # the untimed step that counts bytes
            if last:
                led.reset()
                calls = mesh.world.calls
            times, cpu = {}, {}
            for side in ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"):
                mode = (check if side == "ours" else counter) if last else contextlib.nullcontext()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                with mode:
                    if side == "ours":
                        state, metrics = step(state, batch)
                    else:
                        loss = peer_step(peer, ids, mesh)
                times[side] = time.perf_counter() - t0
                cpu[side] = time.thread_time() - c0
            if dp_group is not None:  # the global mean, as ours reports
                dist.all_reduce(loss, group=dp_group)
                loss /= dist.get_world_size(dp_group)
            gap = max(gap, abs(float(metrics["loss"]) - float(loss)))
            if warmup <= i and not last:
                ours_t.append(times["ours"])
                theirs_t.append(times["theirs"])
                ours_c.append(cpu["ours"])
                theirs_c.append(cpu["theirs"])
    held.clear()
    gaps = torch.tensor([gap])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    return {
        "ours_s": statistics.median(ours_t),
        "theirs_s": statistics.median(theirs_t),
        "ratio": statistics.median(a / b for a, b in zip(ours_t, theirs_t)),
        "cpu_ratio": statistics.median(a / b for a, b in zip(ours_c, theirs_c)),
        "ours_bytes": led.bytes(),
        "ours_calls": mesh.world.calls - calls,
        "ours_detail": _show(led),
        "ours_counted": check.ledger.bytes(),
        "theirs_bytes": counter.ledger.bytes(),
        "theirs_calls": counter.calls,
        "theirs_detail": _show(counter.ledger),
        "unknown": sorted(counter.unknown | check.unknown),
        "loss_gap": float(gaps),
    }


def shift_heap(seed: int | None, *key: Any) -> list[torch.Tensor]:
    """A block of a size drawn from ``(seed, *key)`` (up to 4 MiB, in 64-byte steps) for the
    caller to hold while a side builds its state, so that what it allocates next lands at a
    drawn offset; nothing for ``seed`` None.

    Why: the C library gives the same sequence of requests the same offsets within their pages
    in every process (only whole pages move between processes), so fresh processes alone repeat
    one placement of each side's parameters, moments and buffers, and a placement that happens
    to suit one side's memory better (caches, 4 KiB aliasing) stays with that side in every
    run. Measured: two instances of the same colfunc step on ``gpt.Config.small``, built one
    after the other, differed by 1.000, 1.013, 1.007, 1.007 in four fresh-process runs, and by
    1.001, 1.005, 1.002, 0.990 with their heaps shifted by drawn amounts.
    """
    if seed is None:
        return []
    rnd = random.Random(":".join(str(k) for k in (seed, *key)))
    return [torch.empty(rnd.randrange(64, 2**22, 64), dtype=torch.uint8)]


def control(
    mesh: cf.Mesh,
    cfg: Config,
    batch_size: int,
    steps: int,
    warmup: int,
    placement: int | None = None,
) -> dict[str, float]:
    """The harness's own noise floor on ``{"dp": N}``: two identical colfunc ``dp`` steps
    against each other, and two identical DDP peers, each pair interleaved as ``compare``
    interleaves ours and theirs. Rank 0's median ratios (first instance over second); a
    ratio off 1.0 by x says that differences of x between the two sides are not resolved.
    With ``placement`` (a seed), each instance is built after a block of a drawn size, as
    ``compare`` builds its two sides."""
    params = gpt.init(cfg, seed=0)
    held: list[torch.Tensor] = []
    steps_, states, peers = [], [], []
    for k in range(2):
        held += shift_heap(placement, mesh.rank, "control", "ours", k)
        steps_.append(ours("dp", cfg, mesh))
        states.append(steps_[k].init(params))
    for k in range(2):
        held += shift_heap(placement, mesh.rank, "control", "torch", k)
        peers.append(torch_peer("dp", cfg, params, mesh.shape))
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[list[float]]] = {"ours": [[], []], "torch": [[], []]}
    losses: dict[str, list[float]] = {"ours": [0.0, 0.0], "torch": [0.0, 0.0]}
    gap = 0.0  # between the two instances of each side: equal computations, so 0
    for i in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_seq_len), generator=g)
        for side in ("ours", "torch"):
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                dist.barrier()
                t0 = time.perf_counter()
                if side == "ours":
                    states[k], metrics = steps_[k](states[k], {"input_ids": ids, "labels": ids})
                    loss = metrics["loss"]
                else:
                    loss = peer_step(peers[k], ids, mesh)
                if i >= warmup:
                    times[side][k].append(time.perf_counter() - t0)
                losses[side][k] = float(loss)
            gap = max(gap, abs(losses[side][0] - losses[side][1]))
    held.clear()
    out = {side: statistics.median(a / b for a, b in zip(*pair)) for side, pair in times.items()}
    return {**out, "loss_gap": gap}


class CountingWorld(TorchWorld):
    """A ``TorchWorld`` that counts the collectives it runs (``calls``)."""

    def __init__(self, shape: dict[str, int], rank: int) -> None:
        super().__init__(shape, rank)
        self.calls = 0

    def collective(self, rank: int, call: Any, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().collective(rank, call, x)

    def start(self, rank: int, call: Any, x: torch.Tensor) -> Any:
        self.calls += 1
        return super().start(rank, call, x)


def scheme_mesh(scheme: str, n: int, rank: int) -> cf.Mesh:
    """``{"dp": N}``, or for tensor parallel ``{"tp": 2}`` (N = 2) or ``{"dp": N/2, "tp": 2}``,
    over the same world, counting its collectives."""
    shape = {"dp": n} if scheme != "tp2" else {"tp": 2} if n == 2 else {"dp": n // 2, "tp": 2}
    return cf.Mesh(shape, rank, world=CountingWorld(shape, rank))


def worker(
    mesh: cf.Mesh,
    schemes: list[str],
    cfg: Config,
    batch_size: int,
    steps: int,
    warmup: int,
    with_control: bool = False,
    peer_weights: str = "out_in",
    placement: int | None = None,
    process_warmup: int = 0,
) -> list[dict[str, Any]]:
    """On every rank of a ``{"dp": N}`` world: ``compare`` for each scheme (and ``control``
    first, as a row of scheme ``"control"``), after a ``dp`` comparison of ``process_warmup``
    timed steps (none by default) whose figures are dropped."""
    rows = []
    if process_warmup:  # so that no timed scheme is the first this process runs
        m = scheme_mesh("dp", mesh.size, mesh.rank)
        with core.context(m):
            compare(m, "dp", cfg, batch_size, process_warmup, warmup, peer_weights)
    if with_control:
        m = scheme_mesh("dp", mesh.size, mesh.rank)
        with core.context(m):
            floor = control(m, cfg, batch_size, steps, warmup, placement)
        rows.append({"scheme": "control", **floor})
    for scheme in schemes:
        m = scheme_mesh(scheme, mesh.size, mesh.rank)
        with core.context(m):
            row = compare(m, scheme, cfg, batch_size, steps, warmup, peer_weights, placement)
        rows.append({"scheme": scheme, "mesh": m.shape, **row})
    return rows


def run(
    n: int,
    schemes: list[str],
    cfg: Config,
    batch_size: int,
    steps: int,
    warmup: int,
    with_control: bool = False,
    peer_weights: str = "out_in",
    placement: int | None = None,
    process_warmup: int = 0,
) -> list[dict[str, Any]]:
    """``worker`` on ``n`` gloo processes; rank 0's rows (``placement``: see ``compare``)."""
    job = functools.partial(
        worker,
        schemes=schemes,
        cfg=cfg,
        batch_size=batch_size,
        steps=steps,
        warmup=warmup,
        with_control=with_control,
        peer_weights=peer_weights,
        placement=placement,
        process_warmup=process_warmup,
    )
    return cf.launch(job, mesh={"dp": n}, backend="gloo", timeout=600)[0]


# the figures of a compared row that are medians over its run's steps
TIMED = ("ours_s", "theirs_s", "ratio", "cpu_ratio")


def combine(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of several runs of one world as one row per scheme: the median over runs of the
    timings and ratios (each run's own being a median over its steps), the largest loss gap,
    the bytes and calls of the first run (the same in every run), and ``"ratios"``: every run's
    ratio, in order. A control row's two ratios are combined the same way."""
    if not runs:
        raise ValueError("combine: no runs to combine")
    schemes = [[r["scheme"] for r in rows] for rows in runs]
    if any(s != schemes[0] for s in schemes):
        raise ValueError(f"combine: runs with different schemes {schemes}")
    out = []
    for k, first in enumerate(runs[0]):
        same = [rows[k] for rows in runs]
        row = dict(first)
        control = first["scheme"] == "control"
        for key in ("ours", "torch") if control else TIMED:
            row[key] = statistics.median(r[key] for r in same)
        row["loss_gap"] = max(r["loss_gap"] for r in same)
        row["ratios"] = [r["ours" if control else "ratio"] for r in same]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"of {', '.join(SCHEMES)}")
    ap.add_argument("--procs", help="gloo world sizes, e.g. 2,4 (default: per config)")
    ap.add_argument("--steps", type=int, help="timed steps (default: per config)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default: per config)")
    ap.add_argument(
        "--control",
        action="store_true",
        help="also time two identical colfunc dp steps, and two identical DDP peers, against "
        "each other: the noise floor of the ratios",
    )
    ap.add_argument(
        "--peer-weights",
        choices=PEER_WEIGHTS,
        default="out_in",
        help="the DDP peers' Linear weights: nn.Linear's [out, in] (default), or [in, out] as "
        "colfunc's models store them, which compares the data-parallel machinery alone",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat each world this many times in fresh processes and report the median over "
        "runs of each run's median (default 1)",
    )
    ap.add_argument(
        "--placement",
        choices=("drawn", "fixed"),
        default="drawn",
        help="drawn (default): each run builds each side's state at a drawn offset in the heap "
        "(run r's seed is r), so that runs also redraw where within its pages each side's "
        "memory lies; fixed: as the allocation sequence puts it, the same in every run",
    )
    ap.add_argument(
        "--process-warmup",
        type=int,
        default=0,
        metavar="STEPS",
        help="before the first scheme, run a dp comparison of this many timed steps (after the "
        "config's warm-up steps) in every process and drop its figures, so that no timed "
        "scheme is the first the process runs (default 0)",
    )
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    if args.process_warmup < 0:
        ap.error(f"--process-warmup must be at least 0, got {args.process_warmup}")
    schemes = args.schemes.split(",")
    for name in [*args.configs.split(","), *schemes]:
        if name not in SIZES and name not in SCHEMES:
            ap.error(
                f"unknown config or scheme {name!r}; configs {list(SIZES)}, schemes {list(SCHEMES)}"
            )
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; rank 0's medians over interleaved steps"
    )
    print(
        "MB: sent per rank per step (ours: ledger; torch: its collectives counted, ring formulas)"
    )
    print("calls: collectives per step")
    print(f"DDP peers' Linear weights: {args.peer_weights}")
    print(f"placement of each side's state in the heap: {args.placement}")
    if args.runs > 1:
        print(
            f"each figure is the median over {args.runs} runs in fresh processes of that run's "
            "median; each run's ratio is listed below the table"
        )
    print(
        "CPU ratio: the same median over this rank's main-thread CPU time (time.thread_time),"
        " which neither the\nwait for a collective nor time the machine gives to others counts\n"
    )
    print(
        "| config | ranks | mesh | ours | torch | ours ms | torch ms | ours/torch | CPU ratio "
        "| ours MB | torch MB | ours calls | torch calls | max loss gap |"
    )
    print(
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"
    )
    details, controls = [], []
    for name in args.configs.split(","):
        make, batch_size, procs, steps, warmup = SIZES[name]
        cfg = make()
        if args.procs:
            procs = tuple(int(p) for p in args.procs.split(","))
        steps = args.steps if args.steps is not None else steps
        warmup = args.warmup if args.warmup is not None else warmup
        for n in procs:
            rows = combine(
                [
                    run(
                        n,
                        schemes,
                        cfg,
                        batch_size,
                        steps,
                        warmup,
                        args.control,
                        args.peer_weights,
                        r if args.placement == "drawn" else None,
                        args.process_warmup,
                    )
                    for r in range(args.runs)
                ]
            )
            for r in rows:
                if r["scheme"] == "control":
                    controls.append(
                        f"- {name} {n} ranks: colfunc dp against itself {r['ours']:.3f}, DDP "
                        f"against itself {r['torch']:.3f}"
                        + (f" (colfunc's per run: {_listed(r['ratios'])})" if args.runs > 1 else "")
                    )
                    continue
                mesh = "x".join(f"{a}{s}" for a, s in r["mesh"].items())
                print(
                    f"| {name} {batch_size}x{cfg.max_seq_len} | {n} | {mesh} | {r['scheme']} "
                    f"| {SCHEMES[r['scheme']]} | {r['ours_s'] * 1e3:.1f} "
                    f"| {r['theirs_s'] * 1e3:.1f} | {r['ratio']:.3f} | {r['cpu_ratio']:.3f} "
                    f"| {r['ours_bytes'] / 1e6:.3f} "
                    f"| {r['theirs_bytes'] / 1e6:.3f} | {r['ours_calls']} | {r['theirs_calls']} "
                    f"| {r['loss_gap']:.1e} |",
                    flush=True,
                )
                details.append((name, n, r))
    if args.runs > 1:
        print("\nours/torch in each run:")
        for name, n, r in details:
            print(f"- {name} {n} ranks {r['scheme']}: {_listed(r['ratios'])}")
    if controls:
        print("\nNoise floor (--control): the same median ratio between two identical sides")
        print("\n".join(controls))
    print("\nMB per op and axis; 'counted' is the torch counter run over our step, which sees")
    print("collectives outside ShardedTensor dispatch only (so not tensor parallel's):")
    for name, n, r in details:
        print(
            f"- {name} {n} ranks {r['scheme']}: ours {r['ours_detail']} (counted "
            f"{r['ours_counted'] / 1e6:.3f}); torch {r['theirs_detail']}"
        )
        if r["unknown"]:
            print(f"  collectives not counted: {', '.join(r['unknown'])}")


def _listed(ratios: list[float]) -> str:
    listed = ", ".join(f"{x:.3f}" for x in ratios)
    interval = median_interval(ratios)
    if interval is None:
        return listed
    lo, hi, coverage = interval
    return f"{listed}; median {statistics.median(ratios):.3f}, {coverage:.0%} interval {lo:.3f}-{hi:.3f}"


def median_interval(xs: list[float], level: float = 0.9) -> tuple[float, float, float] | None:
    """A confidence interval for the median of what the runs ``xs`` sample, and its coverage.

    Distribution-free: how many of ``n`` runs fall below the true median is Binomial(n, 1/2), so
    the order statistics ``x_(k)`` and ``x_(n+1-k)`` enclose it with probability
    ``1 - 2 P(B <= k - 1)``. The narrowest such pair with coverage at least ``level``; None when
    even the extremes cover less (fewer than 5 runs at 0.9). A ratio whose interval holds 1.0
    is not told apart from parity by these runs.
    """
    n, ordered = len(xs), sorted(xs)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
        if coverage < level:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


if __name__ == "__main__":
    main()
