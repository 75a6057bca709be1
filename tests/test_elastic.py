"""``colfunc run`` under faults, on gloo processes: a rank SIGKILLed mid-run is restarted by
torchrun's agent and training resumes from the last checkpoint, ending bit for bit where an
uninterrupted run ends; SIGTERM to ``colfunc run`` stops every rank, which save."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colfunc import checkpoint, tree
from colfunc import train as trainer

SETS = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.batch_size=4",
    "train.log_every=1",
    "train.eval_every=100000",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "train.save_every=4",
    "parallel.data=2",
]


def _cmd(out: Path, name: str, steps: int, *extra: str) -> list[str]:
    sets = [*SETS, f"train.out_dir={out}", f"train.name={name}", f"train.steps={steps}"]
    return [
        sys.executable,
        "-m",
        "colfunc",
        "run",
        "-n",
        "2",
        *extra,
        "train",
        "--no-progress",
        *(a for s in sets for a in ("--set", s)),
    ]


def _step(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if x.strip()), default=-1)


def _rank_pids(parent: int) -> dict[int, int]:
    """The worker processes under ``parent`` (the agent), by their RANK."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid != parent:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(entry.name)
    return out


def _until(what, limit: float, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not what():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _same_final(a: Path, b: Path) -> None:
    sa, _ = trainer.load_run(a)
    sb, _ = trainer.load_run(b)
    assert sa.step == sb.step
    for part in ("params", "opt_state"):
        fa, fb = (
            tree.flatten_with_paths(getattr(sa, part))[0],
            tree.flatten_with_paths(getattr(sb, part))[0],
        )
        assert [p for p, _ in fa] == [p for p, _ in fb]
        for (p, x), (_, y) in zip(fa, fb):
            assert x.equal(y) if hasattr(x, "equal") else x == y, (part, p)


@pytest.mark.slow  # kills a rank, torchrun restarts the group: about 20 s
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    steps = 24
    straight = subprocess.run(
        _cmd(tmp_path, "straight", steps), env=env, capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr

    proc = subprocess.Popen(
        _cmd(tmp_path, "killed", steps, "--max-restarts", "1"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "killed"
    store = run / trainer.CHECKPOINTS
    _until(lambda: _step(run) >= 9 and checkpoint.steps(store), 240, proc)
    pids = _rank_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    t_kill = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    # the survivor stops (a collective fails against the dead rank, within the timeout), the
    # agent starts a new group, and it resumes from the latest checkpoint
    _until(
        lambda: (
            _rank_pids(proc.pid).keys() == {0, 1} and pids[0] not in _rank_pids(proc.pid).values()
        ),
        120,
        proc,
    )
    restarted_in = time.monotonic() - t_kill
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "colfunc: restarted by torchrun; resuming from step" in err
    # the survivor's one line names its rank, the collective and what happened
    assert re.search(r"colfunc: error: rank 0: \w+\(axis='dp'.*a rank of its group is gone", err), (
        err
    )
    assert "Traceback" not in err
    assert restarted_in < 60
    _same_final(run, tmp_path / "straight")


def test_sigterm_to_colfunc_run_stops_every_rank_which_save(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _cmd(tmp_path, "cut", 100000),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "cut"
    _until(lambda: _step(run) >= 6, 240, proc)
    ranks = list(_rank_pids(proc.pid).values())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM at step" in err and "Traceback" not in err, err
    for pid in ranks:  # no rank is left training
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
    state, _ = trainer.load_run(run)
    assert state.step == _step(run) >= 6


@pytest.mark.slow  # two torchrun agents and a training run: about 15 s
def test_two_agents_on_one_machine_stand_for_two_nodes(tmp_path: Path) -> None:
    """``colfunc run --nnodes 2 --node-rank R --master-addr A --master-port P``: one agent per
    "machine", one rank each; the run equals the same data=2 run started by one agent."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    steps = 8

    def node(rank: int) -> subprocess.Popen:
        cmd = _cmd(tmp_path, "nodes", steps)
        i = cmd.index("-n")
        cmd[i : i + 2] = ["-n", "1", "--nnodes", "2", "--node-rank", str(rank)]
        cmd[i + 6 : i + 6] = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    agents = [node(0), node(1)]
    for a in agents:
        _, err = a.communicate(timeout=300)
        assert a.returncode == 0, err
    one = subprocess.run(
        _cmd(tmp_path, "one", steps), env=env, capture_output=True, text=True, timeout=300
    )
    assert one.returncode == 0, one.stderr
    _same_final(tmp_path / "nodes", tmp_path / "one")
