"""Defects a new user met, each fixed with the message they should have read: one line and exit
2 from the command line, a ValueError or TypeError naming the value and the fix from Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import colfunc as cf
from colfunc import config, optim, parallel
from colfunc.cli import main
from colfunc.inference import Engine
from colfunc.inference.engine import KVMemoryError
from colfunc.models import dit, gpt, llama, opt

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colfunc: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_version_and_help_texts(capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        cf.cli._parser().parse_args(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("colfunc ") and out.split()[1][0].isdigit()
    assert main(["generate", "--help"]) == 0
    assert "the sampling seed" in capsys.readouterr().out
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "port to bind (default: 8000)" in text
    assert "KV cache size, e.g. 1GiB (default:" in text


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (config.TrainConfig, "steps", "ten"),
        (config.TrainConfig, "seed", 1.5),
        (config.DataConfig, "batch_size", "8"),
        (gpt.Config, "norm_eps", "x"),
        (gpt.Config, "d_model", None),
        (llama.Config, "rope_theta", None),
        (opt.Config, "norm_eps", [1e-5]),
        (dit.Config, "n_head", "4"),
    ],
)
def test_a_config_value_of_the_wrong_type_names_the_field(cls, field, value) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*{value!r}".replace("[", r"\[")):
        cls(**{field: value})


def test_remat_names_a_bad_policy() -> None:
    step = cf.train_step(lambda p, b: p["w"].sum(), optim.sgd(0.1))
    for bad in (42, [1, 2], None):
        with pytest.raises(TypeError, match=r"remat: policy must be 'full'.*a set of ATen op"):
            cf.remat(step, policy=bad)


def test_offload_device_policy_needs_no_budget_on_a_cpu() -> None:
    params = {"w": torch.randn(6, dtype=torch.float64)}
    step = cf.train_step(lambda p, b: (p["w"] ** 2).sum(), optim.sgd(0.1))
    off = cf.offload(step, "device")  # everything stays on the device: nothing to budget
    cf.testing.assert_equivalent(off, step, params, [None, None])
    with pytest.raises(ValueError, match="device_budget is required on a machine without a GPU"):
        cf.offload(step, "host")


def test_usp_without_ulysses_takes_the_largest_size_the_heads_allow() -> None:
    heads = llama.Config(n_head=4, n_kv_heads=2, d_model=64)
    usp = {"sequence": {"mode": "usp", "size": 4}}
    assert parallel.parse(usp, heads).sequence_ulysses == 2  # 2 key/value heads
    assert parallel.parse({**usp, "tensor": 2}, heads).sequence_ulysses == 1  # 1 per tp rank
    assert parallel.parse(usp, llama.Config(n_head=8, d_model=64)).sequence_ulysses == 4
    six = {"sequence": {"mode": "usp", "size": 6}}
    assert (
        parallel.parse(six, llama.Config(n_head=6, n_kv_heads=3, d_model=48)).sequence_ulysses == 3
    )
    got = parallel.parse(usp, heads)
    assert got.mesh_shape == {"dp": 1, "sp_ring": 2, "sp_ulysses": 2}
    with pytest.raises(ValueError, match="needs ulysses=U"):  # nothing to choose it from
        parallel.parse(usp)


def test_kv_memory_too_small_speaks_of_kv_memory() -> None:
    cfg = gpt.Config(vocab_size=32, n_layer=2, n_head=2, d_model=16, max_seq_len=64)
    params = gpt.init(cfg)
    with pytest.raises(KVMemoryError, match=r"kv_memory='1KiB' \(1024 bytes\) cannot hold one"):
        Engine(gpt, cfg, params, kv_memory="1KiB")
    try:
        Engine(gpt, cfg, params, kv_memory="1KiB")
    except KVMemoryError as e:
        assert e.message("--kv-memory").startswith("--kv-memory='1KiB'")
        assert e.needed == 64 * 2 * 2 * 16 * 4  # 64 slots x (k, v) x 2 layers x 16 wide x fp32
    Engine(gpt, cfg, params, kv_memory=64 * 2 * 2 * 16 * 4)  # exactly one sequence: fine


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dit")
    args = ["train", str(CONFIGS / "dit_video_tiny.py"), "--name", "v", "--no-progress"]
    args += ["--set", "train.steps=1", "--set", f"train.out_dir={out}"]
    assert main([*args, "--set", "train.sample_tokens=0"]) == 0
    return out / "v"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "def "],
        ["export", "--hf", "OUT"],
        ["serve", "--port", "0"],
    ],
    ids=["generate", "export", "serve"],
)
def test_language_commands_on_a_dit_run_point_at_sample(dit_run, argv, tmp_path, capsys) -> None:
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    capsys.readouterr()
    assert main([argv[0], "--run", str(dit_run), *argv[1:]]) == 2
    _one_line(capsys.readouterr().err, "is a video DiT run", "colfunc sample --run")
    assert not (tmp_path / "out").exists()


def test_generate_says_when_the_context_ended_it(tmp_path: Path, capsys: Any) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"m{i}.py").write_text(f"def f{i}(a):\n    return a + {i}\n" * 6)
    sets = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.max_seq_len=16"]
    sets += ["data.seq_len=16", "data.batch_size=2", "train.steps=1", "train.sample_tokens=0"]
    sets += [f"data.corpus={corpus}", f"train.out_dir={tmp_path}"]
    argv = ["train", "--name", "r", "--no-progress"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 0
    capsys.readouterr()
    run = str(tmp_path / "r")
    assert main(["generate", "--run", run, "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert "ended generation" not in capsys.readouterr().err  # 4 + 5 tokens fit in 16
    assert main(["generate", "--run", run, "--prompt", "def ", "--max-new-tokens", "50"]) == 0
    out = capsys.readouterr()
    assert "context of 16 tokens ended generation after 12 new tokens (of 50 asked)" in out.err
    assert len(out.out.rstrip("\n")) <= 16  # (a byte each at most: undecodable ones are one char)


def test_a_bad_config_value_from_a_config_file_is_one_line(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(
        "from colfunc.config import DataConfig, OptimConfig, TrainConfig\n"
        "from colfunc.models import gpt\n"
        "model = gpt.Config.tiny()\noptim = OptimConfig()\ndata = DataConfig()\n"
        "train = TrainConfig(steps='ten')\n"
    )
    assert main(["train", str(path), "--no-progress"]) == 2
    _one_line(capsys.readouterr().err, "train.steps must be a positive int, got 'ten'")


TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.max_seq_len=16"]
TINY += ["data.seq_len=16", "data.batch_size=4", "train.sample_tokens=0", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(20):
        (root / f"m{i}.py").write_text(f"def f{i}(a):\n    return a + {i}\n" * 6)
    return root


def _train(out: Path, corpus: Path, name: str, *sets: str) -> int:
    sets_ = [*TINY, f"data.corpus={corpus}", f"train.out_dir={out}", *sets]
    argv = ["train", "--name", name, "--no-progress"] + [a for s in sets_ for a in ("--set", s)]
    return main(argv)


def test_resume_takes_a_checkpoint_folder_into_its_run(tmp_path, small_corpus, capsys) -> None:
    assert _train(tmp_path, small_corpus, "r", "train.steps=2") == 0
    latest = tmp_path / "r" / "checkpoints" / "step-00000002"
    capsys.readouterr()
    assert main(["train", "--resume", str(latest), "--set", "train.steps=4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"resuming run {tmp_path / 'r'} from its checkpoint step-00000002" in err
    assert sorted(p.name for p in latest.iterdir()) == ["meta.json", "state.safetensors"]
    assert (tmp_path / "r" / "checkpoints" / "step-00000004").is_dir()
    # an older checkpoint of the run is refused: resuming it would rewrite the run's history
    assert main(["train", "--resume", str(latest), "--set", "train.steps=6"]) == 2
    _one_line(capsys.readouterr().err, "an older checkpoint of run", "latest is step-00000004")


def test_resume_under_another_optimizer_chain_says_so(tmp_path, small_corpus, capsys) -> None:
    assert _train(tmp_path, small_corpus, "r", "train.steps=2") == 0
    capsys.readouterr()
    argv = ["train", "--resume", str(tmp_path / "r"), "--set", "train.steps=4"]
    assert main([*argv, "--set", "optim.clip_norm=0"]) == 2
    _one_line(
        capsys.readouterr().err,
        "the optimizer differs from the checkpoint's (optim.clip_norm=0.0 (was 1.0))",
        "resume with the run's optimizer settings",
    )
    assert main([*argv, "--set", "optim.lr=1e-2", "--no-progress"]) == 0  # same state: fine


@pytest.mark.parametrize(
    ("layout", "needle"),
    [
        ("parallel.data=3", "data.batch_size=4 is not divisible by parallel data=3"),
        ('parallel.pipeline={"stages": 2, "microbatches": 3}', "microbatches=3"),
    ],
)
def test_a_composition_the_batch_cannot_feed_fails_before_the_run_folder(
    tmp_path, small_corpus, capsys, layout, needle
) -> None:
    assert _train(tmp_path, small_corpus, "bad", "train.steps=2", layout) == 2
    _one_line(capsys.readouterr().err, needle)
    assert not (tmp_path / "bad").exists()


def test_a_failed_launch_leaves_no_rank_thread_running() -> None:
    """The ranks' threads have unwound when the launch raises: a process that exits at once
    (the CLI printing the error) never tears down torch under one of them (exit 134). Each rank
    here leaves a thread-local whose teardown takes a while, after it has reported."""
    import threading
    import time

    unwound: list[int] = []

    class Slow:
        def __del__(self) -> None:
            time.sleep(0.3)
            unwound.append(1)

    per_thread = threading.local()

    def main_(mesh: cf.Mesh) -> None:
        per_thread.slow = Slow()  # freed as the rank's thread exits, after it reported
        step = cf.shard(cf.train_step(lambda p, b: (p["w"] * b).sum(), optim.sgd(0.1)), mesh)
        step(step.init({"w": torch.ones(3)}), torch.ones(4, 3))  # 4 rows over dp=3

    with pytest.raises(cf.sharding.RankFailedError, match="not divisible by the 'dp' axis size 3"):
        cf.launch(main_, mesh={"dp": 3})
    assert len(unwound) == 3  # every rank's thread had ended when the launch raised


@pytest.mark.parametrize("layout", [[], ["parallel.data=2"]], ids=["one-device", "sharded"])
def test_an_incomplete_newest_checkpoint_is_named_and_moved_aside(
    tmp_path, small_corpus, capsys, layout
) -> None:
    sets = ["train.steps=4", "train.save_every=2", *layout]
    assert _train(tmp_path, small_corpus, "r", *sets) == 0
    store = tmp_path / "r" / "checkpoints"
    (store / "step-00000004" / "meta.json").unlink()  # a save cut short, or a hand
    capsys.readouterr()
    argv = ["train", "--resume", str(tmp_path / "r"), "--set", "train.steps=6", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "resuming from step 2: the newer step-00000004 is incomplete" in err
    assert (store / "step-00000004" / "meta.json").is_file()  # saved again at step 4
    assert (store / "step-00000006" / "meta.json").is_file()
    assert [p.name.startswith(".broken-step-00000004-") for p in store.glob(".broken-*")] == [True]
    assert not list(store.glob(".tmp-*"))


def test_tensorboard_events_hold_the_records(tmp_path, small_corpus) -> None:
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sets = ["train.steps=4", "train.log_every=2", "train.eval_every=2", "train.tensorboard=True"]
    assert _train(tmp_path, small_corpus, "tb", *sets) == 0
    run = tmp_path / "tb"
    assert list(run.glob("events.out.tfevents.*"))  # beside metrics.jsonl
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run))
    events.Reload()
    for key, tag in (("loss", "train/loss"), ("val_loss", "val/loss"), ("lr", "train/lr")):
        want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-6), tag  # (stored as fp32)


def test_emulated_bf16_is_named_with_its_cost(tmp_path, small_corpus, capsys, monkeypatch) -> None:
    import importlib

    amp = importlib.import_module("colfunc.transforms.amp")  # (the module: cf.transforms.amp
    # is the transform itself)
    monkeypatch.setattr(amp, "bf16_is_native", lambda: False)  # as on an AVX2-only CPU
    assert _train(tmp_path, small_corpus, "b", "train.steps=1", 'parallel.amp="bf16"') == 0
    err = capsys.readouterr().err
    assert "amp dtype bf16 on a CPU without native bf16" in err and "x an fp32 one here" in err
    monkeypatch.setattr(amp, "bf16_is_native", lambda: True)
    assert _train(tmp_path, small_corpus, "c", "train.steps=1", 'parallel.amp="bf16"') == 0
    assert "without native bf16" not in capsys.readouterr().err


@pytest.mark.parametrize("target", ["state.safetensors", "meta.json", "step-00000001"])
def test_an_unreadable_checkpoint_says_permission_denied(
    tmp_path, small_corpus, capsys, monkeypatch, target
) -> None:
    """(Tests may run as root, whom no mode stops: the check is made to see the file as
    unreadable.)"""
    import os

    assert _train(tmp_path, small_corpus, "r", "train.steps=1") == 0
    real = os.access

    def access(path, mode, **kw):  # type: ignore[no-untyped-def]
        return False if str(path).endswith(target) else real(path, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    capsys.readouterr()
    assert main(["generate", "--run", str(tmp_path / "r"), "--prompt", "a"]) == 2
    _one_line(capsys.readouterr().err, f"{target}' cannot be read: permission denied")


def test_set_parallel_takes_dotted_keys_so_a_resume_can_add_a_pipeline(
    tmp_path, small_corpus, capsys
) -> None:
    base = config.default()
    cfg = config.override(base, ["parallel.tensor=2", "parallel.tensor.sequence_parallel=True"])
    assert cfg.parallel == {"tensor": {"size": 2, "sequence_parallel": True}}
    cfg = config.override(base, ["parallel.pipeline.stages=2", "parallel.pipeline.microbatches=4"])
    assert cfg.parallel == {"pipeline": {"stages": 2, "microbatches": 4}}
    with pytest.raises(ValueError, match=r"parallel\['data'\] is 2, not a dict"):
        config.override(base, ["parallel.data=2", "parallel.data.size=2"])
    assert _train(tmp_path, small_corpus, "r", "train.steps=2", "model.n_layer=2") == 0
    argv = ["train", "--resume", str(tmp_path / "r"), "--set", "train.steps=4", "--no-progress"]
    argv += ["--set", "parallel.pipeline.stages=2", "--set", "parallel.pipeline.microbatches=2"]
    capsys.readouterr()
    assert main(argv) == 0
    assert "mesh {'dp': 1, 'pp': 2}" in capsys.readouterr().out
    assert (tmp_path / "r" / "checkpoints" / "step-00000004" / "meta.json").is_file()
