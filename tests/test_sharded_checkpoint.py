"""Sharded checkpoints: every rank writes its own pieces (no gathering), and a checkpoint saved
under one layout loads under any other, the full state (parameters and optimizer) bit for bit."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as hst
import pytest
import torch

from colfunc import checkpoint, config, reshard, resume, tree
from colfunc import train as trainer

LAYOUTS: dict[str, dict[str, Any]] = {
    "one": {},
    "dp2": {"data": 2},
    "tp2": {"tensor": 2},
    "pp2": {"pipeline": {"stages": 2, "microbatches": 2}},
    "zero3": {"data": 2, "zero": 3},
    "dp2-tp2-zero1": {"data": 2, "tensor": 2, "zero": 1},
    "dp2-tp2-zero3": {"data": 2, "tensor": 2, "zero": 3},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 5)
    return root


def _cfg(corpus: Path, parallel: dict[str, Any], **train: Any) -> config.RunConfig:
    sets = {
        "model.n_layer": 2,
        "model.d_model": 32,
        "model.n_head": 2,
        "model.max_seq_len": 16,
        "data.corpus": corpus,
        "data.seq_len": 16,
        "data.batch_size": 4,
        "data.val_fraction": 0.1,
        "train.steps": 6,
        "train.log_every": 3,
        "train.eval_every": 6,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
        **{f"train.{k}": v for k, v in train.items()},
    }
    cfg = config.load(None, [f"{k}={v}" for k, v in sets.items()])
    return dataclasses.replace(cfg, parallel=parallel)


def _same(a: Any, b: Any) -> None:
    fa, fb = tree.flatten_with_paths(a)[0], tree.flatten_with_paths(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), p
        else:
            assert x == y, p


@pytest.fixture(scope="module")
def saved(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three steps under each layout; its checkpoint folder."""
    out = {}
    for name, parallel in LAYOUTS.items():
        run = tmp_path_factory.mktemp("runs") / name
        trainer.run(_cfg(corpus, parallel), run, stop_at=3, progress=False)
        out[name] = run
    return out


def test_each_rank_writes_its_own_file_and_an_index(saved: dict[str, Path]) -> None:
    for name, run in saved.items():
        path = trainer.checkpoint_path(run)
        assert path is not None and path.name == "step-00000003"
        files = sorted(p.name for p in path.iterdir())
        if name == "one":
            assert files == ["meta.json", "state.safetensors"]
            continue
        info = checkpoint.sharded_meta(path)
        assert info is not None
        world = 1
        for n in info["mesh"].values():
            world *= n
        assert files == ["meta.json", *(checkpoint.shard_name(r) for r in range(world))]
        assert info["world"] == world and info["step"] == 3
        index = json.loads((path / "meta.json").read_text())
        assert index["config"]["run_config"]["parallel"] == LAYOUTS[name]


# each source is resumed under every other layout (about 8 s a source): two sources by default,
# the single-device one and the most cut up, the rest with -m slow
@pytest.mark.parametrize(
    "source",
    [
        pytest.param(s, marks=() if s in ("one", "dp2-tp2-zero3") else pytest.mark.slow)
        for s in sorted(LAYOUTS)
    ],
)
def test_a_checkpoint_loads_under_every_other_layout(
    saved: dict[str, Path], source: str, corpus: Path, tmp_path: Path
) -> None:
    """Saved under ``source``; resumed (zero more steps) under each other layout, which saves
    it again its own way; read back, the full state equals the source's, bit for bit."""
    want, _ = trainer.load_run(saved[source])  # the single-device layout
    assert want.step == 3
    for target, parallel in LAYOUTS.items():
        if target == source:
            continue
        state, _ = trainer.load_run(saved[source], gather=False)
        run = tmp_path / target
        run.mkdir()
        again = trainer.run(_cfg(corpus, parallel), run, state=state, stop_at=3, progress=False)
        assert again.step == 3
        got, _ = trainer.load_run(run)
        _same(got.params, want.params)
        _same(got.opt_state, want.opt_state)


