"""Checkpoints: a pytree of tensors in safetensors, its structure and the run config in JSON.

A checkpoint is a folder holding

``state.safetensors``
    every tensor leaf, keyed by its dotted path (``params.blocks.attn.wq``,
    ``opt_state.1.exp_avg.embed.tokens``), readable by any safetensors tool;
``meta.json``
    the tree's structure (dicts, lists, tuples, named tuples) with its non-tensor leaves (ints,
    floats, strings, bools, None) in place, and the config.

and, in ``meta.json``, a CRC-32 of every tensor's bytes, verified on load: a flipped bit is
an error naming the tensor, never a silent NaN. Files are written with the permissions the umask
gives (as any other file), so another user of a shared run folder can read them.

A training run keeps its checkpoints in a *store* (:func:`commit`, :func:`latest`): a folder of
step-numbered checkpoints (``step-00000100/``) and a ``latest`` file naming the newest. A commit
writes the new checkpoint under a temporary name (every file fsynced), renames it into place,
then replaces ``latest`` by a rename: each step is one atomic rename, so a crash or a SIGKILL at
any moment leaves the previous complete checkpoint loadable. Stale temporaries are removed by the
next commit; ``keep_last`` prunes the oldest. :class:`AsyncWriter` copies a state to host memory
and commits it in a background thread.

A parallel run's checkpoint is *sharded* (:func:`begin_sharded`, :func:`write_shard`,
:func:`finish_sharded`): each rank writes its own pieces as it holds them,
``rank-RRRRR.safetensors`` (its structure and checksums in the file's header; no gathering, and
no rank holds more than its own state), then rank 0 writes ``meta.json`` (the mesh, the files,
the run config) and commits the folder by the same one rename. :func:`colfunc.train.load_run`
lays a sharded checkpoint out for any other mesh or composition.

:func:`save` writes one checkpoint folder; an existing one there is replaced (its temporaries
removed by the next save, and :func:`load` recovers the old one if a crash came between the two
renames a replacement takes).

Example:
    >>> save("runs/demo/checkpoint", state, config=cfg)
    >>> state, cfg = load("runs/demo/checkpoint")
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

__all__ = [
    "AsyncWriter",
    "CheckpointError",
    "ShardReader",
    "abandon_sharded",
    "begin_sharded",
    "commit",
    "finish_sharded",
    "latest",
    "load",
    "load_shard",
    "save",
    "sharded_meta",
    "steps",
    "write_shard",
]

TENSORS = "state.safetensors"
META = "meta.json"
LATEST = "latest"
_FORMAT = "colfunc.checkpoint/1"
_STEP = re.compile(r"step-(\d{8,})")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or not a colfunc checkpoint."""


