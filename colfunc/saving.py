"""A training run's checkpoint commits, on one rank of it.

One device commits the whole state to the run's store (in a background thread with
``train.async_save``). Under a mesh every rank writes its own pieces, as it holds them, with
which global elements they hold, and rank 0 commits the index once all have (the write in the
background with ``async_save``: :meth:`Saver.settle` commits it once every rank's is done). A
state with a parameter that is not finite is never saved, so it never replaces a good
checkpoint; a rank that fails to write makes every rank raise, and nothing is committed.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import torch

from colfunc import checkpoint, reshard, tree
from colfunc.config import RunConfig
from colfunc.resume import element_layout, saved_part
from colfunc.sharding import Mesh, comm
from colfunc.step import TrainState

__all__ = ["Saver", "max_over_ranks"]


def max_over_ranks(value: int, mesh: Mesh | None) -> int:
    """The largest ``value`` of all ranks (a collective over every axis under a mesh)."""
    if mesh is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    return int(comm.all_reduce(t, tuple(mesh.axis_names), "max", mesh)[0])


class Saver:
    """The checkpoint commits of one rank's loop into the store ``store``.

    ``last_saved`` is the step of the newest checkpoint (None: none yet), which the loop's
    error messages name. Call :meth:`save` at the same steps on every rank, :meth:`settle`
    after each step (a collective while a background write is pending), :meth:`finish` at the
    end, and :meth:`close` on the way out, error or not.
    """

    def __init__(
        self,
        store: Path,
        cfg: RunConfig,
        step_fn: Any,
        mesh: Mesh | None,
        last_saved: int | None,
    ) -> None:
        self.store, self.cfg, self.step_fn, self.mesh = store, cfg, step_fn, mesh
        self.lead = mesh is None or mesh.rank == 0
        self.async_save = cfg.train.async_save
        self.keep = cfg.train.keep_last or None
        # one device: the whole state in a background commit; under a mesh, each rank's shard
        self.writer = checkpoint.AsyncWriter() if self.async_save and mesh is None else None
        self.last_saved = last_saved
        self._pieces: dict[str, reshard.Piece] | None = None
        self.pending: list[tuple[int, threading.Thread, list[BaseException]]] = []

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (a collective under a mesh)."""
        return bool(max_over_ranks(int(flag), self.mesh))

    def save(self, state: TrainState) -> None:
        """Commit ``state`` (its step's checkpoint), unless a parameter is not finite."""
        if self.mesh is not None:
            return self._save_shards(state, self.mesh)
        bad = [p for p, x in tree.flatten_with_paths(state.params)[0] if not x.isfinite().all()]
        if bad:
            raise ValueError(
                f"step {state.step}: parameter {bad[0]!r} is not finite; the run stops without "
                f"saving, so the checkpoint of step {self.last_saved} is kept"
            )
        saved = saved_part(self.cfg, state)  # (a lora run's: its adapters, not its base)
        if self.writer is not None:
            self.writer.submit(self.store, state.step, saved, self.cfg, keep_last=self.keep)
        else:
            checkpoint.commit(self.store, state.step, saved, self.cfg, keep_last=self.keep)
        self.last_saved = state.step

    def pieces(self) -> dict[str, reshard.Piece]:
        """Which global elements each of this rank's tensors holds (the layout's, found once,
        at the first save: every rank saves at the same steps)."""
        if self._pieces is None:
            self._pieces = element_layout(self.step_fn, self.cfg)
        return self._pieces

    def _save_shards(self, state: TrainState, mesh: Mesh) -> None:
        """Every rank writes its own pieces, as it holds them (no gathering), with which
        global elements they hold; rank 0 writes the index once all have, and commits."""
        local = saved_part(self.cfg, reshard.local_pieces(state))
        kept = {f"params.{p}" for p in tree.paths(local.params)}
        described = {
            k: v for k, v in self.pieces().items() if not k.startswith("params.") or k in kept
        }
        floats = [
            (p, x) for p, x in tree.flatten_with_paths(local.params)[0] if x.is_floating_point()
        ]
        bad = [p for p, x in floats if not x.isfinite().all()]
        if self.any_rank(bool(bad)):
            raise ValueError(
                f"step {state.step}: parameter {bad[0] if bad else '(on another rank)'!r} is not "
                f"finite; the run stops without saving, so the checkpoint of step "
                f"{self.last_saved} is kept"
            )
        self.settle(wait=True)  # the one before first (a new one clears the store's temporaries)
        fresh = checkpoint.begin_sharded(self.store, state.step) if self.lead else False
        if not self.any_rank(fresh):  # (rank 0's answer: that step is committed already)
            return
        if self.async_save:  # the host copy now; the file in the background; commit in settle
            host = checkpoint.AsyncWriter.snapshot(local)
            errors: list[BaseException] = []

            def work(step: int = state.step) -> None:
                try:
                    checkpoint.write_shard(self.store, step, mesh.rank, host, described)
                except BaseException as e:  # raised on every rank by settle
                    errors.append(e)

            thread = threading.Thread(target=work, name=f"colfunc-shard-{state.step}", daemon=True)
            thread.start()
            self.pending[:] = [(state.step, thread, errors)]
            return
        error: BaseException | None = None
        try:
            checkpoint.write_shard(self.store, state.step, mesh.rank, local, described)
        except Exception as e:  # every rank must learn of it, or the others would commit
            error = e
        self._commit_or_raise(state.step, error)

    def _commit_or_raise(self, step: int, error: BaseException | None) -> None:
        """Rank 0 commits ``step``'s shards once every rank has written its own; if one
        failed (``error`` on this rank), every rank raises and nothing is committed."""
        assert self.mesh is not None
        if self.any_rank(error is not None):
            if self.lead:
                checkpoint.abandon_sharded(self.store, step)
            raise error or checkpoint.CheckpointError(
                f"step {step}: another rank failed to write its shard; nothing was committed"
            )
        if self.lead:
            checkpoint.finish_sharded(
                self.store, step, self.cfg, mesh_shape=self.mesh.shape, keep_last=self.keep
            )
        self.last_saved = step

    def settle(self, wait: bool) -> None:
        """Commit the shard written in the background once every rank has written its own (a
        collective while one is pending: the ranks save at the same steps). ``wait``: block
        until then; otherwise commit only if all are done already."""
        if not self.pending:
            return
        step, thread, errors = self.pending[0]
        if wait:
            thread.join()
        if self.any_rank(thread.is_alive()):
            return
        self.pending.clear()
        self._commit_or_raise(step, errors[0] if errors else None)

    def finish(self) -> None:
        """Wait for every write and commit (the end of the loop)."""
        self.settle(wait=True)
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """On the way out, error or not: let a background write end (uncommitted)."""
        for _, thread, _ in self.pending:
            thread.join()
        if self.writer is not None:
            with contextlib.suppress(Exception):  # an error already on its way out wins
                self.writer.wait()
