"""Config files, --set overrides with coercion, and the errors a person can act on."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from colfunc import config
from colfunc.cli import main
from colfunc.models import gpt, llama

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def test_gpt_tiny_example_is_the_default() -> None:
    cfg = config.load(EXAMPLES / "gpt_tiny.py")
    assert cfg == config.default()
    assert cfg.model == gpt.Config.tiny()
    assert cfg.data.corpus == "stdlib"


def test_llama_tiny_example_trains_llama() -> None:
    cfg = config.load(EXAMPLES / "llama_tiny.py")
    assert cfg.model == llama.Config.tiny()
    assert config.model_module(cfg.model) is llama


def test_set_coerces_by_annotation() -> None:
    cfg = config.load(
        None,
        [
            "train.steps=100",
            "optim.lr=1e-3",
            "optim.betas=0.8, 0.99",
            "data.corpus=some/folder",
            "train.name=123",
            "model.n_layer=2",
            "model.d_ff=None",
        ],
    )
    assert cfg.train.steps == 100 and type(cfg.train.steps) is int
    assert cfg.optim.lr == 1e-3 and type(cfg.optim.lr) is float
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.data.corpus == "some/folder"
    assert cfg.train.name == "123"
    assert cfg.model.n_layer == 2 and cfg.model.d_ff == 4 * cfg.model.d_model
    assert config.load(None, ["optim.betas=(0.5,0.6)"]).optim.betas == (0.5, 0.6)
    tied = config.load(EXAMPLES / "llama_tiny.py", ["model.tie_embeddings=true"])
    assert tied.model.tie_embeddings is True
    assert (
        config.load(EXAMPLES / "llama_tiny.py", ["model.tie_embeddings=0"]).model.tie_embeddings
        is False
    )


def test_set_changes_the_parallel_section() -> None:
    base = config.load(EXAMPLES / "gpt_tiny_parallel.py")
    cfg = config.override(
        base,
        ["parallel.data=1", "parallel.zero={'stage': 3, 'prefetch': 2}", "parallel.remat=full"],
    )
    assert cfg.parallel == {
        **base.parallel,
        "data": 1,
        "zero": {"stage": 3, "prefetch": 2},
        "remat": "full",
    }
    assert base.parallel != cfg.parallel  # the loaded config is left as it was
    assert config.load(None, ["parallel.data=2"]).parallel == {"data": 2}
    with pytest.raises(ValueError, match="--set parallel: parallel: zero stage must be"):
        config.override(base, ["parallel.zero=7"])
    with pytest.raises(ValueError, match="unknown key 'datas'"):
        config.load(None, ["parallel.datas=2"])


def test_fields_that_change_together_are_set_together() -> None:
    # n_head=3 alone does not divide d_model=128; together with d_model=96 it does.
    cfg = config.load(None, ["model.n_head=3", "model.d_model=96"])
    assert (cfg.model.n_head, cfg.model.d_model) == (3, 96)


def test_derived_fields_follow_what_they_derive_from() -> None:
    # gpt.Config resolves d_ff=None to 4 * d_model: a wider model gets a wider MLP...
    wide = config.load(None, ["model.d_model=256"]).model
    assert wide == gpt.Config(vocab_size=256, n_layer=4, n_head=4, d_model=256, max_seq_len=128)
    # ...unless d_ff is set, here or in the config file
    assert config.load(None, ["model.d_model=256", "model.d_ff=300"]).model.d_ff == 300
    explicit = config.load(EXAMPLES / "llama_tiny.py", ["model.n_head=8"]).model
    assert explicit.n_kv_heads == 2  # given explicitly in llama_tiny.py


@pytest.mark.parametrize(
    ("item", "names"),
    [
        ("train.steps=abc", ["train.steps", "'abc'"]),
        ("optim.lr=fast", ["optim.lr", "'fast'"]),
        ("train.stepz=3", ["train.stepz", "steps"]),
        ("trian.steps=3", ["'trian'", "train"]),
        ("train.steps", ["section.field=value"]),
        ("optim.betas=0.9", ["optim.betas", "'0.9'"]),
        ("model.n_head=3", ["n_head=3", "d_model=128"]),
        ("train.steps=0", ["train.steps", "0"]),
        ("data.seq_len=256", ["data.seq_len=256", "max_seq_len=128"]),
        ("optim.final_lr=1.0", ["optim.final_lr"]),
        ("data.val_fraction=1.5", ["data.val_fraction", "1.5"]),
    ],
)
def test_bad_overrides_name_the_field(item: str, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        config.load(None, [item])
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (config.TrainConfig, "steps", -1),
        (config.TrainConfig, "log_every", 2.5),
        (config.TrainConfig, "name", "a/b"),
        (config.DataConfig, "batch_size", 0),
        (config.DataConfig, "corpus", ""),
        (config.OptimConfig, "lr", float("nan")),
        (config.OptimConfig, "betas", (0.9, 1.0)),
        (config.OptimConfig, "warmup_steps", True),
    ],
)
def test_sections_validate_their_fields(cls: type, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        cls(**{field: value})


def test_round_trip_through_json() -> None:
    for cfg in (
        config.default(),
        config.load(EXAMPLES / "llama_tiny.py", ["optim.betas=0.8,0.9", "train.name=x"]),
    ):
        d = json.loads(json.dumps(config.to_dict(cfg)))
        assert config.from_dict(d) == cfg


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    partial = _write(
        tmp_path / "partial.py", "from colfunc.config import TrainConfig\ntrain = TrainConfig()\n"
    )
    with pytest.raises(ValueError, match=r"partial\.py.*missing model, optim, data"):
        config.load(partial)
    broken = _write(tmp_path / "broken.py", "model = 1 / 0\n")
    with pytest.raises(ValueError, match=r"broken\.py.*ZeroDivisionError"):
        config.load(broken)
    with pytest.raises(ValueError, match=r"nowhere\.py.*does not exist"):
        config.load(tmp_path / "nowhere.py")
    wrong = _write(
        tmp_path / "wrong.py",
        (EXAMPLES / "gpt_tiny.py").read_text() + "\noptim = dict(lr=1.0)\n",
    )
    with pytest.raises(
        ValueError, match=r"wrong\.py.*optim must be a colfunc\.config\.OptimConfig"
    ):
        config.load(wrong)


def test_overrides_can_make_a_config_file_whole(tmp_path: Path) -> None:
    # a folder's model with a shorter context than the file's seq_len: --set fixes it
    long = _write(
        tmp_path / "long.py",
        (EXAMPLES / "gpt_tiny.py").read_text()
        + "\ndata = dataclasses.replace(data, seq_len=4096)\nimport dataclasses\n",
    )
    long.write_text("import dataclasses\n" + long.read_text())
    with pytest.raises(ValueError, match=r"long\.py.*data\.seq_len=4096 is longer"):
        config.load(long)
    cfg = config.load(long, ["data.seq_len=64"])
    assert cfg.data.seq_len == 64
    # an override that leaves it broken says so, naming the file and the overrides
    with pytest.raises(
        ValueError, match=r"long\.py.*with --set train\.steps=3: data\.seq_len=4096 is longer"
    ):
        config.load(long, ["train.steps=3"])
    with pytest.raises(ValueError, match=r"long\.py.*--set data\.seq_len=9999: .*is longer"):
        config.load(long, ["data.seq_len=9999"])
    # the sections themselves are still checked before any override
    wrong = _write(tmp_path / "wrong.py", (EXAMPLES / "gpt_tiny.py").read_text() + "\noptim = 3\n")
    with pytest.raises(ValueError, match=r"wrong\.py.*optim must be"):
        config.load(wrong, ["train.steps=3"])


def test_parallel_section_is_kept_and_checked_by_train(tmp_path: Path) -> None:
    from colfunc import train

    path = _write(
        tmp_path / "par.py", (EXAMPLES / "gpt_tiny.py").read_text() + "\nparallel = dict(dp=2)\n"
    )
    cfg = config.load(path)
    assert cfg.parallel == {"dp": 2}
    with pytest.raises(ValueError, match="parallel has unknown key 'dp'"):
        train.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert dataclasses.replace(cfg, parallel={}) == config.default()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--set", "train.steps=abc"], "train.steps"),
        (["--set", "train.stepz=3"], "train.stepz"),
        (["--set", "model.n_head=3"], "n_head=3"),
        (["missing_config.py"], "missing_config.py"),
        (["--bogus"], "--bogus"),
    ],
)
def test_cli_reports_config_errors_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    needle: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("colfunc: error: ")
    assert needle in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written
