"""Transfers between pipeline stages over the pipeline axis, posted ahead of their use.

A message is a pytree of tensors (a stage's carry: hidden state, conditioning, positions; or the
gradients of its floating leaves that need them), each leaf sent point to point
(``comm.send``/``comm.recv``) and tagged by its direction, stage, microbatch and leaf. A sharded
tensor crosses as its local piece, to the rank of the next stage with the same coordinates on the
other axes, so a piece stays a piece of the same tensor. The first message of each direction
between two ranks in a step is preceded by a descriptor (the pytree's structure, and per leaf its
local shape, dtype, whether it needs a gradient, and a sharded tensor's global shape and
placements), since the receiver cannot know them before the model has run.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from colfunc import tree
from colfunc.sharding import Mesh, Partial, Replicate, Shard, ShardedTensor, comm
from colfunc.sharding.placement import PARTIAL_OPS
from colfunc.transforms.local import local_piece

__all__ = ["DTYPES", "Link"]

# (integer leaves: positions a model computes once before its layers, say)
DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
)
_DESCRIPTOR = 32  # int64 entries per leaf, see _describe
MAX_LEAVES = 16  # tensor leaves of one message (tags are spaced by this)
_STRUCTURE = 1024  # bytes of the pickled structure
_HEADER = 2 + MAX_LEAVES * _DESCRIPTOR + _STRUCTURE


Meta = tuple[tuple[int, ...], torch.dtype, Any]  # local shape, dtype, (shape, placements) or None


def _describe(x: torch.Tensor) -> torch.Tensor:
    """What a receiver needs to rebuild ``x``: its local shape and dtype, and for a sharded
    tensor its global shape and placements, as int64 codes."""
    local = local_piece(x)
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


def _leaves(message: Any) -> tuple[list[torch.Tensor], Any]:
    flat, treedef = tree.flatten_with_paths(message)
    bad = [(p, type(x).__name__) for p, x in flat if not isinstance(x, torch.Tensor)]
    if bad:
        raise ValueError(
            f"pipeline: every leaf of the carry between stages must be a tensor; "
            f"{bad[0][0] or 'the carry'} is a {bad[0][1]}"
        )
    if len(flat) > MAX_LEAVES:
        raise ValueError(
            f"pipeline: the carry between stages has {len(flat)} tensor leaves, more than "
            f"{MAX_LEAVES}; group some into one tensor"
        )
    return [x for _, x in flat], treedef


def _header(message: Any) -> torch.Tensor:
    """The descriptor of a whole message: its structure and each leaf's :func:`_describe`."""
    leaves, treedef = _leaves(message)
    skeleton = pickle.dumps(tree.unflatten(treedef, range(len(leaves))))
    if len(skeleton) > _STRUCTURE:
        raise ValueError(f"pipeline: the carry's structure is too large to describe: {treedef}")
    descs = [_describe(x) for x in leaves] + [torch.zeros(_DESCRIPTOR, dtype=torch.int64)] * (
        MAX_LEAVES - len(leaves)
    )
    flags = sum(1 << k for k, x in enumerate(leaves) if x.requires_grad)
    raw = torch.tensor(list(skeleton) + [0] * (_STRUCTURE - len(skeleton)), dtype=torch.int64)
    return torch.cat([torch.tensor([len(leaves), flags]), *descs, raw])


def _read_header(header: list[int], mesh: Mesh) -> tuple[Any, list[Meta], list[bool]]:
    count, flags = header[0], header[1]
    metas = [
        _read(header[2 + k * _DESCRIPTOR : 2 + (k + 1) * _DESCRIPTOR], mesh) for k in range(count)
    ]
    raw = bytes(header[2 + MAX_LEAVES * _DESCRIPTOR :])
    skeleton = pickle.loads(raw)  # written by _header on a rank of this same program
    treedef = tree.structure(skeleton)
    return treedef, metas, [bool(flags >> k & 1) for k in range(count)]


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


def _header_tag(direction: str, stage: int) -> int:
    """The tag of the descriptor of ``stage``'s messages in ``direction``; message tags start at
    ``2 * stages`` (see the runtime)."""
    return 2 * stage + int(direction == "B")


