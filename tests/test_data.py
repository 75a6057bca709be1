"""The byte tokenizer against Python's own UTF-8 codec; corpus splits; seeded batches."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from colfunc import data


@given(st.text())
def test_encode_is_utf8_and_round_trips(text: str) -> None:
    ids = data.encode(text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert data.decode(ids) == text


@given(st.binary())
def test_decode_replaces_invalid_utf8_as_python_does(raw: bytes) -> None:
    ids = torch.tensor(list(raw), dtype=torch.long)
    assert data.decode(ids) == raw.decode("utf-8", errors="replace")


def test_decode_rejects_ids_outside_the_byte_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 256\).*300"):
        data.decode(torch.tensor([65, 300]))


def _write_folder(root: Path, n_files: int = 40) -> dict[str, bytes]:
    """A folder corpus plus files that must be skipped; returns the expected files' bytes."""
    expected = {}
    for i in range(n_files):
        rel = f"pkg{i % 3}/mod_{i}.py"
        text = f"# file {i}\n" + f"def f():\n    return {i}\n" * (i + 1)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        expected[rel] = text.encode()
    (root / "empty.txt").write_text("")
    (root / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".hidden.py").write_text("hidden = 1\n")
    return expected


def test_folder_split_is_deterministic_disjoint_and_complete(tmp_path: Path) -> None:
    expected = _write_folder(tmp_path)
    a = data.load_corpus(str(tmp_path), val_fraction=0.2)
    b = data.load_corpus(str(tmp_path), val_fraction=0.2)
    assert a.split == "files"
    assert a.train_files == b.train_files and torch.equal(a.train, b.train)
    assert not set(a.train_files) & set(a.val_files)
    assert sorted(a.train_files + a.val_files) == sorted(expected)
    for files, tokens in ((a.train_files, a.train), (a.val_files, a.val)):
        assert list(files) == sorted(files)
        want = b"".join(expected[f] for f in files)
        assert bytes(tokens.tolist()) == want
        assert all(data.is_validation(f, 0.2) == (tokens is a.val) for f in files)


def test_stdlib_corpus_is_the_standard_library_sources() -> None:
    corpus = data.load_corpus("stdlib")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = corpus.train_files + corpus.val_files
    assert corpus.split == "files"
    assert "argparse.py" in files and "json/decoder.py" in files
    assert all(f.endswith(".py") for f in files)
    assert not any(f.startswith(("site-packages/", "test/")) for f in files)
    total = corpus.train.numel() + corpus.val.numel()
    assert total == sum((stdlib / f).stat().st_size for f in files)
    assert 0.02 < corpus.val.numel() / total < 0.1  # about 5%, by file


def test_a_single_file_is_split_by_position(tmp_path: Path) -> None:
    text = "".join(f"line {i}\n" for i in range(200)).encode()
    (tmp_path / "book.txt").write_bytes(text)
    corpus = data.load_corpus(str(tmp_path / "book.txt"), val_fraction=0.1)
    assert corpus.split == "tail"
    assert corpus.val.numel() == round(len(text) * 0.1)
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()) == text


@pytest.mark.parametrize("kind", ["empty folder", "empty file", "only binary", "missing"])
def test_a_corpus_without_text_is_an_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "corpus"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "empty file":
        path.write_text("")
    elif kind == "only binary":
        path.mkdir()
        (path / "a.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="corpus"):
        data.load_corpus(str(path))
    with pytest.raises(ValueError, match=re.escape(str(path))):
        data.load_corpus(str(path))


@given(
    n=st.integers(1, 200),
    seq_len=st.integers(1, 64),
    batch_size=st.integers(1, 8),
    seed=st.integers(0, 2**40),
    step=st.integers(0, 10**9),
)
def test_batches_are_windows_of_the_corpus(
    n: int, seq_len: int, batch_size: int, seed: int, step: int
) -> None:
    tokens = torch.arange(n, dtype=torch.uint8)  # each value is its own position
    if seq_len > n:
        with pytest.raises(ValueError, match="seq_len"):
            data.batch_at(tokens, batch_size, seq_len, seed, step)
        return
    batch = data.batch_at(tokens, batch_size, seq_len, seed, step)
    ids = batch["input_ids"]
    assert ids.shape == (batch_size, seq_len) and ids.dtype == torch.long
    assert torch.equal(batch["labels"], ids)
    starts = ids[:, :1]
    assert torch.equal(ids, starts + torch.arange(seq_len))  # contiguous windows
    assert int(starts.min()) >= 0 and int(starts.max()) + seq_len <= n
    again = data.batch_at(tokens, batch_size, seq_len, seed, step)
    assert torch.equal(again["input_ids"], ids)


def test_batches_depend_on_seed_and_step_only() -> None:
    tokens = torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(torch.uint8)
    stream = data.batches(tokens, 4, 32, seed=7, start=5)
    for step in range(5, 9):
        assert torch.equal(
            next(stream)["input_ids"], data.batch_at(tokens, 4, 32, 7, step)["input_ids"]
        )
    ids = data.batch_at(tokens, 4, 32, 7, 5)["input_ids"]
    assert not torch.equal(ids, data.batch_at(tokens, 4, 32, 7, 6)["input_ids"])
    assert not torch.equal(ids, data.batch_at(tokens, 4, 32, 8, 5)["input_ids"])
