"""Checkpoints: a pytree of tensors in safetensors, its structure and the run config in JSON.

A checkpoint is a folder holding

``state.safetensors``
    every tensor leaf, keyed by its dotted path (``params.blocks.attn.wq``,
    ``opt_state.1.exp_avg.embed.tokens``), readable by any safetensors tool;
``meta.json``
    the tree's structure (dicts, lists, tuples, named tuples) with its non-tensor leaves (ints,
    floats, strings, bools, None) in place, and the config.

Writes are atomic: the folder is written under a temporary name beside ``path`` and renamed into
place, so a crash leaves either the previous checkpoint or the new one, never half of one.

Example:
    >>> save("runs/demo/checkpoint", state, config=cfg)
    >>> state, cfg = load("runs/demo/checkpoint")
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

__all__ = ["CheckpointError", "load", "save"]

TENSORS = "state.safetensors"
META = "meta.json"
_FORMAT = "colfunc.checkpoint/1"


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


def _write_synced(path: Path, write: Any) -> None:
    write(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save(path: str | Path, state: Any, config: Any = None) -> Path:
    """Write ``state`` (any pytree, e.g. a ``TrainState``) and ``config`` to the folder ``path``.

    ``config`` is a :class:`colfunc.config.RunConfig`, any JSON-serialisable value, or None. An
    existing checkpoint at ``path`` is replaced atomically; any other existing file or folder
    there is an error (nothing is overwritten). Returns ``path``.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    meta = {
        "format": _FORMAT,
        "state": _encode(state, "", tensors),
        "config": _config_json(config),
    }
    if path.exists() and not (path / META).is_file():
        raise ValueError(f"{str(path)!r} exists and is not a checkpoint; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(path.parent.stat().st_mode & 0o777)  # mkdtemp's 0700 would hide it from others
        storable = _storable(tensors)
        _write_synced(tmp / TENSORS, lambda p: safetensors.torch.save_file(storable, str(p)))
        text = json.dumps(meta, indent=1)
        _write_synced(tmp / META, lambda p: p.write_text(text))
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: str | Path) -> tuple[Any, Any]:
    """``(state, config)`` from the checkpoint folder ``path``, as they were saved.

    Tensors come back on the CPU. Raises :class:`CheckpointError` (a ValueError) naming the file
    when the checkpoint is missing, incomplete or corrupt.
    """
    from colfunc import config as config_lib

    path = Path(path)
    meta_path, tensors_path = path / META, path / TENSORS
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (not a folder)")
    for p in (meta_path, tensors_path):
        if not p.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {p.name} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{str(meta_path)!r} is not a {_FORMAT} file")
    try:
        tensors = safetensors.torch.load_file(str(tensors_path))
    except Exception as e:  # safetensors reports corruption with its own error types
        raise CheckpointError(f"{str(tensors_path)!r} is corrupt: {e}") from e
    try:
        state = _decode(meta["state"], tensors)
        stored = meta["config"]
        if stored is None:
            config = None
        elif "run_config" in stored:
            config = config_lib.from_dict(stored["run_config"])
        else:
            config = stored["json"]
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt: {type(e).__name__}: {e}") from e
    return state, config
