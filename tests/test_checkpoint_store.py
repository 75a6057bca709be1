"""The checkpoint store: atomic commits under SIGKILL, checksums, pruning, async writes, and the
training loop's periodic saves."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from colfunc import checkpoint, config, tree
from colfunc import train as trainer


def _state(seed: int, n: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"params": {f"w{i}": torch.randn(64, 32, generator=g) for i in range(n)}, "step": seed}


def _same(a: Any, b: Any) -> bool:
    fa, fb = tree.flatten_with_paths(a)[0], tree.flatten_with_paths(b)[0]
    return [p for p, _ in fa] == [p for p, _ in fb] and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for (_, x), (_, y) in zip(fa, fb)
    )


def test_commits_are_numbered_pointed_at_and_pruned(tmp_path: Path) -> None:
    root = tmp_path / "store"
    assert checkpoint.latest(root) is None and checkpoint.steps(root) == []
    for step in range(1, 6):
        path = checkpoint.commit(root, step, _state(step), {"at": step}, keep_last=2)
        assert path == root / f"step-{step:08d}"
        assert checkpoint.latest(root) == path
    assert checkpoint.steps(root) == [4, 5]
    assert (root / "latest").read_text().strip() == "step-00000005"
    for step in (4, 5):
        state, cfg = checkpoint.load(root / f"step-{step:08d}")
        assert _same(state, _state(step)) and cfg == {"at": step}
    # the same step again is not rewritten; an older one committed later becomes the latest
    before = (root / "step-00000005" / "state.safetensors").stat().st_mtime_ns
    checkpoint.commit(root, 5, _state(99), keep_last=2)
    assert (root / "step-00000005" / "state.safetensors").stat().st_mtime_ns == before
    checkpoint.commit(root, 3, _state(3), keep_last=None)
    assert checkpoint.latest(root) == root / "step-00000003"
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]


def test_without_a_pointer_the_newest_complete_checkpoint_is_latest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint.commit(root, 1, _state(1))
    checkpoint.commit(root, 2, _state(2))
    (root / "latest").unlink()  # a crash before the first pointer write
    (root / "step-00000009").mkdir()  # an incomplete folder is never taken
    assert checkpoint.latest(root) == root / "step-00000002"
    (root / "latest").write_text("step-00000042\n")  # a pointer to nothing: the newest instead
    assert checkpoint.latest(root) == root / "step-00000002"


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    for step in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            checkpoint.commit(tmp_path / "s", step, _state(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_last must be an int >= 1 or None"):
        checkpoint.commit(tmp_path / "s", 1, _state(0), keep_last=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a checkpoint store"):
        checkpoint.commit(tmp_path / "file", 1, _state(0))


def _flip_one_bit(path: Path, key: str) -> None:
    """Flip the lowest bit of the first byte of tensor ``key``'s data."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    start = 8 + header_len + header[key]["data_offsets"][0]
    raw[start] ^= 1
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    path = checkpoint.commit(tmp_path / "s", 1, _state(1))
    _flip_one_bit(path / checkpoint.TENSORS, "params.w2")
    with pytest.raises(checkpoint.CheckpointError, match=r"tensor 'params\.w2' does not match"):
        checkpoint.load(path)


@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32_combine_equals_zlib_over_the_concatenation(a: bytes, b: bytes) -> None:
    combined = checkpoint.checksums._crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert combined == zlib.crc32(a + b)


@given(
    nbytes=st.integers(0, 5000), block=st.sampled_from([1, 7, 64, 1024]), seed=st.integers(0, 99)
)
def test_one_pass_gives_the_whole_and_the_block_checksums(nbytes: int, block: int, seed: int):
    data = random.Random(seed).randbytes(nbytes)
    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    whole, blocks = checkpoint.checksums._sums(t, block)
    assert whole == f"{zlib.crc32(data):08x}" == checkpoint.checksum(t)
    assert blocks == [f"{zlib.crc32(data[i : i + block]):08x}" for i in range(0, nbytes, block)]


