"""The torch.distributed backend: gloo on CPU, NCCL on GPU, one process per rank.

Process groups are created once, when the world is built: one per ordered group of every ordered
tuple of axes (``new_group(..., sort_ranks=False)``, so a group's rank order is the mesh's group
order and ``all_gather`` concatenates in it). Creating them lazily would need every rank to
create every group in the same order at an unpredictable time; creating them all up front is
cheap (gloo connects lazily) for meshes of a few axes.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import itertools
import os
import pickle
import queue as queue_lib
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colfunc import core
from colfunc.sharding import host_malloc
from colfunc.sharding.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    RankFailedError,
)
from colfunc.sharding.ledger import Ledger
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.world import Call

__all__ = ["TorchWorld", "run_env", "run_processes"]

_RED = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_timeout = {"seconds": 0.0}  # the collective timeout the process group was made with
_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused", "EOF")


@contextlib.contextmanager
def _named(rank: int, what: Callable[[], str]) -> Any:
    """A backend error from a collective, as one that names the rank and the collective."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CollectiveMismatchError | CollectiveTimeoutError | PeerLostError):
            raise
        if isinstance(e, RankFailedError):
            raise
        text = str(e)
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CollectiveTimeoutError(
                f"rank {rank}: {what()} did not complete within the collective timeout "
                f"({_timeout['seconds']:g} s): a rank of its group never reached it (hung, or "
                f"in another collective); raise the launch's timeout if it is only slow"
            ) from e
        if any(k in text for k in _GONE):
            raise PeerLostError(
                f"rank {rank}: {what()} failed because a rank of its group is gone "
                f"({first[:160]}); the rank that stopped first says why"
            ) from e
        raise


