"""One checkpoint folder: its files, written durably, and read back verified.

``state.safetensors`` holds every tensor leaf by its dotted path, ``meta.json`` the tree's
structure, the config and the tensors' checksums (see :mod:`colfunc.checkpoint`).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from colfunc.checkpoint.checksums import _checksums, checksum

TENSORS = "state.safetensors"

META = "meta.json"

_FORMAT = "colfunc.checkpoint/1"


def shard_name(rank: int) -> str:
    """The file of rank ``rank``'s pieces in a sharded checkpoint."""
    return f"rank-{rank:05d}.safetensors"


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


def check_readable(*paths: Path) -> None:
    """A :class:`CheckpointError` saying "permission denied" for the first of ``paths`` that
    exists but cannot be read (a folder: listed and entered), before a read would report it as
    missing or corrupt."""
    for p in paths:
        if p.is_dir():
            ok = os.access(p, os.R_OK | os.X_OK)
        else:
            ok = not os.path.lexists(p) or os.access(p, os.R_OK)
        if not ok:
            raise CheckpointError(f"{str(p)!r} cannot be read: permission denied")


def _read_meta(meta_path: Path) -> dict[str, Any]:
    check_readable(meta_path.parent, meta_path)
    try:
        meta = json.loads(meta_path.read_text())
    except PermissionError as e:
        raise CheckpointError(f"{str(meta_path)!r} cannot be read: permission denied") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{str(meta_path)!r} is not a {_FORMAT} file")
    return meta


def sharded_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``sharded`` entry of a checkpoint's index (mesh, world size, files, step), or None
    for a single-file checkpoint."""
    meta = _read_meta(Path(path) / META)
    sharded = meta.get("sharded")
    return sharded if isinstance(sharded, dict) else None


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
    check_readable(path, meta_path, tensors_path)
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