def test_the_same_layout_reads_only_its_own_file_and_saves_without_gathering(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under dp=2 x tp=2 with ZeRO-1, 3 steps, save, 3 more equal 6 straight, bit for bit; the
    saves and the resume never gather the state (full_state is never called)."""
    cfg = _cfg(corpus, LAYOUTS["dp2-tp2-zero1"], save_every=3)
    straight = tmp_path / "straight"
    trainer.run(cfg, straight, progress=False)

    def no_gathering(*args: Any) -> Any:
        raise AssertionError("the state was gathered")

    monkeypatch.setattr(resume, "full_state", no_gathering)
    split = tmp_path / "split"
    trainer.run(cfg, split, stop_at=3, progress=False)
    handle, _ = trainer.load_run(split, gather=False)
    assert isinstance(handle, trainer.ShardedRun) and handle.step == 3
    reads: list[int] = []
    real = checkpoint.load_shard

    def counted(path: Any, rank: int) -> Any:
        reads.append(rank)
        return real(path, rank)

    monkeypatch.setattr(checkpoint, "load_shard", counted)
    trainer.run(cfg, split, state=handle, progress=False)
    assert sorted(reads) == [0, 1, 2, 3]  # each rank its own file, once
    monkeypatch.undo()
    a, _ = trainer.load_run(split)
    b, _ = trainer.load_run(straight)
    assert a.step == b.step == 6
    _same(a.params, b.params)
    _same(a.opt_state, b.opt_state)


def test_the_index_says_which_file_holds_which_elements(saved: dict[str, Path]) -> None:
    """Every tensor's global shape and dtype are in the index, with the span each rank's file
    holds; the runs in the files cover every element of every tensor, each exactly as many
    times as the layout keeps copies of it (twice for a replica on dp=2, once for a shard)."""
    for name, run in saved.items():
        if name == "one":
            continue
        path = trainer.checkpoint_path(run)
        assert path is not None
        reader = checkpoint.ShardReader(path)
        assert "params.blocks.attn.wq" in reader.tensors
        for key, entry in reader.tensors.items():
            numel = 1
            for d in entry["shape"]:
                numel *= d
            counts = torch.zeros(numel, dtype=torch.int64)
            for rank, (lo, hi) in entry["files"].items():
                _, g = reshard.expand_runs(reader.runs(rank, key))
                assert lo == int(g.min()) and hi == int(g.max()) + 1, (name, key, rank)
                counts += torch.bincount(g, minlength=numel)
            copies = set(counts.tolist())
            assert len(copies) == 1 and copies != {0}, (name, key, copies)
            replicas = {"dp2": 2, "dp2-tp2-zero1": 2}.get(name, 1)
            if name == "dp2-tp2-zero1" and key.startswith("opt_state"):
                replicas = 1  # ZeRO-1 cuts the moments over dp
            if name == "dp2-tp2-zero1" and ".ln" in key:
                replicas = 4  # norms are replicated over tp too
            if name in ("tp2", "dp2-tp2-zero3") and key.startswith(("params", "opt_state")):
                split = {"params.blocks.attn.wq", "opt_state.1.exp_avg.blocks.attn.wq"}
                if key in split:
                    assert copies == {1}, (name, key, copies)
                continue
            if key in ("params.blocks.attn.wq", "opt_state.1.exp_avg.blocks.attn.wq"):
                assert copies == {replicas}, (name, key, copies)


@pytest.mark.parametrize("source", ["dp2-tp2-zero3", pytest.param("one", marks=pytest.mark.slow)])
def test_another_layout_reads_only_the_blocks_of_its_own_pieces(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """dp=2 x tp=2 with ZeRO-3 saved (4 files), or one device (1 file), loaded as pp=2, as
    tp=2, as dp=2 x tp=2 with ZeRO-1 and as the other: nothing is gathered and the writing
    composition is not rebuilt; each loading rank reads from the files at most its own pieces'
    bytes plus the partial blocks at the ends of each read; the state equals the source's bit
    for bit (as the writing composition, rebuilt, puts it together, or as the single file
    holds it)."""
    block = 64  # half a row of the weights: a tensor-parallel rank's half rows are whole blocks
    monkeypatch.setattr(checkpoint.checksums, "BLOCK_BYTES", block)
    run = tmp_path / "saved"
    trainer.run(_cfg(corpus, LAYOUTS[source]), run, stop_at=3, progress=False)
    handle, _ = trainer.load_run(run, gather=False)
    assert handle.partial
    if source == "one":
        want, _ = trainer.load_run(run)  # the single file, read whole
    else:
        handle.partial = False
        want = handle.full()  # the writing composition rebuilt, gathered
    original = trainer.ShardedRun.resharded

    def no_gathering(*args: Any) -> Any:
        raise AssertionError("the state was gathered")

    others = ("pp2", "tp2", "dp2-tp2-zero1", "dp2-tp2-zero3", "one")
    files = 1 if source == "one" else 4
    for target in [t for t in others if t != source]:
        headers: list[str] = []  # the files whose header a read of the whole load opened
        name = "_safetensors_header" if source == "one" else "_colfunc_header"
        monkeypatch.setattr(
            checkpoint.sharded, name, _noting(headers, getattr(checkpoint.sharded, name))
        )
        handle, _ = trainer.load_run(run, gather=False)
        own: dict[int, int] = {}
        reads: dict[int, int] = {}

        def resharded(
            self: Any,
            step_fn: Any,
            mesh: Any,
            cfg: Any,
            base: Any = None,
            own: dict[int, int] = own,
        ) -> Any:
            state = original(self, step_fn, mesh, cfg, base)
            rank = 0 if mesh is None else mesh.rank
            own[rank] = sum(x.nbytes for x in tree.tensors(reshard.local_pieces(state)))
            return state

        out = tmp_path / target
        out.mkdir()
        with monkeypatch.context() as m:
            m.setattr(resume, "full_state", no_gathering)
            m.setattr(trainer.ShardedRun, "local", no_gathering)
            m.setattr(trainer.ShardedRun, "resharded", resharded)
            m.setattr(checkpoint.ShardReader, "read", _counting(reads))
            cfg = _cfg(corpus, LAYOUTS[target])
            trainer.run(cfg, out, state=handle, stop_at=3, progress=False)
        monkeypatch.undo()
        monkeypatch.setattr(checkpoint.checksums, "BLOCK_BYTES", block)
        # one reader serves the whole load: each file's header is read once, not once per
        # loading rank and again for the config
        ours = [f for f in headers if f.startswith(str(run) + "/")]
        assert len(ours) == len(set(ours)) == files, sorted(ours)
        assert sorted(handle.bytes_read) == sorted(own) == list(range(len(own)))
        for rank, by_file in handle.bytes_read.items():
            read = sum(by_file.values())
            assert read <= own[rank] + 2 * block * reads[rank], (target, rank, read, own)
        got, _ = trainer.load_run(out)
        _same(got.params, want.params)
        _same(got.opt_state, want.opt_state)


MORE: dict[str, dict[str, Any]] = {
    "2d": {"tensor": {"mode": "2d", "size": 4}},
    "offload": {"offload": {"policy": "host", "device_budget": "1GiB"}},
    "amp-dp2": {"data": 2, "amp": "bf16"},
    "dp2-zero3-offload": {
        "data": 2,
        "zero": 3,
        "offload": {"policy": "auto", "device_budget": "1GiB"},
    },
    "tp2-offload": {"tensor": 2, "offload": {"policy": "host", "device_budget": "1GiB"}},
}


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("2d", "offload"),
        ("offload", "2d"),
        ("amp-dp2", "tp2"),
        ("dp2-tp2-zero3", "2d"),
        ("dp2-zero3-offload", "tp2"),
        ("dp2-tp2-zero1", "dp2-zero3-offload"),
        ("tp2-offload", "dp2-tp2-zero3"),
    ],
)
def test_grid_offload_and_amp_layouts_load_the_same_way(
    corpus: Path, tmp_path: Path, source: str, target: str
) -> None:
    """The element runs need nothing of a transform: SUMMA's 2D blocks, offload's host chunks
    (of whole parameters, or of each rank's ZeRO-3 pieces) and amp's masters save and load
    across layouts like the others, bit for bit."""
    layouts = {**LAYOUTS, **MORE}
    run = tmp_path / "saved"
    trainer.run(_cfg(corpus, layouts[source]), run, stop_at=3, progress=False)
    want, _ = trainer.load_run(run)
    handle, _ = trainer.load_run(run, gather=False)
    out = tmp_path / "moved"
    out.mkdir()
    trainer.run(_cfg(corpus, layouts[target]), out, state=handle, stop_at=3, progress=False)
    got, _ = trainer.load_run(out)
    _same(got.params, want.params)
    _same(got.opt_state, want.opt_state)


def _noting(files: list[str], read_header: Any) -> Any:
    """A header reader that notes each file it opens."""

    def noted(file: Path) -> Any:
        files.append(str(file))
        return read_header(file)

    return noted


def _counting(reads: dict[int, int]) -> Any:
    """ShardReader.read, counting the reads of data (not of runs) per loading thread."""
    import threading

    from colfunc import core
    from colfunc.sharding import Mesh

    read = checkpoint.ShardReader.read
    lock = threading.Lock()

    def counted(self: Any, rank: int, key: str, start: int, stop: int, **kw: Any) -> Any:
        if not key.startswith(checkpoint.RUNS) and stop > start:
            mesh = core.innermost(Mesh)
            me = 0 if mesh is None else mesh.rank
            with lock:
                reads[me] = reads.get(me, 0) + 1
        return read(self, rank, key, start, stop, **kw)

    return counted


def test_bad_sharded_checkpoints_are_named(saved: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    path = trainer.checkpoint_path(saved["dp2"])
    assert path is not None
    with pytest.raises(checkpoint.CheckpointError, match="is a sharded checkpoint"):
        checkpoint.load(path)
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / checkpoint.shard_name(1)).unlink()
    with pytest.raises(
        checkpoint.CheckpointError, match=r"incomplete: rank-00001\.safetensors is missing"
    ):
        trainer.load_run(broken)
    shutil.rmtree(broken)
    shutil.copytree(path, broken)  # a rank's file that does not match what the index says
    shutil.copy(path / checkpoint.shard_name(0), broken / checkpoint.shard_name(1))
    with pytest.raises(checkpoint.CheckpointError, match="holds rank 0's pieces, not 1's"):
        trainer.load_run(broken)
    shutil.rmtree(broken)
    shutil.copytree(path, broken)  # a flipped bit in a block that a partial read reads
    file = broken / checkpoint.shard_name(0)  # (the replica a load reads first)
    data = bytearray(file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8 : 8 + n])["params.blocks.attn.wq"]["data_offsets"][0]
    data[8 + n + begin + 5] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"rank-00000.safetensors' is corrupt: tensor 'params.blocks.attn.wq' does not "
        r"match its checksum \(block 0\)",
    ):
        trainer.load_run(broken)


@pytest.mark.parametrize(("first", "second"), [pytest.param(4, 2, marks=pytest.mark.slow), (2, 4)])
def test_world_size_changes_on_gloo(corpus: Path, tmp_path: Path, first: int, second: int) -> None:
    """Three steps on ``first`` gloo processes, saved sharded, loaded on ``second`` and saved
    again its way: the full state is the same, bit for bit. Three more steps there equal six on
    one device to rounding (fp32 AdamW, as the parallel training tests; eps raised so that the
    attention key bias's zero gradient, pure rounding noise, does not become lr-sized steps)."""

    def cfg(parallel: dict[str, Any]) -> config.RunConfig:
        c = _cfg(corpus, parallel)
        return dataclasses.replace(c, optim=dataclasses.replace(c.optim, eps=1e-3))

    run, moved = tmp_path / "run", tmp_path / "moved"
    trainer.run(cfg({"data": first, "backend": "gloo"}), run, stop_at=3, progress=False)
    info = checkpoint.sharded_meta(trainer.checkpoint_path(run))
    assert info is not None and info["world"] == first
    saved, _ = trainer.load_run(run)
    moved.mkdir()
    second_cfg = cfg({"data": second, "backend": "gloo"})
    handle, _ = trainer.load_run(run, gather=False)
    trainer.run(second_cfg, moved, state=handle, stop_at=3, progress=False)
    info = checkpoint.sharded_meta(trainer.checkpoint_path(moved))
    assert info is not None and info["world"] == second
    again, _ = trainer.load_run(moved)
    _same(again.params, saved.params)
    _same(again.opt_state, saved.opt_state)

    handle, _ = trainer.load_run(moved, gather=False)
    trainer.run(second_cfg, moved, state=handle, progress=False)
    got, _ = trainer.load_run(moved)
    want = trainer.run(cfg({}), tmp_path / "one", progress=False)
    assert got.step == want.step == 6
    for part in ("params", "opt_state"):
        for (p, x), (_, y) in zip(
            tree.flatten_with_paths(getattr(got, part))[0],
            tree.flatten_with_paths(getattr(want, part))[0],
        ):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=f"{part} {p}")


def test_a_ranks_save_allocates_at_most_one_tensor_copy(tmp_path: Path) -> None:
    """Writing a rank's shard under ZeRO-3 on dp=4 (threads): the peak of what the save
    allocates (cf.memory.track) is at most the largest local tensor (a copy made for a view that
    does not own its storage), far below the rank's own state, let alone the whole model."""
    import colfunc as cf
    from colfunc import models, optim
    from colfunc.sharding import launch

    cfg = models.gpt.Config(vocab_size=256, n_layer=4, n_head=2, d_model=64, max_seq_len=16)
    params = models.gpt.init(cfg, seed=0)
    whole = tree.size_bytes(tree.tensors(params)) * 3  # parameters and Adam moments
    root = tmp_path / "store"
    checkpoint.begin_sharded(root, 1)

    def body(mesh: Any) -> tuple[int, int, int]:
        step = cf.zero(
            cf.shard(cf.train_step(models.gpt.loss(cfg), optim.adamw(1e-3)), mesh), stage=3
        )
        state = step.init(params)
        local = reshard.local_pieces(state)
        tensors = tree.tensors(local)
        with cf.memory.track(tensors) as t:
            checkpoint.write_shard(root, 1, mesh.rank, local)
        return t.peak, tree.size_bytes(tensors), max(x.nbytes for x in tensors)

    for peak, own, largest in launch(body, {"dp": 4}):
        assert peak <= largest, (peak, largest)
        assert own <= whole / 4 + 4 * largest  # the rank's own pieces: about a quarter
    checkpoint.finish_sharded(root, 1, None, mesh_shape={"dp": 4})
    assert checkpoint.steps(root) == [1]


def test_async_sharded_saves_write_in_the_background_and_commit_the_same(
    corpus: Path, tmp_path: Path
) -> None:
    """``train.async_save`` under a mesh: each rank copies its pieces to host memory and writes
    them in a thread; the checkpoint is committed once every rank has. The store holds the same
    checkpoints, bit for bit, as synchronous saves make."""
    layout = LAYOUTS["dp2-tp2-zero1"]
    sync = _cfg(corpus, layout, save_every=2)
    background = _cfg(corpus, layout, save_every=2, async_save=True)
    trainer.run(sync, tmp_path / "sync", progress=False)
    trainer.run(background, tmp_path / "async", progress=False)
    stores = [tmp_path / run / trainer.CHECKPOINTS for run in ("sync", "async")]
    assert checkpoint.steps(stores[0]) == checkpoint.steps(stores[1]) == [2, 4, 6]
    for step in (2, 4, 6):
        a, b = (trainer.load_run(store / f"step-{step:08d}")[0] for store in stores)
        _same(a.params, b.params)
        _same(a.opt_state, b.opt_state)


def test_bad_resumes_are_one_line_and_overwrite_nothing(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the CLI: a layout the model cannot take (n_head=2 over tensor=3), a missing shard,
    a shard that is not the rank's: one line naming the value or file, exit code 2, and the
    run's checkpoints untouched."""
    import shutil

    from colfunc.cli import main

    run = tmp_path / "run"
    shutil.copytree(saved["dp2"], run)

    def contents() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    before = contents()

    def one_line(*needles: str) -> None:
        err = capsys.readouterr().err
        assert err.startswith("colfunc: error: ") and err.count("\n") == 1, err
        for needle in needles:
            assert needle in err, (needle, err)

    capsys.readouterr()
    args = ["train", "--resume", str(run), "--no-progress", "--set", "train.steps=9"]
    assert main([*args, "--set", "parallel.tensor=3"]) == 2
    one_line("n_head", "3")
    path = trainer.checkpoint_path(run)
    assert path is not None
    (path / checkpoint.shard_name(1)).rename(tmp_path / "aside")
    assert main(args) == 2
    one_line("rank-00001.safetensors is missing")
    assert main(["generate", "--run", str(run), "--max-new-tokens", "3"]) == 2
    one_line("rank-00001.safetensors is missing")
    shutil.copy(path / checkpoint.shard_name(0), path / checkpoint.shard_name(1))
    assert main(args) == 2
    one_line("holds rank 0's pieces, not 1's")
    (path / checkpoint.shard_name(1)).unlink()
    (tmp_path / "aside").rename(path / checkpoint.shard_name(1))
    assert contents() == before


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"data": 2, "tensor": 2}, marks=pytest.mark.slow),  # about 23 s
        {"data": 2, "backend": "gloo"},
    ],
    ids=["dp2xtp2", "dp2-gloo"],
)
def test_twenty_steps_equal_ten_a_save_and_ten_more(
    corpus: Path, tmp_path: Path, parallel: dict[str, Any]
) -> None:
    """Bitwise resume under the same layout (dp=2 x tp=2 on threads, dp=2 on gloo processes):
    parameters and optimizer states after 10 + save + resume + 10 equal 20 straight."""
    cfg = _cfg(corpus, parallel, steps=20, log_every=5, eval_every=20)
    trainer.run(cfg, tmp_path / "straight", progress=False)
    trainer.run(cfg, tmp_path / "split", stop_at=10, progress=False)
    handle, _ = trainer.load_run(tmp_path / "split", gather=False)
    assert isinstance(handle, trainer.ShardedRun) and handle.step == 10
    trainer.run(cfg, tmp_path / "split", state=handle, progress=False)
    a, _ = trainer.load_run(tmp_path / "split")
    b, _ = trainer.load_run(tmp_path / "straight")
    assert a.step == b.step == 20
    _same(a.params, b.params)
    _same(a.opt_state, b.opt_state)