def test_a_saved_header_holds_zlibs_checksums(tmp_path: Path) -> None:
    state = {"w": torch.randn(70_000), "b": torch.arange(5)}  # the first spans two 64 KiB blocks
    path = checkpoint.commit(tmp_path / "s", 1, state)
    meta = json.loads((path / checkpoint.META).read_text())
    for key, t in safetensors.torch.load_file(str(path / checkpoint.TENSORS)).items():
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert meta["checksums"][key] == f"{zlib.crc32(data):08x}"
        size = meta["block_bytes"]
        assert len(meta["blocks"][key]) == -(-len(data) // size)
        assert meta["blocks"][key][-1] == f"{zlib.crc32(data[-(len(data) % size or size) :]):08x}"


def test_files_follow_the_umask_and_unreadable_ones_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = os.umask(0o022)
    try:
        path = checkpoint.commit(tmp_path / "s", 1, _state(1))
        single = checkpoint.save(tmp_path / "one", _state(1))
    finally:
        os.umask(old)
    for folder in (path, single):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        for name in (checkpoint.TENSORS, checkpoint.META):
            assert stat.S_IMODE((folder / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE((tmp_path / "s" / "latest").stat().st_mode) == 0o644

    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safetensors.torch, "load_file", denied)
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read: permission denied"):
        checkpoint.load(path)


def test_save_recovers_the_old_checkpoint_after_a_crash_between_its_renames(
    tmp_path: Path,
) -> None:
    path = checkpoint.save(tmp_path / "ck", _state(1))
    os.rename(path, tmp_path / ".ck.old-0000abcd")  # the first rename done, the second not
    (tmp_path / ".ck.tmp-zzz").mkdir()  # and a temporary left behind
    assert _same(checkpoint.load(path)[0], _state(1))
    checkpoint.save(path, _state(2))  # the next save clears both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert _same(checkpoint.load(path)[0], _state(2))


def test_async_writes_a_snapshot_and_reports_its_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = checkpoint.AsyncWriter()
    state = _state(1)
    want = _state(1)
    real_write = checkpoint.files._write
    release, written = threading.Event(), threading.Event()

    def held_write(*args: Any) -> None:
        release.wait(timeout=10)  # held until submit has returned (a blocking submit: 10 s)
        real_write(*args)
        written.set()

    monkeypatch.setattr(checkpoint.files, "_write", held_write)
    writer.submit(tmp_path / "s", 1, state)
    assert not written.is_set()  # submit returned while the write was still held
    for x in tree.tensors(state):  # the training loop goes on writing its state in place
        x.fill_(7.0)
    release.set()  # the write starts after the state changed: it writes the snapshot
    assert writer.wait() == tmp_path / "s" / "step-00000001"
    assert _same(checkpoint.load(tmp_path / "s" / "step-00000001")[0], want)

    def broken(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.files, "_write", broken)
    writer.submit(tmp_path / "s", 2, _state(2))
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert checkpoint.latest(tmp_path / "s") == tmp_path / "s" / "step-00000001"
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".tmp-")]


CHILD = textwrap.dedent(
    """
    import sys, torch
    from colfunc import checkpoint
    root, first = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    print("ready", flush=True)
    for step in range(first, first + 10**6):
        # each step's tensors are a function of the step, so a reader can check every value
        state = {"w": [torch.full((256, 1024), float(step) + k) for k in range(8)], "step": step}
        checkpoint.commit(root, step, state, keep_last=3)
    """
)


