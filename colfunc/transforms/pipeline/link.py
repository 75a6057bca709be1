"""Transfers between pipeline stages over the pipeline axis, posted ahead of their use.

Each message is point to point (``comm.send``/``comm.recv``) and tagged by its direction, stage
and microbatch. A sharded tensor crosses as its local piece, to the rank of the next stage with
the same coordinates on the other axes, so a piece stays a piece of the same tensor. The first
message of each direction between two ranks in a step is preceded by a small descriptor (local
shape, dtype, and a sharded tensor's global shape and placements), since the receiver cannot
know them before the model has run.
"""

from __future__ import annotations

from typing import Any

import torch

from colfunc.sharding import Mesh, Partial, Replicate, Shard, ShardedTensor, comm
from colfunc.sharding.placement import PARTIAL_OPS

__all__ = ["DTYPES", "Link"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DESCRIPTOR = 32  # int64 entries, see _describe


def _local(x: torch.Tensor) -> torch.Tensor:
    return x._local if isinstance(x, ShardedTensor) else x


Meta = tuple[tuple[int, ...], torch.dtype, Any]  # local shape, dtype, (shape, placements) or None


def _describe(x: torch.Tensor) -> torch.Tensor:
    """What a receiver needs to rebuild ``x``: its local shape and dtype, and for a sharded
    tensor its global shape and placements, as int64 codes."""
    local = _local(x)
    desc = [local.dim(), *local.shape, DTYPES.index(local.dtype)]
    if isinstance(x, ShardedTensor):
        desc += [1, x.dim(), *x.shape, *(_placement_code(p) for p in x.placements)]
    if len(desc) > _DESCRIPTOR:
        raise ValueError(f"pipeline: cannot describe a stage output of shape {tuple(x.shape)}")
    return torch.tensor(desc + [0] * (_DESCRIPTOR - len(desc)), dtype=torch.int64)


def _read(desc: list[int], mesh: Mesh) -> Meta:
    n = desc[0]
    local, dtype, at = tuple(desc[1 : 1 + n]), DTYPES[desc[1 + n]], 2 + n
    if not desc[at]:
        return local, dtype, None
    g = desc[at + 1]
    shape = tuple(desc[at + 2 : at + 2 + g])
    codes = desc[at + 2 + g : at + 2 + g + len(mesh.axis_names)]
    return local, dtype, (shape, tuple(_placement(c) for c in codes))


def _placement_code(p: Any) -> int:
    if isinstance(p, Shard):
        return 1 + p.dim
    if isinstance(p, Partial):
        return -1 - PARTIAL_OPS.index(p.op)
    return 0


def _placement(code: int) -> Any:
    if code > 0:
        return Shard(code - 1)
    return Partial(PARTIAL_OPS[-1 - code]) if code < 0 else Replicate()


class Link:
    """This rank's transfers over the pipeline axis during one step.

    ``expected`` lists the ``(source, direction, tag)`` of this rank's receives in schedule
    order. The next ``AHEAD`` of them are kept posted, so that a message moves while this rank
    computes rather than when it asks. The first message of each direction between two ranks
    is preceded by its descriptor (tag 0 forward, 1 backward), posted as early as the message.
    """

    AHEAD = 4

    def __init__(self, mesh: Mesh, axis: str, expected: list[tuple[int, str, int]]) -> None:
        self.mesh, self.axis = mesh, axis
        self.meta: dict[tuple[int, str], Meta] = {}  # by (source, direction)
        self.headers: dict[tuple[int, str], Any] = {}  # posted descriptor receives
        self.told: set[tuple[int, str]] = set()
        self.sends: list[Any] = []
        self.expected = expected
        self.posted: dict[int, Any] = {}  # position in `expected` -> posted receive
        self.next = 0  # position of the next receive to hand out
        self._post_ahead()

    def send(self, x: torch.Tensor, dst: int, direction: str, tag: int) -> None:
        if (dst, direction) not in self.told:
            self.told.add((dst, direction))
            header = _describe(x)
            self.sends.append(
                comm.send(header, self.axis, dst, tag=int(direction == "B"), mesh=self.mesh)
            )
        local = _local(x).detach()
        self.sends.append(comm.send(local, self.axis, dst, tag=tag, mesh=self.mesh))

    def _post_header(self, key: tuple[int, str]) -> None:
        if key not in self.headers:
            src, direction = key
            tag = int(direction == "B")
            self.headers[key] = comm.recv(
                (_DESCRIPTOR,), torch.int64, self.axis, src, tag=tag, mesh=self.mesh
            )

    def _post(self, k: int) -> None:
        src, direction, tag = self.expected[k]
        shape, dtype, _ = self.meta[src, direction]
        self.posted[k] = comm.recv(shape, dtype, self.axis, src, tag=tag, mesh=self.mesh)

    def _post_ahead(self) -> None:
        for k in range(self.next, min(self.next + self.AHEAD, len(self.expected))):
            key = self.expected[k][:2]
            if k in self.posted:
                continue
            if key in self.meta:
                self._post(k)
            else:
                self._post_header(key)

    def recv(self, src: int, direction: str, tag: int) -> torch.Tensor:
        k = self.next
        if self.expected[k] != (src, direction, tag):
            raise RuntimeError(f"pipeline: receive {(src, direction, tag)} out of schedule order")
        key = (src, direction)
        if key not in self.meta:
            self._post_header(key)
            self.meta[key] = _read(self.headers.pop(key).wait().tolist(), self.mesh)
        if k not in self.posted:
            self._post(k)
        local = self.posted.pop(k).wait()
        self.next += 1
        self._post_ahead()
        sharded = self.meta[key][2]
        if sharded is None:
            return local
        return ShardedTensor(local, self.mesh, sharded[1], sharded[0])

    def finish(self) -> None:
        for r in self.sends:
            r.wait()
        self.sends.clear()
