"""The ``colfunc`` command end to end: train, generate, resume, bench, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from colfunc import cli, data, engines, tree
from colfunc import train as trainer
from colfunc.cli import main
from colfunc.generate import sample
from colfunc.inference import SamplingParams
from colfunc.models import gpt

TIMINGS = ("elapsed", "tokens_per_s")
# runs compared bit for bit use one thread count: by default `colfunc train` takes one thread per
# idle core, and MKL's matmuls round differently with another thread count
ONE_THREAD = ["--threads", "1"]
TINY_SETS = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.batch_size=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=3",
    "train.steps=12",
    "train.log_every=4",
    "train.eval_every=6",
    "train.eval_batches=2",
    "train.sample_tokens=20",
]


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"mod{i}.py").write_text(f"def add{i}(a, b):\n    return a + b + {i}\n" * 8)
    return root


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained once by ``colfunc train`` for the tests below to read."""
    out = tmp_path_factory.mktemp("runs")
    argv = ["train", *_sets(*TINY_SETS, f"data.corpus={corpus}", f"train.out_dir={out}")]
    assert main([*argv, "--name", "tiny", "--no-progress", *ONE_THREAD]) == 0
    return out / "tiny"


def _one_error_line(err: str, *needles: str) -> None:
    assert err.startswith("colfunc: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_train_writes_metrics_plot_and_checkpoint(trained: Path, corpus: Path) -> None:
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4, 6, 8, 12]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6, 12]
    for r in records[1:]:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed"}
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.5  # it learned something
    assert (trained / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    state, cfg = trainer.load_run(trained)
    assert state.step == 12 and cfg.data.corpus == str(corpus) and cfg.model.d_model == 32
    val = data.load_corpus(str(corpus)).val
    batches = [data.batch_at(val, 4, 32, 0, i) for i in range(2)]
    assert records[-1]["val_loss"] == trainer.evaluate(gpt.loss(cfg.model), state.params, batches)


def test_generate_prints_the_seeded_sample(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--run", str(trained), "--prompt", "def ", "--max-new-tokens", "40"]
    assert main([*argv, "--seed", "3"]) == 0
    out = capsys.readouterr().out
    # the engine's sample: 40 new bytes, or fewer where the model's context ends
    engine = engines.from_run(trained)
    p = SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=40)
    (want,) = engine.generate(["def "], p)
    room = engine.cfg.max_seq_len - 4
    assert len(want.outputs[0].token_ids) == min(40, room)
    assert out == "def " + want.outputs[0].text + "\n"
    assert main([*argv, "--seed", "3"]) == 0
    assert capsys.readouterr().out == out  # seeded
    assert main([*argv, "--seed", "4"]) == 0
    assert capsys.readouterr().out != out


def _reference_greedy(params: dict, cfg: gpt.Config, ids: list[int], n: int) -> list[int]:
    for _ in range(n):
        context = torch.tensor(ids[-cfg.max_seq_len :])[None]
        ids.append(int(gpt.apply(params, context, cfg)[0, -1].argmax()))
    return ids


def test_sample_greedy_and_top1_match_a_plain_argmax_loop() -> None:
    cfg = gpt.Config(vocab_size=256, n_layer=1, n_head=2, d_model=32, max_seq_len=8)
    params = gpt.init(cfg, seed=1)
    prompt = data.encode("hello")
    want = _reference_greedy(params, cfg, prompt.tolist(), 12)  # runs past max_seq_len
    assert sample(gpt.apply, params, cfg, prompt, 12, temperature=0).tolist() == want
    assert sample(gpt.apply, params, cfg, prompt, 12, temperature=1.3, top_k=1).tolist() == want
    with pytest.raises(ValueError, match="temperature"):
        sample(gpt.apply, params, cfg, prompt, 1, temperature=-1)
    with pytest.raises(ValueError, match="prompt"):
        sample(gpt.apply, params, cfg, data.encode(""), 1)


def test_resume_extends_a_run(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import shutil

    run = tmp_path / "tiny"
    shutil.copytree(trained, run)
    assert main(["train", "--resume", str(run), "--set", "train.steps=16", "--no-progress"]) == 0
    state, cfg = trainer.load_run(run)
    assert state.step == 16 and cfg.train.steps == 16
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 4, 6, 8, 12, 16]
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2  # already finished
    _one_error_line(capsys.readouterr().err, "already at step 16", "train.steps")
    assert main(["train", "--resume", str(run), "--set", "model.n_layer=2"]) == 2
    _one_error_line(capsys.readouterr().err, "model.n_layer=2")


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(
    trained: Path, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_at = data.batch_at

    def interrupted(*args: Any) -> dict[str, torch.Tensor]:
        if args[-1] == 7:  # Ctrl-C while fetching the batch of step 7
            raise KeyboardInterrupt
        return batch_at(*args)

    argv = ["train", *_sets(*TINY_SETS, f"data.corpus={corpus}", f"train.out_dir={tmp_path}")]
    monkeypatch.setattr(data, "batch_at", interrupted)
    assert main([*argv, "--name", "cut", "--no-progress", *ONE_THREAD]) == 130
    monkeypatch.undo()
    assert trainer.load_run(tmp_path / "cut")[0].step == 7
    resume = ["train", "--resume", str(tmp_path / "cut"), "--no-progress", *ONE_THREAD]
    assert main(resume) == 0

    def final(run: Path) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        state, _ = trainer.load_run(run)
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        timeless = [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]
        return tree.tensors(state.params), timeless

    (params_cut, cut), (params_straight, straight) = map(final, [tmp_path / "cut", trained])
    assert all(torch.equal(a, b) for a, b in zip(params_cut, params_straight, strict=True))
    # the interrupted run also recorded step 7, so its record at step 8 averages one step only
    assert [r["step"] for r in cut] == [0, 4, 6, 7, 8, 12]
    assert [r for r in cut if r["step"] not in (7, 8)] == [r for r in straight if r["step"] != 8]
    assert {**cut[4], "loss": None} == {**straight[3], "loss": None}


def test_train_uses_the_cores_other_work_leaves_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[int] = []
    monkeypatch.setattr(trainer, "run", lambda *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(cli, "_LOADAVG", str(loadavg))
    try:
        # the tasks runnable now (this one among them), not the lagging load average (7.0)
        for running, extra in [(1, []), (3, []), (9, []), (9, ["--threads", "3"])]:
            loadavg.write_text(f"7.00 6.00 5.00 {running}/412 9876\n")
            assert main(["train", *extra]) == 0
            assert torch.get_num_threads() == 4  # restored afterwards
        assert seen == [4, 2, 1, 3]
        # without /proc/loadavg: the 1-minute load average
        monkeypatch.setattr(cli, "_LOADAVG", str(tmp_path / "absent"))
        monkeypatch.setattr(os, "getloadavg", lambda: (1.6, 1.0, 1.0))
        assert main(["train"]) == 0
        assert seen[-1] == 2
        assert main(["train", "--threads", "0"]) == 2
        _one_error_line(capsys.readouterr().err, "--threads")
    finally:
        torch.set_num_threads(before)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_errors_exit_2_in_one_line_and_overwrite_nothing(
    trained: Path,
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    before = _snapshot(trained)
    existing = [
        "train",
        *_sets(*TINY_SETS, f"data.corpus={corpus}", f"train.out_dir={trained.parent}"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("def f(): pass\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "checkpoint").mkdir()
    (broken / "checkpoint" / "meta.json").write_text("{not json")
    (broken / "checkpoint" / "state.safetensors").write_bytes(b"\x00" * 10)
    cases = [
        ([*existing, "--name", "tiny"], ["already exists", str(trained)]),
        (["train", "--set", f"data.corpus={tmp_path / 'empty'}"], ["empty", "no text"]),
        (["train", "--set", f"data.corpus={tmp_path / 'empty.txt'}"], ["empty.txt", "no text"]),
        (
            ["train", *_sets(*TINY_SETS, f"data.corpus={tmp_path / 'short.txt'}")],
            ["data.seq_len=32"],
        ),
        (["train", "--resume", str(tmp_path / "nowhere")], ["nowhere"]),
        (["train", "--resume", str(broken)], ["meta.json", "corrupt"]),
        (["generate", "--run", str(tmp_path / "nowhere")], ["nowhere"]),
        (["generate", "--run", str(trained), "--prompt", ""], ["--prompt"]),
        (["generate", "--run", str(trained), "--temperature", "-1"], ["temperature"]),
        (["generate", "--run", str(trained), "--top-k", "two"], ["--top-k", "two"]),
    ]
    for argv, needles in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        _one_error_line(captured.err, *needles)
        assert captured.out == ""
    assert _snapshot(trained) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "broken",
        "empty",
        "empty.txt",
        "short.txt",
    ]


def test_bench_runs_a_script_with_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "_helper.py").write_text("FACTOR = 3\n")
    (tmp_path / "benchmarks" / "echo.py").write_text(
        "import sys\nfrom _helper import FACTOR\n"
        "if __name__ == '__main__':\n    print(sys.argv[1:], FACTOR)\n"
    )
    (tmp_path / "benchmarks" / "fails.py").write_text("import sys\nsys.exit(3)\n")
    assert main(["bench", "echo", "--steps", "5", "x"]) == 0
    assert capsys.readouterr().out == "['--steps', '5', 'x'] 3\n"
    assert main(["bench", "fails"]) == 3
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    _one_error_line(err, "unknown benchmark 'nope'", "echo", "fails")
    assert "_helper" not in err


def test_installed_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    bindir = Path(sys.executable).parent
    exe = bindir / "colfunc"
    result = subprocess.run(
        [str(exe), "train", "--set", "train.steps=abc"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    _one_error_line(result.stderr, "train.steps", "'abc'")
    assert list(tmp_path.iterdir()) == []


def test_generate_refuses_a_checkpoint_that_does_not_fit_or_is_not_finite(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As --resume does: tensors that disagree with the run's config, or NaN parameters, are a
    one-line error (exit 2), not a traceback or text sampled from garbage; an absurd
    --max-new-tokens stops at the model's context."""
    import dataclasses

    from colfunc import checkpoint

    state, cfg = trainer.load_run(trained)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=64))
    checkpoint.commit(tmp_path / "wide" / trainer.CHECKPOINTS, state.step, state, wider)
    assert main(["generate", "--run", str(tmp_path / "wide"), "--max-new-tokens", "5"]) == 2
    _one_error_line(capsys.readouterr().err, "has shape", "the checkpoint and its config disagree")

    nan = state._replace(params=tree.map(lambda x: x.clone(), state.params))
    nan.params["blocks"]["mlp"]["w_in"][0, 0, 0] = float("nan")
    checkpoint.commit(tmp_path / "nan" / trainer.CHECKPOINTS, nan.step, nan, cfg)
    assert main(["generate", "--run", str(tmp_path / "nan"), "--max-new-tokens", "5"]) == 2
    _one_error_line(capsys.readouterr().err, "'blocks.mlp.w_in'", "not finite")

    assert main(["generate", "--run", str(trained), "--max-new-tokens", "1000000000000"]) == 0
    out = capsys.readouterr().out  # the prompt and at most the context's worth of bytes
    assert 0 < len(out.rstrip("\n").encode()) <= cfg.model.max_seq_len


def test_two_runs_started_in_the_same_second_get_two_folders(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setattr(time, "strftime", lambda *a: "20260101-120000")
    argv = ["train", *_sets(*TINY_SETS, f"data.corpus={corpus}", f"train.out_dir={tmp_path}")]
    argv += ["--set", "train.steps=2", "--set", "train.sample_tokens=0", "--no-progress"]
    assert main(argv) == 0
    assert main(argv) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gpt_tiny-20260101-120000", "gpt_tiny-20260101-120000-2"]
    for name in names:
        assert trainer.load_run(tmp_path / name)[0].step == 2