class Link:
    """This rank's transfers over the pipeline axis during one step.

    ``expected`` lists the ``(source, direction, tag, stage)`` of this rank's receives in
    schedule order (``stage``: the sending stage). The next ``AHEAD`` of them are kept posted, so
    that a message moves while this rank computes rather than when it asks. The first message of
    each direction from each stage is preceded by its descriptor (tag ``2 * stage``, plus 1
    backward), posted as early as the message: the messages of one stage share a structure, those
    of two stages may not (a carry with the per-layer ``ys`` so far grows from stage to stage).
    Leaf ``k`` of the message tagged ``t`` travels with tag ``t * MAX_LEAVES + k``.
    """

    AHEAD = 4

    def __init__(self, mesh: Mesh, axis: str, expected: list[tuple[int, str, int, int]]) -> None:
        self.mesh, self.axis = mesh, axis
        # by (source, direction, stage): structure, leaf metas, which leaves need gradients
        self.meta: dict[tuple[int, str, int], tuple[Any, list[Meta], list[bool]]] = {}
        self.headers: dict[tuple[int, str, int], Any] = {}  # posted descriptor receives
        self.told: set[tuple[int, str, int]] = set()
        self.sends: list[Any] = []
        self.expected = expected
        self.posted: dict[int, list[Any]] = {}  # position in `expected` -> posted receives
        self.next = 0  # position of the next receive to hand out
        self._post_ahead()

    def send(self, message: Any, dst: int, direction: str, tag: int, stage: int) -> None:
        """Send a pytree of tensors from ``stage``; the receiver gets it with the same structure."""
        leaves, _ = _leaves(message)
        if (dst, direction, stage) not in self.told:
            self.told.add((dst, direction, stage))
            header = _header(message)
            self.sends.append(
                comm.send(header, self.axis, dst, tag=_header_tag(direction, stage), mesh=self.mesh)
            )
        for k, x in enumerate(leaves):
            piece = local_piece(x).detach()
            self.sends.append(
                comm.send(piece, self.axis, dst, tag=tag * MAX_LEAVES + k, mesh=self.mesh)
            )

    def _post_header(self, key: tuple[int, str, int]) -> None:
        if key not in self.headers:
            src, direction, stage = key
            self.headers[key] = comm.recv(
                (_HEADER,),
                torch.int64,
                self.axis,
                src,
                tag=_header_tag(direction, stage),
                mesh=self.mesh,
            )

    def _post(self, k: int) -> None:
        src, direction, tag, stage = self.expected[k]
        _, metas, _ = self.meta[src, direction, stage]
        self.posted[k] = [
            comm.recv(shape, dtype, self.axis, src, tag=tag * MAX_LEAVES + i, mesh=self.mesh)
            for i, (shape, dtype, _) in enumerate(metas)
        ]

    def _post_ahead(self) -> None:
        for k in range(self.next, min(self.next + self.AHEAD, len(self.expected))):
            src, direction, _, stage = self.expected[k]
            key = (src, direction, stage)
            if k in self.posted:
                continue
            if key in self.meta:
                self._post(k)
            else:
                self._post_header(key)

    def recv(self, src: int, direction: str, tag: int, stage: int) -> Any:
        """The next expected message (from ``stage``): a pytree whose leaves that needed a
        gradient on the sender's side need one here."""
        k = self.next
        if self.expected[k] != (src, direction, tag, stage):
            raise RuntimeError(f"pipeline: receive {(src, direction, tag)} out of schedule order")
        key = (src, direction, stage)
        if key not in self.meta:
            self._post_header(key)
            self.meta[key] = _read_header(self.headers.pop(key).wait().tolist(), self.mesh)
        if k not in self.posted:
            self._post(k)
        pieces = [r.wait() for r in self.posted.pop(k)]
        self.next += 1
        self._post_ahead()
        treedef, metas, needs_grad = self.meta[key]
        leaves = []
        for piece, (_, _, sharded), grad in zip(pieces, metas, needs_grad):
            x = (
                piece
                if sharded is None
                else ShardedTensor(piece, self.mesh, sharded[1], sharded[0])
            )
            leaves.append(x.requires_grad_(grad) if grad else x)
        return tree.unflatten(treedef, leaves)

    def finish(self) -> None:
        for r in self.sends:
            r.wait()
        self.sends.clear()
