"""Sharded checkpoints read into any layout, each rank reading only the slices it needs.

A composed step keeps every tensor of its state in pieces of its own making: a tensor-parallel
shard is a box of the global tensor, a ZeRO chunk a flat range of (a shard of) it, a pipeline
stage some of the stacked layers, a data-parallel replica all of it. Whatever the composition,
each local element is one element of one global tensor (or padding), and the map from local
positions to global ones is increasing along runs. :func:`element_runs` finds that map for the
rank it runs on without any transform describing itself: it lays out, through the step's own
:meth:`~colfunc.step.Step.place_state`, a single-device state whose elements hold their own
global index (plus one; zero is padding), and reads the indices back from the local pieces. It
is kept as runs ``[n, 3]`` of ``(local start, global start, length)``.

A sharded checkpoint stores each rank's runs beside its pieces (:func:`colfunc.checkpoint.write_shard`)
and the index names, for every tensor, its global shape and the global span each file holds.
:func:`read_local` fills a step's fresh local state on one rank: for each of its tensors it opens
only the files whose span meets what it needs, intersects their runs with its own, and reads from
each file just the byte ranges (in checksummed blocks) that hold the elements it lacks.

The runs are computed once per layout (at a run's first save, and once when loading), one
group of tensors at a time: each pass holds ``budget`` elements of float64 indices (128 MiB),
this rank's own pieces in float64, and transiently the largest tensor whole where a layout
flattens it, so no process holds the whole state; a model of ``n`` elements takes
``n / budget`` passes of ``place_state``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from colfunc import checkpoint, random, tree
from colfunc.sharding import ShardedTensor
from colfunc.step import StateLayout, Step, TrainState
from colfunc.transforms.local import local_piece, rewrap, to_local

__all__ = [
    "Piece",
    "element_runs",
    "expand_runs",
    "laid_out_as",
    "local_pieces",
    "read_local",
    "runs_of",
    "tensors_by_key",
]

PyTree = Any
BUDGET = 1 << 24  # float64 indices per pass (128 MiB)


def local_pieces(state: TrainState) -> TrainState:
    """This rank's pieces of ``state`` as plain tensors, without the transforms' own entries of
    extra (made afresh on loading); offloaded chunks written back to their host rows."""
    for entry in state.extra.values():
        sync = getattr(entry, "sync_host", None)
        if callable(sync):
            sync()
    extra = {k: v for k, v in state.extra.items() if not isinstance(v, StateLayout)}
    return TrainState(
        to_local(state.params), to_local(state.opt_state), state.step, to_local(extra)
    )


def runs_of(tags: torch.Tensor) -> torch.Tensor:
    """``[n, 3]`` int64 runs ``(local start, global start, length)`` of a tensor of tags (global
    index plus one; zero marks padding), maximal runs of consecutive indices."""
    flat = tags.reshape(-1)
    zero = torch.zeros(1, dtype=torch.int64)
    if flat.numel() and bool((flat > 0).all()):
        # no padding (a replica, a shard, a whole chunk: the common case): the runs break only
        # where the global index does not go up by one, so no element is gathered or indexed
        breaks = torch.nonzero(torch.diff(flat) != 1).reshape(-1) + 1
        starts = torch.cat([zero, breaks])
        ends = torch.cat([breaks, torch.tensor([flat.numel()])])
        return torch.stack([starts, flat[starts].to(torch.int64) - 1, ends - starts], dim=1)
    idx = torch.nonzero(flat > 0).reshape(-1)
    if idx.numel() == 0:
        return torch.zeros((0, 3), dtype=torch.int64)
    g = flat[idx].to(torch.int64) - 1
    breaks = ((idx[1:] - idx[:-1]) != 1) | ((g[1:] - g[:-1]) != 1)
    starts = torch.cat([zero, torch.nonzero(breaks).reshape(-1) + 1])
    ends = torch.cat([starts[1:], torch.tensor([idx.numel()])])
    return torch.stack([idx[starts], g[starts], ends - starts], dim=1)


def expand_runs(runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, global)`` element indices, int64, of ``runs`` (:func:`runs_of`)."""
    if runs.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    lengths = runs[:, 2]
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    return (
        torch.repeat_interleave(runs[:, 0], lengths) + offsets,
        torch.repeat_interleave(runs[:, 1], lengths) + offsets,
    )