def _encode(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON form of ``node``; tensor leaves are moved to ``tensors`` under their path.

    Containers are tagged objects (``{"dict": [[key, value], ...]}``); scalars stay JSON scalars.
    """
    child = (path + ".") if path else ""
    if isinstance(node, torch.Tensor):
        if path in tensors:
            raise ValueError(f"checkpoint.save: two leaves share the path {path!r}")
        tensors[path] = node
        return {"tensor": path}
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        cls = type(node)
        fields = [[f, _encode(v, child + f, tensors)] for f, v in zip(node._fields, node)]
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(node, (tuple, list)):
        kind = "tuple" if isinstance(node, tuple) else "list"
        return {kind: [_encode(v, f"{child}{i}", tensors) for i, v in enumerate(node)]}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str):
                raise TypeError(f"checkpoint.save: dict keys must be str, got {key!r} at {path!r}")
        return {"dict": [[k, _encode(v, child + k, tensors)] for k, v in node.items()]}
    raise TypeError(
        f"checkpoint.save: cannot store a {type(node).__name__} at {path or 'the root'!r}; "
        f"leaves may be tensors, numbers, strings, bools or None"
    )


def _named_tuple_class(spec: str) -> type:
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(f"named tuple type {spec!r} cannot be imported: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")):
        raise CheckpointError(f"{spec!r} is not a named tuple type")
    return obj


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        try:
            return tensors[node["tensor"]]
        except KeyError:
            raise CheckpointError(f"tensor {node['tensor']!r} is missing from {TENSORS}") from None
    if "namedtuple" in node:
        cls = _named_tuple_class(node["namedtuple"])
        return cls(**{f: _decode(v, tensors) for f, v in node["fields"]})
    if "dict" in node:
        return {k: _decode(v, tensors) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_decode(v, tensors) for v in node["tuple"])
    if "list" in node:
        return [_decode(v, tensors) for v in node["list"]]
    raise CheckpointError(f"unknown node {sorted(node)} in {META}")


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors owning their storage (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        owns = storage.nbytes() == t.numel() * t.element_size() and t.is_contiguous()
        if not owns or storage.data_ptr() in seen or t.numel() == 0:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _config_json(config: Any) -> Any:
    from colfunc import config as config_lib

    if config is None:
        return None
    if isinstance(config, config_lib.RunConfig):
        return {"run_config": config_lib.to_dict(config)}
    try:
        json.dumps(config)
    except TypeError as e:
        raise TypeError(
            f"checkpoint.save: config must be a RunConfig or JSON-serialisable, got {e}"
        ) from e
    return {"json": config}


def _config_of(stored: Any) -> Any:
    """The config as :func:`_config_json` stored it (a RunConfig, a JSON value, or None)."""
    from colfunc import config as config_lib

    if stored is None:
        return None
    if "run_config" in stored:
        return config_lib.from_dict(stored["run_config"])
    return stored["json"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_synced(path: Path, write: Any) -> None:
    write(path)
    os.chmod(path, 0o666 & ~_umask())  # as open() would make it, whatever the writer chose
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes (a memoryview, no copy of a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def checksum(t: torch.Tensor) -> str:
    """The CRC-32 of a CPU tensor's bytes, as 8 hex digits."""
    return _crc(_bytes(t))


def _crc(data: Any) -> str:
    """The CRC-32 of ``data`` (bytes-like) as 8 hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


# CRC-32 is linear over GF(2): the CRC of ``a + b`` follows from the CRCs of ``a`` and ``b`` and
# the length of ``b`` (zlib's ``crc32_combine``, which Python's zlib does not expose), by the
# 32x32 bit matrix that runs the CRC register over that many zero bytes. A save then takes the
# whole tensor's CRC from its blocks' CRCs instead of a second pass over its bytes.
_CRC_POLY = 0xEDB88320  # the CRC-32 polynomial, bit-reversed, as zlib's register uses it


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix @ vector`` over GF(2); ``matrix[k]`` is the image of bit ``k``."""
    out, k = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[k]
        vector >>= 1
        k += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The matrix of ``a`` after ``b``."""
    return tuple(_gf2_times(a, column) for column in b)


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that runs the CRC-32 register over ``nbytes`` zero bytes."""
    op = (_CRC_POLY, *(1 << k for k in range(31)))  # one zero bit: shift right, XOR the poly
    for _ in range(3):  # 2, 4, 8 bits: one zero byte
        op = _compose(op, op)
    out = tuple(1 << k for k in range(32))  # the identity
    while nbytes:  # by squaring: the powers of one byte that nbytes's bits name
        if nbytes & 1:
            out = _compose(op, out)
        nbytes >>= 1
        if nbytes:
            op = _compose(op, op)
    return out


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``, as
    zlib's ``crc32_combine``."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2 if len2 else crc1


def _sums(t: torch.Tensor, block: int) -> tuple[str, list[str]]:
    """The CRC-32 of a CPU tensor's bytes and of each ``block`` bytes of them (the last one
    short), in one pass over the bytes: the whole one combined from the blocks'."""
    data = _bytes(t)
    crcs = [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
    whole = 0  # the CRC-32 of no bytes
    for i, crc in enumerate(crcs):
        whole = _crc32_combine(whole, crc, min(block, len(data) - i * block))
    return f"{whole:08x}", [f"{crc:08x}" for crc in crcs]


def _checksums(storable: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The header entries that let a load check every tensor: whole and per block."""
    sums = {k: _sums(t, BLOCK_BYTES) for k, t in storable.items()}
    return {
        "checksums": {k: whole for k, (whole, _) in sums.items()},
        "block_bytes": BLOCK_BYTES,
        "blocks": {k: blocks for k, (_, blocks) in sums.items()},
    }


def _meta(state: Any, config: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    meta = {
        "format": _FORMAT,
        "state": _encode(state, "", tensors),
        "config": _config_json(config),
    }
    return meta, tensors


def _write(folder: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Both files into the (new, empty) ``folder``, each fsynced; the tensors' checksums in
    the meta."""
    storable = _storable(tensors)
    meta = {**meta, **_checksums(storable)}
    _write_synced(folder / TENSORS, lambda p: safetensors.torch.save_file(storable, str(p)))
    text = json.dumps(meta, indent=1)
    _write_synced(folder / META, lambda p: p.write_text(text))
    _sync_dir(folder)


def _new_temp(parent: Path, prefix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would hide it from others
    return tmp


def save(path: str | Path, state: Any, config: Any = None) -> Path:
    """Write ``state`` (any pytree, e.g. a ``TrainState``) and ``config`` to the folder ``path``.

    ``config`` is a :class:`colfunc.config.RunConfig`, any JSON-serialisable value, or None. An
    existing checkpoint at ``path`` is replaced; any other existing file or folder there is an
    error (nothing is overwritten). Returns ``path``. (A training run commits to a store
    instead: :func:`commit`.)
    """
    path = Path(path)
    meta, tensors = _meta(state, config)
    if path.exists() and not (path / META).is_file():
        raise ValueError(f"{str(path)!r} exists and is not a checkpoint; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a crashed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = _new_temp(path.parent, f".{path.name}.tmp-")
    try:
        _write(tmp, meta, tensors)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        _sync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for previous in path.parent.glob(f".{path.name}.old-*"):
        shutil.rmtree(previous, ignore_errors=True)
    return path


def _read_meta(meta_path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(meta_path.read_text())
    except PermissionError as e:
        raise CheckpointError(f"{str(meta_path)!r} cannot be read: permission denied") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{str(meta_path)!r} is not a {_FORMAT} file")
    return meta


def load(path: str | Path) -> tuple[Any, Any]:
    """``(state, config)`` from the checkpoint folder ``path``, as they were saved.

    Tensors come back on the CPU, their checksums verified. Raises :class:`CheckpointError` (a
    ValueError) naming the file when the checkpoint is missing, incomplete, unreadable or corrupt.
    """

    path = Path(path)
    if not path.exists():  # a crash between the two renames of a replacing save
        olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
        if olds and (olds[-1] / META).is_file():
            path = olds[-1]
    meta_path, tensors_path = path / META, path / TENSORS
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (not a folder)")
    sharded = sharded_meta(path) if meta_path.is_file() and not tensors_path.exists() else None
    if sharded is not None:
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint (one file per rank of mesh "
            f"{sharded['mesh']}); read it with colfunc.train.load_run, which lays it out for any "
            f"mesh"
        )
    for p in (meta_path, tensors_path):
        if not p.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {p.name} is missing")
    meta = _read_meta(meta_path)
    try:
        tensors = safetensors.torch.load_file(str(tensors_path))
    except PermissionError as e:
        raise CheckpointError(f"{str(tensors_path)!r} cannot be read: permission denied") from e
    except Exception as e:  # safetensors reports corruption with its own error types
        raise CheckpointError(f"{str(tensors_path)!r} is corrupt: {e}") from e
    sums = meta.get("checksums")
    if isinstance(sums, dict):  # (checkpoints written before checksums have none)
        for key, t in tensors.items():
            if key in sums and sums[key] != checksum(t):
                raise CheckpointError(
                    f"{str(tensors_path)!r} is corrupt: tensor {key!r} does not match its "
                    f"checksum in {META} (its bytes changed after it was written)"
                )
    try:
        state = _decode(meta["state"], tensors)
        config = _config_of(meta["config"])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt: {type(e).__name__}: {e}") from e
    return state, config


# --- a store of step-numbered checkpoints -----------------------------------------------------


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
            _write(tmp, meta, tensors)
            if final.exists():  # an incomplete folder of that name (written by hand?)
                raise CheckpointError(
                    f"{str(final)!r} exists but is not a complete checkpoint; remove it"
                )
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


# --- sharded checkpoints: one file per rank, no gathering ---------------------------------


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _shards_temp(root: Path, name: str) -> Path:
    return root / f".tmp-{name}-shards"


BLOCK_BYTES = 1 << 16  # the unit of a partial read, each with its own CRC-32
RUNS = "__runs__."  # the key prefix of a piece's runs in a rank's file


def write_shard(
    root: str | Path, step: int, rank: int, local_state: Any, pieces: dict[str, Any] | None = None
) -> Path:
    """Write one rank's pieces of the checkpoint of ``step`` (plain local tensors: every rank's
    own, as it holds them) into the store's temporary folder for that step, fsynced; its
    structure and checksums in the file's metadata. The folder must exist
    (:func:`begin_sharded`).

    ``pieces`` (:func:`colfunc.reshard.element_runs` of the writing layout on this rank) says
    which global elements each tensor holds: the runs are stored beside the tensors, and each
    tensor's global shape and span go to the header (gathered into the index by
    :func:`finish_sharded`), so that another layout reads only what it needs; every tensor also
    gets a CRC-32 per :data:`BLOCK_BYTES` block, which a partial read verifies."""
    root = Path(root)
    name = _step_name(step)
    folder = _shards_temp(root, name)
    meta, tensors = _meta(local_state, None)
    described: dict[str, Any] = {}
    for key, piece in (pieces or {}).items():
        if key not in tensors:
            raise ValueError(f"write_shard: the state has no tensor {key!r} that pieces describes")
        runs = piece.runs
        tensors[RUNS + key] = runs
        span = [int(runs[:, 1].min()), int((runs[:, 1] + runs[:, 2]).max())] if len(runs) else []
        described[key] = {"shape": list(piece.shape), "span": span, "placement": piece.placement}
    storable = _storable(tensors)
    header = {
        "format": _FORMAT,
        "rank": rank,
        "state": meta["state"],
        **_checksums(storable),
        "pieces": described,
    }
    path = folder / shard_name(rank)
    _write_synced(
        path,
        lambda p: safetensors.torch.save_file(
            storable, str(p), metadata={"colfunc": json.dumps(header)}
        ),
    )
    return path


def begin_sharded(root: str | Path, step: int) -> bool:
    """On one rank (rank 0), before the ranks write: remove stale temporaries and make the
    step's temporary folder. False when that step is committed already (nothing to write)."""
    root = _open_store(root)
    name = _step_name(step)
    if (root / name / META).is_file():
        return False
    _clear_temporaries(root)
    folder = _shards_temp(root, name)
    folder.mkdir()
    folder.chmod(0o777 & ~_umask())
    return True


def finish_sharded(
    root: str | Path,
    step: int,
    config: Any,
    *,
    mesh_shape: dict[str, int],
    keep_last: int | None = None,
) -> Path:
    """On one rank (rank 0), once every rank's file is written: the index (``meta.json``: the
    mesh, the files, the config) written last, the folder renamed into place, ``latest``
    pointed at it. Raises :class:`CheckpointError` if a rank's file is missing."""
    root = Path(root)
    name = _step_name(step)
    folder, final = _shards_temp(root, name), root / name
    size = 1
    for n in mesh_shape.values():
        size *= n
    files = [shard_name(r) for r in range(size)]
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise CheckpointError(f"sharded checkpoint of step {step}: {missing[0]} was not written")
    meta = {
        "format": _FORMAT,
        "config": _config_json(config),
        "sharded": {"mesh": dict(mesh_shape), "world": size, "files": files, "step": step},
        "tensors": _tensor_index(folder, files),
    }
    text = json.dumps(meta, indent=1)
    _write_synced(folder / META, lambda p: p.write_text(text))
    _sync_dir(folder)
    os.rename(folder, final)
    _sync_dir(root)
    _point(root, name)
    if keep_last is not None:
        _prune(root, keep_last, name)
    return final


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """``(header, data offset)`` of a safetensors file: its JSON header (tensor dtypes, shapes
    and byte ranges, and ``__metadata__``) and where the tensor bytes begin."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 1 << 30:
                raise ValueError(f"a header of {n} bytes")
            return json.loads(f.read(n)), 8 + n
    except PermissionError as e:
        raise CheckpointError(f"{str(file)!r} cannot be read: permission denied") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(file)!r} is corrupt: {e}") from e


def _colfunc_header(file: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    raw, offset = _safetensors_header(file)
    try:
        header = json.loads(raw["__metadata__"]["colfunc"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{str(file)!r} is not a colfunc shard: {e}") from e
    return raw, header, offset


def _tensor_index(folder: Path, files: list[str]) -> dict[str, Any]:
    """``{key: {"shape", "dtype", "placement", "files": {rank: [start, stop)}}}``: for every
    tensor the ranks described (:func:`write_shard`'s ``pieces``), its global shape and dtype,
    its tensor-parallel placements (per mesh axis; empty for a piece that only ZeRO, a pipeline
    or a replica makes), and the span of global flat indices each rank's file holds (read from
    the files' headers; the exact elements are the runs in each file)."""
    index: dict[str, Any] = {}
    for rank, name in enumerate(files):
        raw, header, _ = _colfunc_header(folder / name)
        for key, piece in header.get("pieces", {}).items():
            entry = index.setdefault(
                key,
                {
                    "shape": piece["shape"],
                    "dtype": _DTYPES_BACK[raw[key]["dtype"]],
                    "placement": piece.get("placement", ""),
                    "files": {},
                },
            )
            if piece["span"]:
                entry["files"][str(rank)] = piece["span"]
    return index


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_DTYPES_BACK = {k: str(v).removeprefix("torch.") for k, v in _DTYPES.items()}


class ShardReader:
    """Reads a checkpoint's pieces by byte range: whole tensors, a rank's runs, or the elements
    ``[a, b)`` of one tensor in one rank's file (the :data:`BLOCK_BYTES` blocks that cover them,
    each checked against its CRC-32; a tensor saved without block checksums is read whole and
    checked against its own). ``bytes_read[rank]`` counts the tensor bytes read from each file,
    ``runs_read[rank]`` the bytes of runs.

    A sharded checkpoint's :attr:`tensors` is its index's table (empty for checkpoints written
    before it: those load through the writing composition instead). A single-device checkpoint
    reads as one rank's file that holds every tensor whole."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta = _read_meta(self.path / META)
        sharded = meta.get("sharded")
        self.single = not isinstance(sharded, dict)
        self.meta = meta
        self.bytes_read: dict[int, int] = {}
        self.runs_read: dict[int, int] = {}
        self._headers: dict[int, tuple[dict[str, Any], dict[str, Any], int]] = {}
        if self.single:
            self.world = 1
            raw, offset = _safetensors_header(self._file(0))
            header = {k: meta.get(k) for k in ("state", "checksums", "block_bytes", "blocks")}
            self._headers[0] = (raw, {**header, "rank": 0}, offset)
            self.tensors: dict[str, dict[str, Any]] = {
                key: {
                    "shape": list(raw[key]["shape"]),
                    "dtype": _DTYPES_BACK[raw[key]["dtype"]],
                    "placement": "",
                    "files": {0: (0, math.prod(raw[key]["shape"]))},
                }
                for key in raw
                if key != "__metadata__"
            }
            return
        assert isinstance(sharded, dict)
        self.world = int(sharded["world"])
        self.tensors = {
            key: {**entry, "files": {int(r): tuple(v) for r, v in entry["files"].items()}}
            for key, entry in meta.get("tensors", {}).items()
        }
        if self.tensors:  # every file there and its own (headers only: a replica may be unread)
            for rank in range(self.world):
                self.header(rank)

    def with_own_counts(self) -> ShardReader:
        """This reader with byte counters of its own: the index and the headers already read are
        shared, not read again. One per loading rank of a load that shares one reader."""
        other = copy.copy(self)
        other.bytes_read, other.runs_read = {}, {}
        return other

    @property
    def config(self) -> Any:
        """The config the index holds (a RunConfig for a training run's checkpoint)."""
        return _config_of(self.meta.get("config"))

    def _file(self, rank: int) -> Path:
        if self.single:
            file = self.path / TENSORS
            if not file.is_file():
                raise CheckpointError(
                    f"checkpoint {str(self.path)!r} is incomplete: {TENSORS} is missing"
                )
            return file
        if not 0 <= rank < self.world:
            raise CheckpointError(
                f"{str(self.path)!r} was written by {self.world} ranks; it has no rank {rank}"
            )
        file = self.path / shard_name(rank)
        if not file.is_file():
            raise CheckpointError(
                f"sharded checkpoint {str(self.path)!r} is incomplete: {file.name} is missing"
            )
        return file

    def header(self, rank: int) -> dict[str, Any]:
        """The colfunc header of rank ``rank``'s file (structure, checksums, pieces)."""
        if rank not in self._headers:
            self._headers[rank] = _colfunc_header(self._file(rank))
            if self._headers[rank][1].get("rank") != rank:
                raise CheckpointError(
                    f"{str(self._file(rank))!r} holds rank "
                    f"{self._headers[rank][1].get('rank')}'s pieces, not {rank}'s"
                )
        return self._headers[rank][1]

    def block_bytes(self, rank: int) -> int:
        """The unit of a partial read from rank ``rank``'s file (0: tensors are read whole)."""
        return int(self.header(rank).get("block_bytes") or 0)

    def read(self, rank: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key`` of rank ``rank``'s file."""
        self.header(rank)
        if stop <= start:
            return torch.zeros(0, dtype=_DTYPES[self._headers[rank][0][key]["dtype"]])
        raw, header, offset = self._headers[rank]
        file = self._file(rank)
        if key not in raw:
            raise CheckpointError(f"{str(file)!r} has no tensor {key!r}")
        dtype = _DTYPES[raw[key]["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        begin, end = raw[key]["data_offsets"]
        block = int(header.get("block_bytes", 0))
        sums = header.get("blocks", {}).get(key)
        lo, hi = begin + start * size, begin + stop * size
        if not (begin <= lo <= hi <= end):
            raise CheckpointError(f"{str(file)!r}: elements [{start}, {stop}) lie outside {key!r}")
        whole = header.get("checksums", {}).get(key) if not (block and sums is not None) else None
        if block and sums is not None:  # whole blocks, each verified
            first, last = (lo - begin) // block, (hi - begin - 1) // block + 1
            a, b = begin + first * block, min(end, begin + last * block)
        elif whole is not None:  # the whole tensor, against its own checksum
            first, last, a, b = 0, 0, begin, end
        else:
            first, last, a, b = 0, 0, lo, hi
        with open(file, "rb") as f:
            f.seek(offset + a)
            data = f.read(b - a)
        if len(data) != b - a:
            raise CheckpointError(f"{str(file)!r} is truncated inside {key!r}")
        counter = self.runs_read if key.startswith(RUNS) else self.bytes_read
        counter[rank] = counter.get(rank, 0) + len(data)
        if whole is not None and _crc(data) != whole:
            raise CheckpointError(
                f"{str(file)!r} is corrupt: tensor {key!r} does not match its checksum"
            )
        if block and sums is not None:
            for i in range(first, last):
                piece = data[(i - first) * block : (i - first + 1) * block]
                if _crc(piece) != sums[i]:
                    raise CheckpointError(
                        f"{str(file)!r} is corrupt: tensor {key!r} does not match its checksum "
                        f"(block {i})"
                    )
        return torch.frombuffer(bytearray(data[lo - a : hi - a]), dtype=dtype)

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """The whole tensor ``key`` of rank ``rank``'s file, in its shape."""
        self.header(rank)
        raw = self._headers[rank][0]
        if key not in raw:
            raise CheckpointError(f"{str(self._file(rank))!r} has no tensor {key!r}")
        shape = raw[key]["shape"]
        return self.read(rank, key, 0, math.prod(shape)).reshape(shape)

    def runs(self, rank: int, key: str) -> torch.Tensor:
        """Which global elements rank ``rank``'s piece of ``key`` holds (``[n, 3]`` runs)."""
        if self.single:
            return torch.tensor([[0, 0, math.prod(self.tensors[key]["shape"])]], dtype=torch.int64)
        return self.tensor(rank, RUNS + key)

    def _fields(self) -> dict[str, Any]:
        node = self.header(0)["state"]
        fields = dict(node["fields"]) if isinstance(node, dict) and "fields" in node else {}
        if not {"params", "opt_state", "step", "extra"} <= set(fields):
            raise CheckpointError(f"{str(self.path)!r} does not hold a training state")
        return fields

    def step_and_extra(self) -> tuple[int, dict[str, Any]]:
        """The step and the ``extra`` entries of rank 0's state (the same on every rank)."""
        fields = self._fields()

        class Lazy(dict[str, torch.Tensor]):
            def __missing__(inner, key: str) -> torch.Tensor:
                return self.tensor(0, key)

        return int(_decode(fields["step"], Lazy())), _decode(fields["extra"], Lazy())

    def skeleton(self, field: str) -> Any:
        """Rank 0's ``params`` or ``opt_state`` with its non-tensor leaves (an optimizer's step
        count, None) in place and every tensor :data:`TENSOR`, reading no tensor."""

        class Marks(dict[str, Any]):
            def __missing__(inner, key: str) -> Any:
                return TENSOR

        return _decode(self._fields()[field], Marks())


TENSOR = type("Tensor", (), {"__repr__": lambda self: "<tensor>"})()  # skeleton's mark


def abandon_sharded(root: str | Path, step: int) -> None:
    """Remove the temporary folder of a sharded checkpoint a rank failed to write."""
    shutil.rmtree(_shards_temp(Path(root), _step_name(step)), ignore_errors=True)


def sharded_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``sharded`` entry of a checkpoint's index (mesh, world size, files, step), or None
    for a single-file checkpoint."""
    meta = _read_meta(Path(path) / META)
    sharded = meta.get("sharded")
    return sharded if isinstance(sharded, dict) else None


def load_shard(path: str | Path, rank: int) -> tuple[Any, Any]:
    """``(local_state, config)``: rank ``rank``'s pieces of the sharded checkpoint ``path``, as
    that rank held them (checksums verified)."""

    path = Path(path)
    meta = _read_meta(path / META)
    sharded = meta.get("sharded")
    if not isinstance(sharded, dict):
        raise CheckpointError(f"{str(path)!r} is not a sharded checkpoint")
    if not 0 <= rank < int(sharded["world"]):
        raise CheckpointError(
            f"{str(path)!r} was written by {sharded['world']} ranks; it has no rank {rank}"
        )
    file = path / shard_name(rank)
    if not file.is_file():
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} is incomplete: {file.name} is missing"
        )
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            header = json.loads((f.metadata() or {})["colfunc"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except PermissionError as e:
        raise CheckpointError(f"{str(file)!r} cannot be read: permission denied") from e
    except Exception as e:
        raise CheckpointError(f"{str(file)!r} is corrupt: {e}") from e
    if header.get("rank") != rank:
        raise CheckpointError(
            f"{str(file)!r} holds rank {header.get('rank')}'s pieces, not {rank}'s"
        )
    sums = header.get("checksums", {})
    for key, t in tensors.items():
        if key in sums and sums[key] != checksum(t):
            raise CheckpointError(
                f"{str(file)!r} is corrupt: tensor {key!r} does not match its checksum"
            )
    return _decode(header["state"], tensors), _config_of(meta.get("config"))
