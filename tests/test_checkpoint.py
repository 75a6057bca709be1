"""Checkpoints round-trip exactly, fail clearly, write atomically; resumed runs continue exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import colfunc as cf
from colfunc import checkpoint, config, data, optim, tree
from colfunc import train as trainer
from colfunc.models import gpt

TINY = gpt.Config(vocab_size=256, n_layer=1, n_head=2, d_model=32, max_seq_len=16)


def _state() -> cf.TrainState:
    """A real TrainState after one AdamW step, with every kind of leaf in ``extra``."""
    step = cf.train_step(
        gpt.loss(TINY), optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    )
    state = step.init(gpt.init(TINY, seed=3))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    state, _ = step(state, {"input_ids": ids, "labels": ids})
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    extra = {
        "loss_scale": torch.tensor(2.0**15),
        "flags": torch.tensor([True, False]),
        "counts": torch.tensor([1, 2, 3], dtype=torch.int64),
        "half": torch.randn(3, dtype=torch.bfloat16),
        "view": base.t(),  # non-contiguous
        "shared": [base, base[1]],  # two leaves on one storage
        "empty": torch.zeros(0, 5),
        "numbers": (1, 2.5, -0.0, float("inf")),
        "misc": {"name": "run", "on": True, "nothing": None, "big": 2**62},
    }
    return state._replace(extra=extra)


def _assert_same(a: Any, b: Any) -> None:
    assert tree.structure(a) == tree.structure(b)
    assert type(a) is type(b)
    for (pa, xa), (pb, xb) in zip(tree.flatten_with_paths(a)[0], tree.flatten_with_paths(b)[0]):
        assert pa == pb and type(xa) is type(xb), pa
        if isinstance(xa, torch.Tensor):
            assert xa.dtype == xb.dtype and torch.equal(xa, xb), pa
        else:
            assert xa == xb or (xa != xa and xb != xb), pa


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = _state()
    cfg = config.load(None, ["model.n_layer=1", "train.name=x"])
    checkpoint.save(tmp_path / "ck", state, cfg)
    loaded, loaded_cfg = checkpoint.load(tmp_path / "ck")
    _assert_same(loaded, state)
    assert isinstance(loaded.opt_state[1], optim.AdamState)
    assert loaded.opt_state[1].max_exp_avg_sq is None
    assert loaded_cfg == cfg
    # the tensors are readable by any safetensors tool, under their dotted paths
    raw = safetensors.torch.load_file(str(tmp_path / "ck" / checkpoint.TENSORS))
    assert torch.equal(raw["params.embed.tokens"], state.params["embed"]["tokens"])


def test_plain_json_config_and_no_config(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "step": 4}
    checkpoint.save(tmp_path / "a", state, {"lr": 0.1, "tags": ["x"]})
    assert checkpoint.load(tmp_path / "a")[1] == {"lr": 0.1, "tags": ["x"]}
    checkpoint.save(tmp_path / "b", state)
    loaded, cfg = checkpoint.load(tmp_path / "b")
    assert cfg is None and loaded["step"] == 4


def test_unstorable_leaves_are_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"set at 'extra\.bad'"):
        checkpoint.save(tmp_path / "ck", {"extra": {"bad": {1, 2}}})
    assert list(tmp_path.iterdir()) == []


def _corrupt(path: Path, how: str) -> str:
    """Damage the checkpoint at ``path``; returns the file name the error must mention."""
    if how == "no folder":
        return str(path.parent / "nothing")
    if how == "no meta":
        (path / checkpoint.META).unlink()
        return checkpoint.META
    if how == "no tensors":
        (path / checkpoint.TENSORS).unlink()
        return checkpoint.TENSORS
    if how == "bad json":
        (path / checkpoint.META).write_text('{"format": ')
        return checkpoint.META
    if how == "foreign json":
        (path / checkpoint.META).write_text('{"hello": 1}')
        return checkpoint.META
    if how == "truncated tensors":
        blob = (path / checkpoint.TENSORS).read_bytes()
        (path / checkpoint.TENSORS).write_bytes(blob[: len(blob) // 2])
        return checkpoint.TENSORS
    if how == "missing tensor":
        safetensors.torch.save_file({"other": torch.ones(1)}, str(path / checkpoint.TENSORS))
        return "params.w"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "no folder",
        "no meta",
        "no tensors",
        "bad json",
        "foreign json",
        "truncated tensors",
        "missing tensor",
    ],
)
def test_damaged_checkpoints_fail_naming_the_file(tmp_path: Path, how: str) -> None:
    path = tmp_path / "ck"
    checkpoint.save(path, {"params": {"w": torch.randn(64, 64)}, "step": 1})
    needle = _corrupt(path, how)
    target = tmp_path / "nothing" if how == "no folder" else path
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(needle)):
        checkpoint.load(target)


def test_failed_write_leaves_the_old_checkpoint_and_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ck"
    old = {"w": torch.zeros(3)}
    checkpoint.save(path, old)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(json, "dumps", crash)  # fails after the tensors are written
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"w": torch.ones(3)})
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path / "fresh", {"w": torch.ones(3)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert torch.equal(checkpoint.load(path)[0]["w"], old["w"])
    checkpoint.save(path, {"w": torch.ones(3)})  # replacing works and leaves no debris
    assert torch.equal(checkpoint.load(path)[0]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_save_never_overwrites_something_else(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a checkpoint"):
        checkpoint.save(tmp_path / "notes", {"w": torch.ones(1)})
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def _tiny_run(corpus: Path, **train: Any) -> config.RunConfig:
    sets = {
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.n_head": 2,
        "model.max_seq_len": 16,
        "data.corpus": corpus,
        "data.seq_len": 16,
        "data.batch_size": 4,
        "train.steps": 20,
        "train.log_every": 5,
        "train.eval_every": 10,
        "train.eval_batches": 2,
        "train.sample_tokens": 0,
        "optim.warmup_steps": 5,
        "optim.lr": 1e-2,
        **{f"train.{k}": v for k, v in train.items()},
    }
    return config.load(None, [f"{k}={v}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 5)
    return root


def test_resume_continues_exactly(corpus: Path, tmp_path: Path) -> None:
    cfg = _tiny_run(corpus)
    straight = trainer.run(cfg, tmp_path / "straight", progress=False)
    trainer.run(cfg, tmp_path / "split", stop_at=10, progress=False)
    state, saved_cfg = trainer.load_run(tmp_path / "split")
    assert state.step == 10 and saved_cfg == cfg
    resumed = trainer.run(saved_cfg, tmp_path / "split", state=state, progress=False)

    assert resumed.step == straight.step == 20
    _assert_same(resumed.params, straight.params)
    _assert_same(resumed.opt_state, straight.opt_state)

    def records(run: str) -> list[tuple]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [
            (r["step"], r.get("loss"), r.get("val_loss"), r.get("lr"))
            for r in map(json.loads, lines)
        ]

    assert records("split") == records("straight")
    assert [r[0] for r in records("split")] == [0, 5, 10, 15, 20]
    # and the final validation loss is that of the final parameters
    val = data.load_corpus(str(corpus)).val
    batches = [data.batch_at(val, 4, 16, 0, i) for i in range(2)]
    assert records("split")[-1][2] == trainer.evaluate(gpt.loss(cfg.model), resumed.params, batches)


def test_parallel_run_resumes_under_another_mesh(corpus: Path, tmp_path: Path) -> None:
    """Ten steps on data=2 with ZeRO-2, ten more on tensor=2 with ZeRO-3 (n_layer=2 so the layers
    are really cut), equal twenty single-device steps, optimizer state included; fp32, so to
    rounding (the same tolerance as the parallel training tests).

    Adam's eps is raised to 1e-3: the attention key bias has an exactly zero gradient, whose
    fp32 rounding noise Adam with a tiny eps would turn into steps of size lr that differ
    between any two correct implementations.
    """
    plain = _tiny_run(corpus)
    cfg = dataclasses.replace(
        plain,
        model=dataclasses.replace(plain.model, n_layer=2),
        optim=dataclasses.replace(plain.optim, eps=1e-3),
    )
    straight = trainer.run(cfg, tmp_path / "straight", progress=False)
    first = dataclasses.replace(cfg, parallel={"data": 2, "zero": {"stage": 2}})
    trainer.run(first, tmp_path / "split", stop_at=10, progress=False)
    state, _ = trainer.load_run(tmp_path / "split")
    assert state.step == 10 and isinstance(state.opt_state, tuple) and state.opt_state
    second = dataclasses.replace(cfg, parallel={"tensor": 2, "zero": 3})
    resumed = trainer.run(second, tmp_path / "split", state=state, progress=False)
    assert resumed.step == 20
    final, _ = trainer.load_run(tmp_path / "split")
    for what in ("params", "opt_state"):
        for (p, a), (_, b) in zip(
            tree.flatten_with_paths(getattr(final, what))[0],
            tree.flatten_with_paths(getattr(straight, what))[0],
        ):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{what} {p}")
            else:
                assert a == b, (what, p)


def _wait_for_step(run: Path, proc: subprocess.Popen, step: int, limit: float = 120.0) -> None:
    """Poll the run's metrics until a record reaches ``step`` (the run is then mid-training)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        lines = (run / "metrics.jsonl").read_text().splitlines() if run.exists() else []
        if any(json.loads(x)["step"] >= step for x in lines if x.strip()):
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the run did not reach step {step} within {limit} s")


