"""``launch``: run one SPMD function on every rank of a mesh, and ``run_cli`` for torchrun."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from colfunc.sharding.mesh import Mesh

__all__ = ["launch", "run_cli"]

BACKENDS = ("threads", "gloo", "nccl", "env")


def launch(
    fn: Callable[[Mesh], Any],
    mesh: Mapping[str, int] | Mesh,
    backend: str = "threads",
    timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(mesh)`` on every rank and return the per-rank results in rank order.

    ``mesh`` is ``{axis: size}`` (or a :class:`Mesh`, whose shape is used); inside ``fn`` the
    rank's mesh is also :func:`current_mesh`. Backends:

    - ``"threads"``: one thread per rank in this process (tests, notebooks, research);
    - ``"gloo"`` / ``"nccl"``: one fresh process per rank (``fn`` must be importable, i.e. defined
      at module level); results come back through a queue, tensors moved to the CPU;
    - ``"env"``: this process is one rank under ``torchrun`` (``colfunc run``); every rank returns
      all ranks' results.

    ``timeout`` (seconds) bounds how long a collective waits for the rest of its group, and how
    long the other ranks get to stop after one fails. An exception on any rank is raised here as
    :class:`RankFailedError` naming the rank, chained to the original.

    >>> launch(lambda m: comm.all_reduce(torch.tensor(m.rank), "dp"), mesh={"dp": 2})
    [tensor(1), tensor(1)]
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable; got {fn!r}")
    shape = Mesh(mesh).shape  # validates names and sizes
    if backend not in BACKENDS:
        raise ValueError(f"launch: backend must be one of {BACKENDS}; got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"launch: timeout must be a positive number of seconds; got {timeout!r}")
    if backend == "threads":
        from colfunc.sharding.threads import run_threads

        return run_threads(fn, shape, float(timeout))
    from colfunc.sharding import torch_dist

    if backend == "env":
        return torch_dist.run_env(fn, shape, float(timeout))
    return torch_dist.run_processes(fn, shape, backend, float(timeout))


def run_cli(
    n: int,
    script: str,
    args: Sequence[str] = (),
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``script args`` as ``n`` ranks per node under torchrun's elastic agent (in this
    process); return the exit code.

    The script calls ``launch(fn, mesh, backend="env")``. On one node without an address a free
    port is picked (``--standalone``); otherwise ``--nnodes``, ``--node-rank``, ``--master-addr``
    and ``--master-port`` are passed through, as torchrun's static rendezvous needs on each node.
    ``max_restarts``: how many times the agent restarts the whole group after a rank fails
    (``colfunc train`` then resumes from the run's latest checkpoint).

    SIGINT and SIGTERM reach every rank (which, under ``colfunc train``, stop after the step in
    progress and save); the exit code is then 128 + the signal. A failed rank is one line on
    stderr, ``colfunc run: rank R failed (...)`` (the rank's own error precedes it); the exit code
    is 2 when every failed rank exited 2 (bad input), else the first failure's.
    """
    for name, value, low in (
        ("n", n, 1),
        ("nnodes", nnodes, 1),
        ("node_rank", node_rank, 0),
        ("max_restarts", max_restarts, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"run_cli: {name} must be an int >= {low}; got {value!r}")
    if node_rank >= nnodes:
        raise ValueError(f"run_cli: node_rank={node_rank} must be below nnodes={nnodes}")
    argv = torchrun_argv(
        n,
        script,
        args,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
    )
    # one name for the run on every rank, as a threads run is named: <config>-<date>-<time>
    if nnodes == 1:
        os.environ.setdefault("COLFUNC_RUN_STAMP", time.strftime("%Y%m%d-%H%M%S"))
    return _torchrun(argv[3:])  # without "python -m torch.distributed.run"


def _torchrun(argv: list[str]) -> int:
    import signal

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    handlers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    previous = {s: signal.getsignal(s) for s in handlers}
    # the ranks say what failed, one line each; the agent's own log would add a screenful
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except SignalException as e:  # the agent stopped the ranks with the same signal
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        # the agent stops the other ranks with SIGTERM once one fails: those are not causes
        causes = [(r, f) for r, f in failures if f.exitcode != -signal.SIGTERM] or failures
        codes = []
        for rank, failure in causes:
            code = failure.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            print(f"colfunc run: rank {rank} failed ({how})", file=sys.stderr, flush=True)
            codes.append(128 - code if code < 0 else code)
        return 2 if all(c == 2 for c in codes) else codes[0]
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)
    return 0


def torchrun_argv(
    n: int,
    script: str,
    args: Sequence[str] = (),
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line of :func:`run_cli` (``python -m torch.distributed.run``)."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}"]
    if max_restarts:
        argv.append(f"--max-restarts={max_restarts}")
    if nnodes == 1 and master_addr is None and master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}"]
        argv += [f"--master-addr={master_addr or '127.0.0.1'}"]
        if master_port is not None:
            argv.append(f"--master-port={master_port}")
    return [*argv, script, *map(str, args)]