class TorchWorld:
    """This process's rank of a torch.distributed world, with a process group per mesh group."""

    def __init__(self, shape: Mapping[str, int], rank: int) -> None:
        self.name = str(dist.get_backend())
        self.size = dist.get_world_size()
        self._ledger = Ledger()
        self._groups: dict[tuple[int, ...], Any] = {}
        self._created: set[tuple[int, ...]] = set()
        self._rank = rank
        self.add_layout(shape)

    def add_layout(self, shape: Mapping[str, int]) -> None:
        """Create the process groups of another mesh shape over this world, so that a
        ``Mesh(shape, rank, world=this)`` runs collectives here too (a benchmark comparing
        layouts in one set of processes). Every rank must call it, with the same shapes in the
        same order."""
        layout = Mesh(shape, self._rank)
        if layout.size != self.size:
            raise ValueError(
                f"mesh {dict(shape)} has {layout.size} ranks but the torch.distributed world has "
                f"{self.size}; make the product of the axis sizes equal the world size"
            )
        everyone = tuple(range(self.size))
        names = layout.axis_names
        # Every rank walks the same sequence: new_group must be called by all ranks in one order.
        for k in range(1, len(names) + 1):
            for axes in itertools.permutations(names, k):
                for group in layout.groups(axes):
                    if len(group) == 1 or group in self._created:
                        continue
                    self._created.add(group)
                    if group == everyone:
                        pg = dist.group.WORLD
                    else:
                        pg = dist.new_group(list(group), sort_ranks=False)
                    if self._rank in group:
                        self._groups[group] = pg

    def ledger(self, rank: int) -> Ledger:
        return self._ledger

    def process_group(self, ranks: tuple[int, ...]) -> Any:
        """The process group of an ordered group of ranks (``mesh.group_ranks(axes)``), for raw
        torch.distributed calls beside ours."""
        return self._groups[tuple(ranks)]

    def collective(self, rank: int, call: Call, x: torch.Tensor) -> torch.Tensor:
        with _named(rank, lambda: call.describe(x)):
            self._check_same(rank, call, x)
            return self._collective(rank, call, x)

    def _check_same(self, rank: int, call: Call, x: torch.Tensor) -> None:
        """Under ``COLFUNC_DEBUG_COLLECTIVES=1``: every rank of the group says what it is about
        to call (a small exchange of descriptions, as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does),
        and all raise :class:`CollectiveMismatchError` if they differ, instead of handing the
        backend calls that hang or abort."""
        if os.environ.get("COLFUNC_DEBUG_COLLECTIVES", "0") in ("", "0"):
            return
        mine = call.describe(x)
        said: list[Any] = [None] * len(call.group)
        dist.all_gather_object(said, (rank, mine), group=self._groups[call.group])
        if len({what for _, what in said}) > 1:
            calls = "; ".join(f"rank {r} called {what}" for r, what in sorted(said))
            raise CollectiveMismatchError(
                f"rank {rank}: ranks {call.group} entered different collectives: {calls}"
            )

    def _collective(self, rank: int, call: Call, x: torch.Tensor) -> torch.Tensor:
        # dim 0 is the common case and the layout the single-tensor ops work in: no reshuffle
        pg, op, n = self._groups[call.group], call.op, len(call.group)
        if op == "all_reduce":
            out = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, op=_RED[call.reduce], group=pg)
            return out
        if op == "all_gather":
            out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # gloo concatenates along dim 0 only
            _all_gather_single(out, x.contiguous(), group=pg)
            d = call.dim
            return out.view(n, *x.shape).movedim(0, d).flatten(d, d + 1) if d else out
        if op == "all_to_all_v":
            send, recv = call.sizes
            out = x.new_empty((sum(recv), *x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=pg)
            return out
        if op in ("reduce_scatter", "all_to_all"):
            d = call.dim if op == "reduce_scatter" else call.split_dim
            c = x.shape[d] // n
            # with d moved to the front, chunk j along d is rows [j*c, (j+1)*c): what the ops split
            xs = x.movedim(d, 0).contiguous() if d else x.contiguous()
            if op == "reduce_scatter":
                if self.name == "gloo":
                    got = torch.empty_like(xs)
                    dist.all_to_all_single(got, xs, group=pg)
                    out = _sum_rows(got, n)
                else:
                    out = x.new_empty((c, *xs.shape[1:]))
                    _reduce_scatter_single(out, xs, group=pg)
                return out.movedim(0, d).contiguous() if d else out
            got = torch.empty_like(xs)
            dist.all_to_all_single(got, xs, group=pg)
            cd = call.concat_dim
            if d == 0 and cd == 0:
                return got
            got = got.unflatten(0, (n, c)).movedim(1, d + 1)  # [n, *chunk shape]
            return got.movedim(0, cd).flatten(cd, cd + 1)
        if op == "ppermute":
            return self._ppermute(call, x, call.group.index(rank), pg)
        out = x.clone(memory_format=torch.contiguous_format)
        if op == "broadcast":
            dist.broadcast(out, src=call.group[call.root], group=pg)
        elif op == "reduce":
            dist.reduce(out, dst=call.group[call.root], op=dist.ReduceOp.SUM, group=pg)
            if call.group.index(rank) != call.root:  # only the destination's buffer holds the sum
                out.zero_()
        else:
            raise ValueError(f"unknown collective {op!r}")
        return out

    def start(self, rank: int, call: Call, x: torch.Tensor) -> _Request:
        with _named(rank, lambda: call.describe(x)):
            self._check_same(rank, call, x)
            request = self._start(rank, call, x)
        request.name = (rank, lambda: call.describe(x))
        return request

    def _start(self, rank: int, call: Call, x: torch.Tensor) -> _Request:
        pg = self._groups[call.group]
        buf = x if x.is_contiguous() else x.contiguous()
        if call.op == "all_reduce":
            work = dist.all_reduce(buf, op=_RED[call.reduce], group=pg, async_op=True)
            return _Request(work, buf)
        if call.op == "all_gather" and call.dim == 0:
            out = buf.new_empty((len(call.group) * buf.shape[0], *buf.shape[1:]))
            work = _all_gather_single(out, buf, group=pg, async_op=True)
            return _Request(work, out, keep=buf)
        if call.op == "reduce_scatter" and call.dim == 0:
            n = len(call.group)
            if self.name == "gloo":  # see _sum_rows
                got = torch.empty_like(buf)
                work = dist.all_to_all_single(got, buf, group=pg, async_op=True)
                return _Request(work, got, keep=buf, then=lambda t: _sum_rows(t, n))
            out = buf.new_empty((buf.shape[0] // n, *buf.shape[1:]))
            work = _reduce_scatter_single(out, buf, group=pg, async_op=True)
            return _Request(work, out, keep=buf)
        if call.op == "ppermute":
            i = call.group.index(rank)
            p2p, out = self._ppermute_ops(call, buf, i, pg)
            works = _Works(list(dist.batch_isend_irecv(p2p)) if p2p else [])
            return _Request(works, out, keep=buf)
        raise ValueError(
            f"{call.describe(x)}: only all_reduce, ppermute, and all_gather and reduce_scatter "
            "along dim 0, can be started asynchronously"
        )

    def send(self, rank: int, dst: int, x: torch.Tensor, tag: int) -> _Request:
        x = x.contiguous()  # kept alive by the request until the transfer is done
        return _Request(dist.isend(x, dst, tag=tag), x)

    def recv(
        self,
        rank: int,
        src: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
        device: Any,
    ) -> _Request:
        if device is None:
            device = torch.device("cuda") if self.name == "nccl" else torch.device("cpu")
        out = torch.empty(shape, dtype=dtype, device=device)
        return _Request(dist.irecv(out, src, tag=tag), out)

    def _ppermute_ops(
        self, call: Call, xc: torch.Tensor, i: int, pg: Any
    ) -> tuple[list[Any], torch.Tensor]:
        """The sends and receives of group index ``i`` in a ppermute, and its output buffer."""
        out = None
        p2p = []
        for s, d in call.perm:
            if s == i and d != i:
                p2p.append(dist.P2POp(dist.isend, xc, call.group[d], group=pg))
            if d == i:
                if s == i:
                    out = xc.clone(memory_format=torch.contiguous_format)
                else:
                    out = torch.empty_like(xc)
                    p2p.append(dist.P2POp(dist.irecv, out, call.group[s], group=pg))
        return p2p, out if out is not None else torch.zeros_like(xc)

    def _ppermute(self, call: Call, x: torch.Tensor, i: int, pg: Any) -> torch.Tensor:
        p2p, out = self._ppermute_ops(call, x.contiguous(), i, pg)
        if p2p:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()
        return out


def _sum_rows(got: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of the ``n`` chunks of ``got`` along dim 0 (every member's chunk for this one, in
    group order), added one after another as the threads backend sums.

    Gloo's reduce-scatter is slower than its all-reduce of the same tensor (about 5 ms against 3
    for 3.4 MB on 2 processes); an all-to-all sends the same ``(n-1)/n`` of the input per rank as
    a ring reduce-scatter does and takes about 1.5 ms, and this sum another 0.3."""
    rows = got.view(n, -1, *got.shape[1:])
    acc = rows[0].clone()
    for r in rows[1:]:
        acc.add_(r)
    return acc


class _Works:
    """Several transfers in flight, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class _Request:
    """An ``isend`` or ``irecv`` in progress and the buffer it reads or fills."""

    def __init__(
        self,
        work: Any,
        buffer: torch.Tensor,
        keep: Any = None,
        then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.work, self.buffer = work, buffer
        self.keep = keep  # an input the transfer still reads
        self.then = then  # what makes the result of the received buffer, once
        self.name: tuple[int, Callable[[], str]] | None = None  # (rank, what) for errors

    def wait(self) -> torch.Tensor:
        """Wait for the transfer; the received tensor (for a send, the tensor sent)."""
        rank, what = self.name or (int(dist.get_rank()), lambda: "a point-to-point transfer")
        with _named(rank, what):
            self.work.wait()
        self.keep = None
        if self.then is not None:
            self.buffer, self.then = self.then(self.buffer), None
        return self.buffer


# --- launching -------------------------------------------------------------------------------


def _to_cpu(result: Any) -> Any:
    # Results cross a process boundary: no autograd graph, no device memory.
    return optree.tree_map(
        lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, result, none_is_leaf=True
    )


def _init(backend: str, rank: int, size: int, timeout: float, store: Any = None) -> None:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    td = datetime.timedelta(seconds=timeout)
    _timeout["seconds"] = float(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=td)


def _colfunc_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("COLFUNC_")}


def _worker(
    fn_bytes: bytes,
    shape: dict[str, int],
    rank: int,
    backend: str,
    port: int,
    timeout: float,
    results: Any,
    env: dict[str, str] | None = None,
) -> None:
    size = Mesh(shape).size
    if env is not None:
        for key in [k for k in os.environ if k.startswith("COLFUNC_") and k not in env]:
            del os.environ[key]
        os.environ.update(env)
    try:
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            # the ranks share this machine's cores, as torchrun assumes too
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        if backend == "gloo" and host_malloc.wanted():
            host_malloc.keep_freed_memory()  # no step faults its activations in afresh
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=td)
        _init(backend, rank, size, timeout, store)
        fn = pickle.loads(fn_bytes)
        mesh = Mesh(shape, rank, world=TorchWorld(shape, rank))
        with core.context(mesh):
            result = fn(mesh)
        buf = io.BytesIO()
        torch.save(_to_cpu(result), buf)
        dist.barrier()  # no rank tears down its connections while a peer still reads from them
        results.put(("ok", rank, buf.getvalue()))
    except BaseException as e:
        try:
            blob = pickle.dumps(e)
        except Exception:
            blob = None
        results.put(("error", rank, (traceback.format_exc(), blob)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def _rank_error(rank: int, payload: tuple[str, bytes | None]) -> RankFailedError:
    tb, blob = payload
    exc: BaseException = _RemoteTraceback(tb)
    if blob is not None:
        try:
            original = pickle.loads(blob)
            original.__cause__ = exc  # the traceback from the rank's process
            exc = original
        except Exception:
            pass
    error = RankFailedError(f"rank {rank} failed: {type(exc).__name__}: {exc}", rank=rank)
    error.__cause__ = exc
    return error


def _process_context() -> Any:
    # A fork server imports torch once and forks every rank from it: on a small machine that
    # is seconds saved per launch against spawning fresh interpreters. It never touches CUDA.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["colfunc.sharding"])
        return ctx
    return mp.get_context("spawn")


def run_processes(
    fn: Callable[[Mesh], Any], shape: dict[str, int], backend: str, timeout: float
) -> list[Any]:
    """Run ``fn(mesh)`` in one spawned process per rank; the results in rank order."""
    size = Mesh(shape).size
    host_malloc.wanted()  # a bad COLFUNC_MALLOC is refused here, before any rank starts
    if backend == "nccl" and torch.cuda.device_count() == 0:
        raise ValueError(
            "launch: backend='nccl' needs CUDA devices and none is visible; use 'gloo'"
        )
    try:
        # plain pickle, so tensors inside fn (a partial, say) travel as bytes, not as shared
        # memory handles: one file descriptor per tensor would exhaust the fork server's limit
        fn_bytes = pickle.dumps(fn)
    except Exception as e:
        raise TypeError(
            f"launch(backend={backend!r}) sends fn to fresh processes, so it must be picklable: "
            f"a function defined at module level; got {fn!r}"
        ) from e
    # The parent owns the rendezvous store: port 0 lets the OS pick a free port, with no race.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _process_context()
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            # the caller's COLFUNC_* settings as they are now: a fork server's children
            # would otherwise see the environment the server started with
            args=(fn_bytes, shape, r, backend, store.port, timeout, results_q, _colfunc_env()),
            name=f"colfunc-rank-{r}",
        )
        for r in range(size)
    ]
    results: list[Any] = [None] * size
    done: set[int] = set()
    try:
        for p in procs:
            p.start()
        while len(done) < size:
            try:
                kind, rank, payload = results_q.get(timeout=0.05)
            except queue_lib.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead and results_q.empty():
                    r = dead[0]
                    raise RankFailedError(
                        f"rank {r} exited with code {procs[r].exitcode} without a result", rank=r
                    ) from None
                continue
            if kind == "error":
                raise _rank_error(rank, payload)
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            done.add(rank)
        for p in procs:
            p.join(timeout)
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:  # after a failure the others may wait in a collective: stop them now
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        results_q.close()
    return results


def _env_store(rank: int, size: int, timeout: float) -> Any:
    """The rendezvous store under torchrun, its keys prefixed by the restart count: after an
    elastic restart the agent's store still holds the addresses the dead group published, and a
    rank that read one would connect to a process that is gone. None outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # hosted by the agent
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        is_master=not agent and rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dist.PrefixStore(f"colfunc/attempt_{attempt}", base)


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux): a rank under
    torchrun whose agent (``colfunc run``) is killed, even by SIGKILL, stops instead of training
    on with nobody watching (``colfunc train`` saves on SIGTERM, then exits)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # (not allowed here: nothing else to do)
    if os.getppid() == 1:  # the parent died before the request: as if it had just now
        os.kill(os.getpid(), signal.SIGTERM)


def run_env(fn: Callable[[Mesh], Any], shape: dict[str, int], timeout: float) -> list[Any]:
    """Run ``fn(mesh)`` as this process's rank under torchrun; every rank's result, in rank order."""
    die_with_parent()
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        raise RuntimeError(
            "launch(backend='env') needs RANK and WORLD_SIZE, as torchrun sets them; run the "
            "script with `colfunc run -n N script.py` or `torchrun --nproc-per-node N script.py`"
        ) from None
    mesh_size = Mesh(shape).size
    if mesh_size != size:
        raise ValueError(
            f"launch: mesh {shape} has {mesh_size} ranks but torchrun started WORLD_SIZE={size}; "
            "make the product of the axis sizes equal the number of processes"
        )
    owned = not dist.is_initialized()
    if owned:
        _init(
            "nccl" if torch.cuda.is_available() else "gloo",
            rank,
            size,
            timeout,
            _env_store(rank, size, timeout),
        )
    try:
        mesh = Mesh(shape, rank, world=TorchWorld(shape, rank))
        try:
            with core.context(mesh):
                result = fn(mesh)
        except BaseException as e:
            raise RankFailedError(f"rank {rank} failed: {type(e).__name__}: {e}", rank=rank) from e
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, _to_cpu(result))
        return gathered
    finally:
        if owned:
            dist.destroy_process_group()
