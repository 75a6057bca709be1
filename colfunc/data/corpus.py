"""Text corpora as byte tensors, split deterministically into train and validation.

The default corpus (``"stdlib"``) is the running Python's own standard library: its ``.py`` files
under ``sysconfig.get_paths()["stdlib"]``, without installed packages and without the regression
test suites (about 12 MB on CPython 3.11). Any other text file, or folder of text files, works the
same way.

Files are split by a stable hash of their relative path, so a file is wholly train or wholly
validation and the split is the same on every machine and every run. A corpus whose files all land
on one side (a single file, a few small files) is split by position instead: the last
``val_fraction`` of its bytes is validation.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["Corpus", "is_validation", "load_corpus"]

# Installed packages are not the standard library; the test suites are mostly fixtures and
# generated data, which would drown the code a model should learn from.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary (as git does)


class Corpus(NamedTuple):
    """Train and validation bytes (``uint8[N]`` tensors) and where they came from.

    ``train_files``/``val_files`` are the relative paths on each side when the split is by file
    (``split == "files"``); with ``split == "tail"`` every file is in ``train_files`` and the
    validation bytes are the end of the concatenation.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    split: str


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Whether the file at ``relpath`` (POSIX, relative to the corpus root) is validation data."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and d != "__pycache__"]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, files


def _folder_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden folders (.git, .venv) and caches are never corpus text.
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return files


def _read_text_bytes(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:  # unreadable (permissions, a dangling link): not part of the corpus
        return None
    return None if b"\0" in data[:_SNIFF_BYTES] else data


def _to_tensor(chunks: list[bytes]) -> torch.Tensor:
    data = bytearray().join(chunks)  # one copy; frombuffer then shares it
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def load_corpus(source: str = "stdlib", val_fraction: float = 0.05) -> Corpus:
    """Read a corpus and split it; ``source`` is ``"stdlib"``, a text file or a folder.

    Folders are read recursively in sorted path order, skipping hidden entries, binary files and
    unreadable files. Raises ValueError naming ``source`` when it does not exist or holds no text.

    Example:
        >>> corpus = load_corpus("stdlib")
        >>> corpus.train.dtype, corpus.val.numel() < corpus.train.numel()
        (torch.uint8, True)
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source == "stdlib":
        root, paths = _stdlib_files()
    else:
        root = Path(source).expanduser()
        if root.is_file():
            root, paths = root.parent, [root]
        elif root.is_dir():
            paths = _folder_files(root)
        else:
            raise ValueError(
                f"corpus {source!r} does not exist; give 'stdlib', a text file or a folder"
            )
    named = sorted((p.relative_to(root).as_posix(), p) for p in paths)

    train: list[bytes] = []
    val: list[bytes] = []
    train_files: list[str] = []
    val_files: list[str] = []
    for rel, path in named:
        data = _read_text_bytes(path)
        if not data:
            continue
        if is_validation(rel, val_fraction):
            val.append(data)
            val_files.append(rel)
        else:
            train.append(data)
            train_files.append(rel)
    if not train and not val:
        raise ValueError(
            f"corpus {source!r} holds no text (no readable, non-empty, non-binary files)"
        )
    if train and val:
        return Corpus(
            _to_tensor(train), _to_tensor(val), tuple(train_files), tuple(val_files), "files"
        )

    # Every file landed on one side: split the concatenation by position instead.
    everything = _to_tensor(train + val)
    if everything.numel() < 2:
        raise ValueError(f"corpus {source!r} has a single byte; it cannot be split")
    cut = everything.numel() - max(1, round(everything.numel() * val_fraction))
    files = tuple(train_files + val_files)  # one side is empty: still in sorted order
    return Corpus(everything[:cut], everything[cut:], files, (), "tail")
