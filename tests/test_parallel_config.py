"""``parallel = dict(...)`` in a config file: parsing, and ``colfunc train`` on a mesh.

A parallel run of the training loop must reproduce the single-device run's losses (the same maths
in a different order: fp32 within 1e-4 relative over a few steps), and its run folder must hold a
checkpoint that ``colfunc generate`` reads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colfunc import parallel
from colfunc.cli import main

SLOW = pytest.mark.slow

pytestmark = pytest.mark.timeout(240)

CONFIG = """
from colfunc import models
from colfunc.config import DataConfig, OptimConfig, TrainConfig

model = models.gpt.Config(vocab_size=256, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
optim = OptimConfig(lr=1e-2, warmup_steps=2)
data = DataConfig(corpus={corpus!r}, batch_size=8, seq_len=32)
train = TrainConfig(steps=6, log_every=2, eval_every=3, eval_batches=2, sample_tokens=10, out_dir={out!r})
parallel = {parallel}
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"mod{i}.py").write_text(f"def mul{i}(a, b):\n    return a * b - {i}\n" * 8)
    return root


def _config(tmp: Path, corpus: Path, name: str, section: dict) -> Path:
    path = tmp / f"{name}.py"
    path.write_text(CONFIG.format(corpus=str(corpus), out=str(tmp / "runs"), parallel=section))
    return path


def _losses(run: Path) -> list[float]:
    return [
        json.loads(line)["loss"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]


@pytest.mark.parametrize(
    "section",
    [
        {"data": 2, "zero": {"stage": 2}},
        {"data": 2, "zero": {"stage": 3, "prefetch": 2}},
        {"tensor": {"size": 2, "sequence_parallel": True}, "zero": 3, "remat": "full"},
        {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "1f1b"}, "data": 2},
        {"sequence": {"mode": "ring", "size": 2}, "data": 2, "zero": 3},
        {"sequence": {"mode": "zigzag", "size": 4}},
        # the slowest sections (5-8 s each) run with -m slow; tests of their own cover them
        pytest.param({"sequence": {"mode": "ulysses", "size": 2}, "tensor": 2}, marks=SLOW),
        pytest.param(
            {"sequence": {"mode": "usp", "size": 4, "ulysses": 2}, "remat": "full"}, marks=SLOW
        ),
        {"data": 2, "zero": 3, "offload": {"policy": "auto", "device_budget": "64MiB"}},
        {"data": 2, "zero": 2, "offload": {"policy": "host", "device_budget": "64MiB"}},
        pytest.param(
            {
                "data": 2,
                "tensor": 2,
                "zero": 3,
                "offload": {"policy": "auto", "device_budget": "64MiB"},
            },
            marks=SLOW,
        ),
    ],
)
def test_parallel_training_reproduces_the_single_device_run(tmp_path, corpus, section) -> None:
    single = _config(tmp_path, corpus, "single", {})
    multi = _config(tmp_path, corpus, "multi", section)
    assert main(["train", str(single), "--name", "one", "--no-progress"]) == 0
    assert main(["train", str(multi), "--name", "many", "--no-progress"]) == 0
    one, many = _losses(tmp_path / "runs" / "one"), _losses(tmp_path / "runs" / "many")
    assert len(one) == len(many) >= 3
    assert many == pytest.approx(one, rel=1e-4)
    assert (
        main(["generate", "--run", str(tmp_path / "runs" / "many"), "--max-new-tokens", "5"]) == 0
    )


@pytest.mark.slow  # about 15 s; test_launch runs colfunc run under torchrun by default
def test_colfunc_run_trains_on_torchrun_ranks(tmp_path, corpus) -> None:
    cfg = _config(tmp_path, corpus, "tp", {"tensor": 2})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "colfunc",
            "run",
            "-n",
            "2",
            "train",
            str(cfg),
            "--name",
            "tr",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mesh {'dp': 1, 'tp': 2} (gloo)" in proc.stdout
    assert len(_losses(tmp_path / "runs" / "tr")) >= 3


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"data": 0}, "data must be an int >= 1"),
        ({"tensor": {"size": 2, "overlap": True}}, "unknown key 'overlap'"),
        ({"zero": 5}, "zero stage must be"),
        ({"zero": {"stage": 3, "prefetch": -1}}, "zero prefetch must be"),
        ({"zero": {"stage": 3, "buckets": 2}}, "takes only stage= and prefetch="),
        ({"pipelines": 2}, "unknown key 'pipelines'"),
        ({"backend": "mpi"}, "backend must be"),
        ({"pipeline": "two"}, "must be a dict like"),
        ({"pipeline": 0}, "must be a dict like"),
        ({"sequence": {"mode": "rings", "size": 2}}, "mode must be one of"),
        ({"sequence": {"size": 2}}, "needs mode="),
        ({"sequence": {"mode": "ring", "size": 0}}, "size must be an int >= 1"),
        ({"sequence": {"mode": "usp", "size": 4}}, "needs ulysses=U"),
        ({"sequence": {"mode": "usp", "size": 4, "ulysses": 3}}, "a divisor of size=4"),
        ({"sequence": {"mode": "ring", "size": 2, "ulysses": 2}}, "ulysses= is for mode='usp'"),
        ({"sequence": {"mode": "ring", "size": 2, "depth": 2}}, "unknown key 'depth'"),
        ({"sequence": {"mode": "megatron", "size": 2}}, "splits the sequence over the tensor"),
        (
            {
                "sequence": {"mode": "ring", "size": 2},
                "tensor": {"size": 2, "sequence_parallel": True},
            },
            "choose one",
        ),
        ({"sequence": "ring"}, "must be a dict like dict"),
    ],
)
def test_bad_parallel_sections_are_named(section, match) -> None:
    with pytest.raises(ValueError, match=match):
        parallel.parse(section)