SHARD_CHILD = """
import sys, torch
from colfunc import checkpoint
from colfunc.sharding import launch, comm
root, first = sys.argv[1], int(sys.argv[2])

def body(mesh):
    print("ready", flush=True) if mesh.rank == 0 else None
    for step in range(first, first + 10**6):
        local = {"w": torch.full((256, 512), float(step * 10 + mesh.rank)), "step": step}
        fresh = checkpoint.begin_sharded(root, step) if mesh.rank == 0 else False
        comm.all_reduce(torch.tensor([int(fresh)]), "dp", "max", mesh)
        checkpoint.write_shard(root, step, mesh.rank, local)
        comm.all_reduce(torch.tensor([0]), "dp", "max", mesh)
        if mesh.rank == 0:
            checkpoint.finish_sharded(root, step, None, mesh_shape={"dp": 2}, keep_last=2)

launch(body, {"dp": 2})
"""


@pytest.mark.slow  # SIGKILLs sharded commits: about 20 s
def test_sigkill_during_sharded_commits_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """Eight trials: two ranks commit sharded checkpoints in a loop and the process is
    SIGKILLed at a random moment; every committed step folder has both ranks' files, right."""
    import random
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "store"
    script = tmp_path / "child.py"
    script.write_text(SHARD_CHILD)
    rng = random.Random(1)
    for _ in range(8):
        done = checkpoint.steps(root)
        first = done[-1] + 1 if done else 1
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), str(first)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        for step in checkpoint.steps(root):
            path = root / f"step-{step:08d}"
            assert checkpoint.sharded_meta(path) is not None
            for rank in (0, 1):
                local, _ = checkpoint.load_shard(path, rank)
                assert local["step"] == step and bool((local["w"] == step * 10 + rank).all())
        latest = checkpoint.latest(root)
        if latest is not None:
            assert int(latest.name.split("-")[1]) in checkpoint.steps(root)[-2:]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    hst.lists(hst.tuples(hst.integers(0, 3), hst.integers(0, 40), hst.integers(0, 6)), max_size=12)
)
def test_runs_round_trip_any_tags(segments: list[tuple[int, int, int]]) -> None:
    """Tags (global index + 1, 0 for padding) made of padding gaps and increasing segments that
    jump anywhere: their runs expand back to exactly the tagged elements' local and global
    indices, and consecutive ones merge into one run."""
    tags: list[int] = []
    for gap, start, length in segments:
        tags += [0] * gap + list(range(start + 1, start + 1 + length))
    t = torch.tensor(tags, dtype=torch.float64)
    runs = reshard.runs_of(t)
    local, glob = reshard.expand_runs(runs)
    nz = torch.nonzero(t > 0).reshape(-1)
    assert torch.equal(local, nz) and torch.equal(glob, t[nz].to(torch.int64) - 1)
    if len(runs) > 1:  # maximal: no two neighbouring runs continue each other
        ends = runs[:-1, 0] + runs[:-1, 2], runs[:-1, 1] + runs[:-1, 2]
        assert not bool(((ends[0] == runs[1:, 0]) & (ends[1] == runs[1:, 1])).any())


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    hst.lists(hst.tuples(hst.integers(0, 40), hst.integers(1, 6)), min_size=1, max_size=12),
    hst.sampled_from([torch.float64, torch.int64]),
)
def test_runs_of_unpadded_tags_equal_the_element_indices(
    segments: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    """Without padding (every element tagged), the runs still expand back to exactly the
    elements' local and global indices, maximal."""
    tags = [g for start, length in segments for g in range(start + 1, start + 1 + length)]
    t = torch.tensor(tags, dtype=dtype)
    runs = reshard.runs_of(t)
    local, glob = reshard.expand_runs(runs)
    assert torch.equal(local, torch.arange(len(tags))) and torch.equal(glob, t.to(torch.int64) - 1)
    breaks = sum(1 for a, b in itertools.pairwise(tags) if b != a + 1)
    assert len(runs) == breaks + 1


def _runs(draw: Any, total: int) -> torch.Tensor:
    """Disjoint runs ordered by global start, at shuffled local places."""
    cuts = sorted(set(draw(hst.lists(hst.integers(0, total), max_size=10))))
    spans = [(a, b) for a, b in zip([0, *cuts], [*cuts, total]) if b > a]
    spans = [
        s
        for s, keep in zip(
            spans, draw(hst.lists(hst.booleans(), min_size=len(spans), max_size=len(spans)))
        )
        if keep
    ]
    order = draw(hst.permutations(range(len(spans))))
    local, at = {}, 0
    for k in order:
        local[k] = at
        at += spans[k][1] - spans[k][0]
    rows = [[local[k], a, b - a] for k, (a, b) in enumerate(spans)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(hst.data())
def test_run_intersections_and_remainders_equal_the_element_sets(data: Any) -> None:
    """Two ranks' runs over one tensor: the pieces they share map each shared global element to
    its place on both sides, and what is left of the first is exactly its other elements."""
    total = data.draw(hst.integers(1, 60))
    mine, theirs = _runs(data.draw, total), _runs(data.draw, total)
    pieces = reshard._intersect(mine, theirs)
    ml, mg = reshard.expand_runs(mine)
    tl, tg = reshard.expand_runs(theirs)
    where_mine = dict(zip(mg.tolist(), ml.tolist()))
    where_theirs = dict(zip(tg.tolist(), tl.tolist()))
    shared = sorted(set(where_mine) & set(where_theirs))
    got = []
    for src, dst, n, g in pieces.tolist():
        got += [(g + k, src + k, dst + k) for k in range(n)]
    assert sorted(got) == [(g, where_theirs[g], where_mine[g]) for g in shared]
    rest = reshard._subtract(mine, pieces)
    rl, rg = reshard.expand_runs(rest)
    left = sorted(set(where_mine) - set(shared))
    assert rg.tolist() == left and rl.tolist() == [where_mine[g] for g in left]