class Piece(NamedTuple):
    """What one local tensor holds of a global one: ``runs`` (:func:`runs_of`) and the global
    tensor's ``shape``."""

    runs: torch.Tensor
    shape: tuple[int, ...]
    placement: str = ""  # a tensor-parallel piece's placements per mesh axis; "" otherwise


def tensors_by_key(state: PyTree) -> dict[str, torch.Tensor]:
    """``{dotted path: tensor}`` of ``state``'s tensor leaves (the checkpoint files' keys)."""
    return {p: t for p, t in tree.flatten_with_paths(state)[0] if isinstance(t, torch.Tensor)}


def _copy(
    reader: checkpoint.ShardReader, rank: int, key: str, pairs: torch.Tensor, out: torch.Tensor
) -> None:
    """Copy the pieces ``pairs`` (:func:`_intersect`) of ``key`` in rank ``rank``'s file into
    ``out``: one read per stretch of neighbouring blocks that the pieces touch, each piece a
    slice of it (or, for a stretch of many short pieces, one gather)."""
    if len(pairs) > 1 and not bool((pairs[1:, 0] >= pairs[:-1, 0]).all()):
        pairs = pairs[torch.argsort(pairs[:, 0])]
    per_block = max(1, reader.block_bytes(rank) // out.element_size())
    first = pairs[:, 0] // per_block
    last = (pairs[:, 0] + pairs[:, 2] - 1) // per_block
    cuts = torch.nonzero(first[1:] > last[:-1] + 1).reshape(-1) + 1
    bounds = [0, *cuts.tolist(), len(pairs)]
    for i, j in itertools.pairwise(bounds):
        a = int(pairs[i, 0])
        values = reader.read(rank, key, a, int(pairs[j - 1, 0] + pairs[j - 1, 2]))
        if j - i <= 64:
            for src, dst, n, _ in pairs[i:j].tolist():
                out[dst : dst + n] = values[src - a : src - a + n]
        else:
            src_e, dst_e = expand_runs(pairs[i:j, [0, 1, 2]])
            out[dst_e] = values[src_e - a]


def _by_global(runs: torch.Tensor) -> torch.Tensor:
    """``runs`` ordered by their global start (a layout's runs usually are already)."""
    if len(runs) > 1 and not bool((runs[1:, 1] >= runs[:-1, 1]).all()):
        runs = runs[torch.argsort(runs[:, 1])]
    return runs


def _intersect(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """``[m, 4]`` pieces ``(their local start, my local start, length, global start)`` where two
    lists of runs, each ordered by global start and disjoint, hold the same global elements (in
    ``mine``'s order)."""
    if not len(mine) or not len(theirs):
        return torch.zeros((0, 4), dtype=torch.int64)
    a0, a1 = mine[:, 1].contiguous(), mine[:, 1] + mine[:, 2]
    b0, b1 = theirs[:, 1].contiguous(), theirs[:, 1] + theirs[:, 2]
    first = torch.searchsorted(b1, a0, right=True)  # the first of theirs ending after a0
    stop = torch.searchsorted(b0, a1)  # the first of theirs starting at or after a1
    count = (stop - first).clamp(min=0)
    i = torch.repeat_interleave(torch.arange(len(mine)), count)
    j = (
        first[i]
        + torch.arange(len(i))
        - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    )
    lo = torch.maximum(a0[i], b0[j])
    hi = torch.minimum(a1[i], b1[j])
    keep = hi > lo
    i, j, lo, hi = i[keep], j[keep], lo[keep], hi[keep]
    return torch.stack([theirs[j, 0] + lo - b0[j], mine[i, 0] + lo - a0[i], hi - lo, lo], dim=1)


def _subtract(mine: torch.Tensor, pieces: torch.Tensor) -> torch.Tensor:
    """The runs of ``mine`` (ordered by global start) less the global elements of ``pieces``
    (:func:`_intersect` of ``mine``: inside its runs, in their order)."""
    starts = torch.cat([mine[:, 1], pieces[:, 3] + pieces[:, 2]])
    ends = torch.cat([mine[:, 1] + mine[:, 2], pieces[:, 3]])
    # the gaps: from each run's start or each piece's end to the next piece's start or the
    # run's end, taken in global order (a run's pieces lie inside it, ordered)
    order_s, order_e = torch.argsort(starts, stable=True), torch.argsort(ends, stable=True)
    s, e = starts[order_s], ends[order_e]
    keep = e > s
    s, e = s[keep], e[keep]
    # each gap's local start: its run's local start plus the offset from the run's start
    run = torch.searchsorted(mine[:, 1].contiguous(), s, right=True) - 1
    return torch.stack([mine[run, 0] + s - mine[run, 1], s, e - s], dim=1)


def _mirror_paths(opt_like: PyTree, params_like: PyTree) -> dict[str, str]:
    """``{optimizer-state path: parameter path}`` of the optimizer-state leaves that mirror a
    parameter (the subtrees place_state lays out like the parameters)."""
    spec = [p for p, _ in tree.flatten_with_paths(params_like)[0]]
    # each leaf of a mirroring subtree (the whole shape, or a part: an optimizer over some of
    # the parameters) marked with its path, which is its parameter's
    marked = tree.map_subtrees(
        lambda sub: tree.map_with_path(lambda p, _: p, sub), opt_like, params_like
    )
    return {p: v for p, v in tree.flatten_with_paths(marked)[0] if isinstance(v, str) and v in spec}


def element_runs(
    step: Step, params: PyTree, opt_state: PyTree, *, budget: int = BUDGET
) -> dict[str, Piece]:
    """``{key: Piece}`` for every tensor of ``step``'s local state on this rank that holds
    elements of a parameter or of an optimizer state mirroring one; keys as the checkpoint
    files name them (``params.blocks.attn.wq``, ``opt_state.1.mu.blocks.attn.wq``), each
    global tensor keyed as its own local piece is.

    ``params`` and ``opt_state`` describe the single-device state (tensors, meta tensors or
    :class:`colfunc.random.Abstract` leaves; only shapes are read). Under a mesh, call it on
    every rank (place_state may be a collective).
    """
    params = random.as_meta(params)
    flat, treedef = tree.flatten_with_paths(params)
    mirrors = _mirror_paths(opt_state, params)
    groups: list[list[str]] = [[]]
    used = 0
    for path, x in flat:
        n = x.numel()
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(path)
        used += n
    out: dict[str, Piece] = {}
    shapes = {p: tuple(x.shape) for p, x in flat}
    for group in groups:
        chosen = set(group)

        def tagged(path: str, like: torch.Tensor, chosen: set[str] = chosen) -> torch.Tensor:
            if path in chosen:
                return torch.arange(1, like.numel() + 1, dtype=torch.float64).view(like.shape)
            return torch.zeros((), dtype=torch.float64).expand(like.shape)

        full_params = tree.unflatten(treedef, [tagged(p, x) for p, x in flat])
        opt_flat, opt_def = tree.flatten_with_paths(opt_state)
        full_opt = []
        for p, x in opt_flat:
            key = mirrors.get(p)
            if key is not None:
                full_opt.append(tagged(key, dict(flat)[key]))
            elif isinstance(x, torch.Tensor):
                full_opt.append(torch.zeros(x.shape, dtype=x.dtype))
            else:
                full_opt.append(x)
        full = TrainState(full_params, tree.unflatten(opt_def, full_opt), 0, {})
        placed = step.place_state(full)
        placements = {
            key: ", ".join(f"{a}: {p!r}" for a, p in zip(x.mesh.axis_names, x.placements))
            for key, x in tree.flatten_with_paths(placed)[0]
            if isinstance(x, ShardedTensor)
        }
        local = local_pieces(placed)
        for key, t in tensors_by_key(local).items():
            origin = key.split(".", 1)
            if origin[0] == "params":
                source = origin[1]
            elif origin[0] == "opt_state":
                source = mirrors.get(origin[1], "")
            else:
                continue
            if source not in chosen:
                continue
            if t.dtype != torch.float64:
                raise ValueError(
                    f"reshard: the layout changed the dtype of {key!r} to {t.dtype}; its "
                    "elements cannot be traced"
                )
            out[key] = Piece(runs_of(t), shapes[source], placements.get(key, ""))
    return out


def laid_out_as(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (``like``'s shape and dtype) on ``like``'s device and in its memory order: a
    checkpoint's tensors are read row-major, where a layout may keep some otherwise (the
    column-major weights of :func:`colfunc.transforms.shard.matmul_order`), and a resumed run
    must compute as the uninterrupted one did, bit for bit."""
    if value.device == like.device and value.stride() == like.stride():
        return value
    return torch.empty_like(like).copy_(value)


def read_local(
    reader: checkpoint.ShardReader,
    fresh: TrainState,
    pieces: dict[str, Piece],
    check: Callable[[str, torch.Tensor], None] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> TrainState:
    """``fresh`` (a step's newly made state on this rank) with the values of the checkpoint
    ``reader`` reads: every tensor that holds elements of a global one is assembled from the
    files that hold them (``runs`` from :func:`element_runs` for this rank), reading only those
    elements' blocks; the other leaves (step counts, scalars) come whole from rank 0's file.
    The transforms' own entries of ``extra`` stay ``fresh``'s; the rest of ``extra`` and the
    step are the checkpoint's. A key ``keep`` accepts that the checkpoint lacks keeps
    ``fresh``'s value (a lora run's frozen base, which its checkpoints leave out)."""
    index = reader.tensors
    locals_ = tensors_by_key(local_pieces(fresh))

    def assemble(key: str, like: torch.Tensor) -> torch.Tensor:
        if key not in pieces:
            got = reader.tensor(0, key)
            if (tuple(got.shape), got.dtype) != (tuple(like.shape), like.dtype):
                raise checkpoint.CheckpointError(
                    f"{reader.path}: {key!r} is {(tuple(got.shape), got.dtype)} in the "
                    f"checkpoint, but this layout holds {(tuple(like.shape), like.dtype)}"
                )
            return got
        entry = index.get(key)
        if entry is None and keep is not None and keep(key):
            return like
        if entry is None:
            raise checkpoint.CheckpointError(f"{reader.path} has no tensor {key!r}")
        if entry["dtype"] != str(like.dtype).removeprefix("torch."):
            raise checkpoint.CheckpointError(
                f"{reader.path}: {key!r} is {entry['dtype']} in the checkpoint, but this layout "
                f"holds {like.dtype}"
            )
        piece = pieces[key]
        if tuple(entry["shape"]) != piece.shape:
            raise checkpoint.CheckpointError(
                f"{reader.path}: {key!r} has shape {tuple(entry['shape'])} in the checkpoint, "
                f"{piece.shape} in this model: check the model config against the run that "
                "saved it"
            )
        out = torch.zeros(like.numel(), dtype=like.dtype)
        need = _by_global(piece.runs)  # what is still missing, as runs
        if len(need):
            lo, hi = int(need[0, 1]), int((need[:, 1] + need[:, 2]).max())
            for rank, (a, b) in sorted(entry["files"].items()):
                if b <= lo or a >= hi or not len(need):
                    continue
                pairs = _intersect(need, _by_global(reader.runs(rank, key)))
                if not len(pairs):
                    continue
                need = _subtract(need, pairs)
                _copy(reader, rank, key, pairs, out)
            if len(need):
                raise checkpoint.CheckpointError(
                    f"{reader.path}: element {int(need[0, 1])} of {key!r} is in none of the files"
                )
        return out.view(like.shape)

    values = {}
    for key, like in locals_.items():
        if key.startswith(("params.", "opt_state.")):
            values[key] = assemble(key, like)
            if check is not None:
                check(key, values[key])

    def fill(part: PyTree, prefix: str) -> PyTree:
        flat, treedef = tree.flatten_with_paths(part)
        saved = dict(tree.flatten_with_paths(reader.skeleton(prefix))[0])
        out = []
        for path, x in flat:
            key = f"{prefix}.{path}" if path else prefix
            if isinstance(x, torch.Tensor):
                out.append(rewrap(x, laid_out_as(values[key], local_piece(x))))
            elif path not in saved or saved[path] is checkpoint.TENSOR:
                raise checkpoint.CheckpointError(
                    f"{reader.path}: {key!r} is not in the checkpoint as a value; check the "
                    "optimizer config against the run that saved it"
                )
            else:  # an optimizer's step count: the checkpoint's
                out.append(saved[path])
        return tree.unflatten(treedef, out)

    saved_step, saved_extra = reader.step_and_extra()
    extra = {
        **saved_extra,
        **{k: v for k, v in fresh.extra.items() if isinstance(v, StateLayout)},
    }
    return TrainState(
        fill(fresh.params, "params"), fill(fresh.opt_state, "opt_state"), saved_step, extra
    )
