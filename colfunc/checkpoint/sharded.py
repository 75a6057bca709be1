"""Sharded checkpoints: one file per rank, written without gathering, and a reader that
serves any other layout's reads from them (see :mod:`colfunc.checkpoint`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from colfunc.checkpoint.checksums import _checksums, _crc, checksum
from colfunc.checkpoint.files import (
    _FORMAT,
    META,
    TENSORS,
    CheckpointError,
    _config_json,
    _config_of,
    _decode,
    _meta,
    _read_meta,
    _storable,
    _sync_dir,
    _umask,
    _write_synced,
    shard_name,
)
from colfunc.checkpoint.store import (
    _clear_temporaries,
    _open_store,
    _point,
    _prune,
    _step_name,
    set_aside,
)


def _shards_temp(root: Path, name: str) -> Path:
    return root / f".tmp-{name}-shards"


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
    set_aside(final)  # an incomplete folder of that name: never loadable, moved aside
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