@pytest.mark.parametrize(
    ("signum", "parallel"),
    [
        (signal.SIGTERM, None),
        (signal.SIGINT, None),
        # about 19 s; test_elastic stops every rank of a colfunc run by SIGTERM by default
        pytest.param(signal.SIGINT, "data=2,tensor=2", marks=pytest.mark.slow),
    ],
)
def test_a_signal_stops_after_the_step_saves_and_resumes_exactly(
    corpus: Path, tmp_path: Path, signum: int, parallel: str | None
) -> None:
    """SIGTERM (what timeout and schedulers send) and Ctrl-C stop ``colfunc train`` after the
    step in progress, every rank of a parallel run (threads) at the same step; the run saves,
    says so in one line, and exits 128 + the signal. Resumed to step N + 6 it equals a run
    straight to N + 6, bit for bit (a parallel run saves the single-device layout: resumed on
    one device)."""
    sets = [
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.max_seq_len=16",
        f"data.corpus={corpus}",
        "data.seq_len=16",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        "train.steps=100000",
        "train.log_every=1",
        "train.eval_every=100000",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        f"train.out_dir={tmp_path}",
        "train.name=cut",
    ]
    if parallel is not None:
        sets += [f"parallel.{kv}" for kv in parallel.split(",")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "colfunc", "train", "--no-progress", "--threads", "1"]
    proc = subprocess.Popen(
        [*cmd, *(a for kv in sets for a in ("--set", kv))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    run = tmp_path / "cut"
    _wait_for_step(run, proc, 3)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    m = re.search(rf"colfunc: stopped by {name} at step (\d+); checkpoint saved", err)
    assert m is not None, err
    assert "Traceback" not in err and "terminate called" not in err, err
    n = int(m.group(1))
    state, cfg = trainer.load_run(run)
    assert state.step == n >= 3
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == n  # the steps since the last record are recorded too
    # the schedule spans train.steps: stop both at n + 6 of the same 100000; one thread, as the
    # run had (the key bias's zero gradient is rounding noise that depends on the thread count)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed = trainer.run(cfg, run, state=state, stop_at=n + 6, progress=False)
        straight = trainer.run(cfg, tmp_path / "straight", stop_at=n + 6, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert resumed.step == straight.step == n + 6
    # as saved: the single-device layout, whichever mesh ran
    resumed, straight = trainer.load_run(run)[0], trainer.load_run(tmp_path / "straight")[0]
    assert resumed.step == n + 6
    _assert_same(resumed.params, straight.params)
    _assert_same(resumed.opt_state, straight.opt_state)


def test_a_non_finite_loss_stops_the_run_and_keeps_the_good_checkpoint(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _tiny_run(corpus, save_every=4, steps=12)
    real = cf.Step.__call__

    def poisoned(self: Any, state: Any, batch: Any) -> Any:
        new, metrics = real(self, state, batch)
        if new.step == 6:  # the parameters blow up at step 6
            new.params["embed"]["tokens"].fill_(float("nan"))
            metrics = {**metrics, "loss": torch.tensor(float("nan"))}
        return new, metrics

    monkeypatch.setattr(cf.Step, "__call__", poisoned)
    with pytest.raises(
        ValueError, match=r"step 6: the training loss is nan .*checkpoint of step 4 is kept"
    ):
        trainer.run(cfg, tmp_path / "bad", progress=False)
    state, _ = trainer.load_run(tmp_path / "bad")
    assert state.step == 4
    assert all(x.isfinite().all() for x in tree.tensors(state.params))