@pytest.mark.slow  # SIGKILLs a saving run at many moments: about 55 s
def test_sigkill_at_any_moment_leaves_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    """20 trials: a process commits 8 MB checkpoints in a loop (keeping 3) and is SIGKILLed at
    a random moment; after each, the latest checkpoint loads with its checksums, every
    step folder in the store is complete and right, and the next trial goes on from it."""
    root = tmp_path / "store"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(0)
    kills_mid_write = 0
    for _trial in range(20):
        found = checkpoint.latest(root)
        first = checkpoint.load(found)[0]["step"] + 1 if found is not None else 1
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), str(first)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kills_mid_write += any(p.name.startswith(".tmp-") for p in root.iterdir())
        latest = checkpoint.latest(root)
        assert latest is not None or not checkpoint.steps(root)
        for step in checkpoint.steps(root):
            state, _ = checkpoint.load(root / f"step-{step:08d}")
            assert state["step"] == step
            assert all(bool((w == step + k).all()) for k, w in enumerate(state["w"]))
        if latest is not None:  # the newest, or the one before when the kill came between
            done = checkpoint.steps(root)  # the newest's rename and the pointer's
            assert checkpoint.load(latest)[0]["step"] in done[-2:]
    assert kills_mid_write > 0  # some kills really landed inside a commit
    checkpoint.commit(root, 10**7, {"w": torch.zeros(1)})  # the next commit clears the debris
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def _tiny(corpus: Path, **train: Any) -> config.RunConfig:
    sets = {
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.n_head": 2,
        "model.max_seq_len": 16,
        "data.corpus": corpus,
        "data.seq_len": 16,
        "data.batch_size": 4,
        "data.val_fraction": 0.1,
        "train.steps": 10,
        "train.log_every": 5,
        "train.eval_every": 10,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
        **{f"train.{k}": v for k, v in train.items()},
    }
    return config.load(None, [f"{k}={v}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 5)
    return root


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_saves_every_n_steps_and_keeps_the_last(
    corpus: Path, tmp_path: Path, async_save: bool
) -> None:
    """save_every=3, keep_last=2 over 10 steps: checkpoints 9 and 10 remain; the one of step 9
    resumes to the same step 10, bit for bit; async saving writes the same checkpoints."""
    cfg = _tiny(corpus, save_every=3, keep_last=2, async_save=async_save)
    trainer.run(cfg, tmp_path / "run", progress=False)
    store = tmp_path / "run" / trainer.CHECKPOINTS
    assert checkpoint.steps(store) == [9, 10]
    nine, _ = checkpoint.load(store / "step-00000009")
    final, _ = trainer.load_run(tmp_path / "run")
    assert nine.step == 9 and final.step == 10
    again = trainer.run(cfg, tmp_path / "again", progress=False, stop_at=9)
    assert again.step == 9
    resumed = trainer.run(cfg, tmp_path / "again", state=trainer.load_run(tmp_path / "again")[0])
    assert resumed.step == 10
    assert _same(trainer.load_run(tmp_path / "again")[0].params, final.params)
    assert _same(trainer.load_run(tmp_path / "again")[0].opt_state, final.opt_state)


def test_a_legacy_run_folder_still_loads(corpus: Path, tmp_path: Path) -> None:
    """Runs written before the store kept one checkpoint/ folder, without checksums."""
    cfg = _tiny(corpus)
    trainer.run(cfg, tmp_path / "new", progress=False)
    state, _ = trainer.load_run(tmp_path / "new")
    legacy = tmp_path / "old"
    legacy.mkdir()
    checkpoint.save(legacy / trainer.CHECKPOINT, state, cfg)
    meta = json.loads((legacy / "checkpoint" / "meta.json").read_text())
    del meta["checksums"]
    (legacy / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    loaded, loaded_cfg = trainer.load_run(legacy)
    assert _same(loaded, state) and loaded_cfg == cfg
    more = config.override(cfg, ["train.steps=12"])
    assert trainer.run(more, legacy, state=loaded, progress=False).step == 12
    assert trainer.load_run(legacy)[0].step == 12  # now from its store


def test_a_run_stopped_before_its_first_save_says_so(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "early"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint yet: it stopped before"):
        trainer.load_run(run)
    with pytest.raises(ValueError, match=r"holds no checkpoint .* remove it or pick another name"):
        trainer.run(_tiny(corpus), run, progress=False)
