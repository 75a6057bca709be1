"""A store of step-numbered checkpoints: atomic commits, the ``latest`` pointer, pruning, and
a writer that commits from a background thread (see :mod:`colfunc.checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from colfunc.checkpoint import files
from colfunc.checkpoint.files import (
    META,
    TENSORS,
    _meta,
    _new_temp,
    _sync_dir,
    _umask,
    shard_name,
)

LATEST = "latest"

_STEP = re.compile(r"step-(\d{8,})")


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints in the store ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        # a single-file checkpoint has its tensors; a sharded one is renamed in with its index
        if (
            m
            and (p / META).is_file()
            and ((p / TENSORS).is_file() or (p / shard_name(0)).is_file())
        ):
            out.append(int(m.group(1)))
    return sorted(out)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint of the store ``root`` (the one ``latest`` names), or None
    when it has none."""
    root = Path(root)
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except OSError:
        name = ""
    if _STEP.fullmatch(name) and (root / name / META).is_file():
        return root / name
    done = steps(root)  # no pointer yet (a crash before its first write): the newest folder
    return root / _step_name(done[-1]) if done else None


def _point(root: Path, name: str) -> None:
    """Replace ``root/latest`` by one rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-latest-", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, root / LATEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_dir(root)


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Remove all but the newest ``keep_last`` checkpoints (never ``keep``): each is renamed
    aside first, so none is ever seen half-deleted."""
    done = steps(root)
    for step in done[: max(0, len(done) - keep_last)]:
        name = _step_name(step)
        if name == keep:
            continue
        dead = root / f".tmp-dead-{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(root / name, dead)
        except OSError:
            continue
        shutil.rmtree(dead, ignore_errors=True)


def _open_store(root: str | Path) -> Path:
    """The store folder ``root``, made if missing; a file there is an error."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{str(root)!r} is a file, not a checkpoint store")
    root.mkdir(parents=True, exist_ok=True)
    return root


def incomplete(root: str | Path) -> list[Path]:
    """The step folders of the store ``root`` newer than its latest complete checkpoint that
    are not complete (no ``meta.json``: a crash, or a hand, took it): what a resume skips."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = latest(root)
    found = _STEP.fullmatch(done.name) if done is not None else None
    newest = int(found.group(1)) if found is not None else -1
    out = []
    for p in sorted(root.iterdir()):
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir() and int(m.group(1)) > newest and not (p / META).is_file():
            out.append(p)
    return out


def set_aside(folder: Path) -> Path | None:
    """Move the incomplete checkpoint ``folder`` (no ``meta.json``) out of the store's way, to
    ``.broken-NAME-XXXXXXXX`` beside it, kept for inspection; the path it went to (None if
    there was nothing to move). A complete checkpoint is never moved."""
    if not folder.exists() or (folder / META).is_file():
        return None
    aside = folder.with_name(f".broken-{folder.name}-{uuid.uuid4().hex[:8]}")
    os.rename(folder, aside)
    return aside


def _clear_temporaries(root: Path) -> None:
    """Remove what crashed commits left in the store (``.tmp-*``)."""
    for stale in root.glob(".tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def commit(
    root: str | Path,
    step: int,
    state: Any,
    config: Any = None,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write ``state`` as the checkpoint of ``step`` in the store ``root`` and make it the
    latest; keep the newest ``keep_last`` (None: all). Returns its folder.

    The folder is written under a temporary name, fsynced, and renamed into place; ``latest`` is
    then replaced by a rename. A step already committed is not written again. Temporaries left
    by a crashed commit are removed first.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint.commit: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"checkpoint.commit: keep_last must be an int >= 1 or None, got {keep_last!r}"
        )
    root = _open_store(root)
    _clear_temporaries(root)
    name = _step_name(step)
    final = root / name
    if not (final / META).is_file():
        meta, tensors = _meta(state, config)
        tmp = _new_temp(root, f".tmp-{name}-")
        try:
            files._write(tmp, meta, tensors)  # (as files'; tests hold it)
            set_aside(final)  # an incomplete folder of that name: never loadable, moved aside
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _sync_dir(root)
    _point(root, name)
    if keep_last is not None:
        _prune(root, keep_last, name)
    return final


class AsyncWriter:
    """Commits in a background thread: :meth:`submit` copies the state to host memory (the
    only part the caller waits for) and returns; the write runs while training goes on. One
    commit at a time: a submit waits for the one before. An error in the background is raised
    by the next :meth:`submit` or :meth:`wait`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Path | None = None

    @staticmethod
    def snapshot(state: Any) -> Any:
        """A copy of every tensor leaf of ``state`` in host memory (plain values kept)."""
        from colfunc import tree

        def copy(x: Any) -> Any:
            return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x

        return tree.map(copy, state)

    def submit(
        self,
        root: str | Path,
        step: int,
        state: Any,
        config: Any = None,
        *,
        keep_last: int | None = None,
    ) -> None:
        self.wait()
        host = self.snapshot(state)

        def work() -> None:
            try:
                self.last = commit(root, step, host, config, keep_last=keep_last)
            except BaseException as e:  # raised in the caller's thread by wait()
                self._error = e

        self._thread = threading.Thread(target=work, name=f"colfunc-save-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Wait for the commit in flight; the folder of the last one done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last