def test_bad_parallel_section_exits_2_with_one_line(tmp_path, corpus, capsys) -> None:
    cfg = _config(tmp_path, corpus, "bad", {"tensor": {"size": 2, "overlap": True}})
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overlap" in err[0]


def test_sequence_sections_build_their_meshes() -> None:
    usp = parallel.parse({"data": 2, "sequence": {"mode": "usp", "size": 4, "ulysses": 2}})
    assert usp.mesh_shape == {"dp": 2, "sp_ring": 2, "sp_ulysses": 2}
    ring = parallel.parse({"sequence": {"mode": "ring", "size": 4}, "tensor": 2})
    assert ring.mesh_shape == {"dp": 1, "sp": 4, "tp": 2}
    megatron = parallel.parse({"sequence": {"mode": "megatron"}, "tensor": 2})
    assert megatron.mesh_shape == {"dp": 1, "tp": 2} and megatron.sequence_parallel


def test_a_seq_len_that_zigzag_cannot_split_exits_2_with_one_line(tmp_path, corpus, capsys) -> None:
    cfg = _config(tmp_path, corpus, "zz", {"sequence": {"mode": "zigzag", "size": 3}})
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.seq_len=32 is not divisible by 2 x size = 6" in err[0]


@pytest.mark.slow  # about 19 s; every ring mode runs on gloo in test_sequence_gloo
def test_colfunc_run_trains_with_ring_attention(tmp_path, corpus) -> None:
    cfg = _config(tmp_path, corpus, "sp", {"sequence": {"mode": "zigzag", "size": 2}})
    command = [sys.executable, "-m", "colfunc", "run", "-n", "2", "train", str(cfg)]
    proc = subprocess.run(
        [*command, "--name", "sp", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mesh {'dp': 1, 'sp': 2} (gloo)" in proc.stdout
    assert len(_losses(tmp_path / "runs" / "sp")) >= 3


def test_parallel_example_builds_its_mesh() -> None:
    from colfunc import config
    from colfunc.transforms.amp import bf16_is_native

    path = Path(__file__).resolve().parents[1] / "examples" / "configs" / "gpt_tiny_parallel.py"
    cfg = config.load(path)
    pc = parallel.parse(cfg.parallel)
    assert pc.mesh_shape == {"dp": 2, "tp": 2}
    # bf16 where the CPU (or a GPU) computes it natively, else fp32: an emulated bf16 is slow
    bf16 = "bf16" if bf16_is_native() else "fp32"
    assert (pc.sequence_parallel, pc.zero, pc.amp, pc.remat) == (True, 2, {"dtype": bf16}, "full")
    assert cfg.model == config.default().model  # the default model, on a mesh


def test_the_collective_timeout_is_configurable_and_checked() -> None:
    from colfunc import parallel

    assert parallel.parse({"data": 2}).timeout == 600.0
    assert parallel.parse({"data": 2, "timeout": 30}).timeout == 30
    for bad in (0, -1, float("inf"), "10", True):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            parallel.parse({"data": 2, "timeout": bad})


def test_colfunc_run_names_its_run_as_a_threads_run_is(tmp_path, corpus) -> None:
    """Under colfunc run every rank names the run <config>-<date>-<time> (the start time the
    launcher hands them), as the README says, not torchrun's run id."""
    cfg = _config(tmp_path, corpus, "named", {"data": 2})
    command = [sys.executable, "-m", "colfunc", "run", "-n", "2", "train", str(cfg)]
    proc = subprocess.run(
        [*command, "--no-progress", "--set", "train.steps=2", "--set", "train.sample_tokens=0"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"named-\d{8}-\d{6}", run.name), run.name
    assert (run / "metrics.jsonl").is_file()
