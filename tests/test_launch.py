"""launch on threads, gloo processes and torchrun: results in rank order, failures named and fast."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from colfunc.sharding import Mesh, RankFailedError, comm, launch, run_cli
from colfunc.sharding.launch import torchrun_argv

pytestmark = pytest.mark.timeout(60)


def rank_sum(mesh: Mesh) -> tuple[int, list[float]]:
    """Module level, so that gloo processes can import it."""
    x = torch.tensor([float(mesh.rank + 1)])
    return mesh.rank, comm.all_reduce(x, tuple(mesh.axis_names)).tolist()


def fail_on_rank_one(mesh: Mesh) -> None:
    if mesh.rank == 1:
        raise ValueError("bad shard on rank one")
    comm.all_reduce(torch.ones(1), "dp")  # the others wait here until they are stopped


def test_threads_results_in_rank_order() -> None:
    got = launch(rank_sum, {"dp": 2, "tp": 3})
    assert got == [(r, [21.0]) for r in range(6)]


def test_failure_on_one_rank_releases_the_others() -> None:
    seen: dict[int, BaseException] = {}
    lock = threading.Lock()

    def fn(mesh: Mesh) -> None:
        if mesh.rank == 2:
            time.sleep(0.2)  # the others are waiting in the collective by now
            raise ValueError("bad shard on rank two")
        try:
            comm.all_gather(torch.ones(1), "dp")
        except RankFailedError as e:
            with lock:
                seen[mesh.rank] = e
            raise

    start = time.monotonic()
    with pytest.raises(
        RankFailedError, match="rank 2 failed: ValueError: bad shard on rank two"
    ) as info:
        launch(fn, {"dp": 4}, timeout=30)
    assert time.monotonic() - start < 5
    assert info.value.rank == 2 and isinstance(info.value.__cause__, ValueError)
    assert sorted(seen) == [0, 1, 3]
    assert all(e.rank == 2 and "all_gather(axis='dp'" in str(e) for e in seen.values())


def test_failure_while_others_compute_returns_after_the_grace() -> None:
    def fn(mesh: Mesh) -> None:
        if mesh.rank == 0:
            raise KeyError("early")
        time.sleep(3)  # no collective to be released from

    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"ranks \[1\] did not stop within 0.5 s"):
        launch(fn, {"dp": 2}, timeout=0.5)
    assert time.monotonic() - start < 2


def test_a_rank_that_never_returns_fails_the_launch_after_the_timeout() -> None:
    """One rank loops without ever calling a collective while the other returns: the launch
    ends within its timeout, naming the rank still running, instead of waiting forever."""
    stop = threading.Event()

    def fn(mesh: Mesh) -> int:
        while mesh.rank == 1 and not stop.is_set():
            time.sleep(0.01)
        return mesh.rank

    t0 = time.monotonic()
    try:
        with pytest.raises(
            RankFailedError, match=r"ranks \[1\] were still running 0.5 s after rank 0"
        ):
            launch(fn, {"dp": 2}, timeout=0.5)
    finally:
        stop.set()
    assert time.monotonic() - t0 < 5.0


def test_gloo_results_and_failure() -> None:
    assert launch(rank_sum, {"dp": 2}, backend="gloo") == [(0, [3.0]), (1, [3.0])]
    start = time.monotonic()
    with pytest.raises(
        RankFailedError, match="rank 1 failed: ValueError: bad shard on rank one"
    ) as info:
        launch(fail_on_rank_one, {"dp": 2}, backend="gloo", timeout=30)
    assert time.monotonic() - start < 15  # the waiting rank is stopped, not left to time out
    assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"backend": "mpi"}, ValueError, "'mpi'"),
        ({"timeout": 0}, ValueError, "timeout.*got 0"),
        ({"mesh": {"dp": 0}}, ValueError, "'dp' must be a positive int; got 0"),
        ({"fn": 3}, TypeError, "callable; got 3"),
        ({"fn": lambda m: m, "backend": "gloo"}, TypeError, "module level"),
        ({"backend": "env"}, RuntimeError, "RANK and WORLD_SIZE"),
    ],
)
def test_bad_launch_arguments(
    kwargs: dict, error: type, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    args = {"fn": rank_sum, "mesh": {"dp": 2}, **kwargs}
    with pytest.raises(error, match=match):
        launch(args.pop("fn"), **args)


def test_env_mesh_must_match_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        ValueError, match="mesh \\{'dp': 2\\} has 2 ranks but torchrun started WORLD_SIZE=3"
    ):
        launch(rank_sum, {"dp": 2}, backend="env")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_without_cuda_says_so() -> None:
    with pytest.raises(ValueError, match="needs CUDA devices"):
        launch(rank_sum, {"dp": 2}, backend="nccl")


def test_torchrun_argv() -> None:
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert torchrun_argv(4, "s.py", ["--x", 1]) == [*head, "--standalone", "s.py", "--x", "1"]
    multi = torchrun_argv(
        4, "s.py", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400
    )
    assert multi == [
        *head,
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=29400",
        "s.py",
    ]
    with pytest.raises(ValueError, match="node_rank=2 must be below nnodes=2"):
        run_cli(1, "s.py", nnodes=2, node_rank=2)


SCRIPT = """
import json, os, sys
import torch
from colfunc.sharding import comm, launch

def fn(mesh):
    return comm.all_gather(torch.tensor([float(mesh.rank)]), "dp").tolist()

results = launch(fn, {"dp": 2}, backend="env")
if os.environ["RANK"] == "0":
    with open(sys.argv[1], "w") as f:
        json.dump([results, sys.argv[2:]], f)
"""


def test_run_cli_under_torchrun(tmp_path: Path) -> None:
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    script.write_text(textwrap.dedent(SCRIPT))
    with socket.socket() as s:  # torchrun's static rendezvous takes the port it is given
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = run_cli(2, str(script), [str(out), "--flag"], master_addr="127.0.0.1", master_port=port)
    assert code == 0
    assert json.loads(out.read_text()) == [[[0.0, 1.0], [0.0, 1.0]], ["--flag"]]


LINGER = """
import os, sys, time
from colfunc.sharding import launch

def fn(mesh):
    with open(os.path.join(sys.argv[1], f"rank{mesh.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)  # far longer than the test waits

launch(fn, {"dp": 2}, backend="env")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped by its dead parent's reaper yet) is not running
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_ranks_die_with_a_killed_colfunc_run(tmp_path: Path) -> None:
    """SIGKILL of the colfunc run process (torchrun's agent, in it) stops its ranks: each asked
    the kernel for SIGTERM when its parent dies, instead of running on with nobody watching."""
    script = tmp_path / "linger.py"
    script.write_text(textwrap.dedent(LINGER))
    parent = subprocess.Popen(
        [sys.executable, "-m", "colfunc", "run", "-n", "2", str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()
        for p in tmp_path.glob("rank*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p.read_text()), signal.SIGKILL)
