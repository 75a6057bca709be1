"""A training run's saved state, laid out for whatever resumes or reads it.

:func:`load_run` finds a run's newest checkpoint (:func:`checkpoint_path`) and returns its state
in the single-device layout, or, as a :class:`ShardedRun`, a handle from which each rank of any
layout reads just its own pieces: its own file under the layout that wrote it, the slices of the
files that hold its elements under any other. :func:`colfunc.train.run` resumes from either.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from colfunc import adapters, checkpoint, optim, parallel, random, reshard, tree
from colfunc.config import OptimConfig, RunConfig, lora_config, model_module
from colfunc.sharding import Mesh, RankFailedError, launch
from colfunc.step import StateLayout, TrainState, full_state, train_step
from colfunc.transforms.local import local_piece, rewrap

__all__ = [
    "CHECKPOINT",
    "CHECKPOINTS",
    "METRICS",
    "ShardedRun",
    "build_optimizer",
    "checkpoint_path",
    "element_layout",
    "load_run",
    "make_step",
    "model_params",
    "omits_base",
    "plain_step",
    "run_base",
    "saved_part",
    "single_layout",
]

CHECKPOINTS = "checkpoints"  # the run's store

CHECKPOINT = "checkpoint"  # the one folder that runs kept before the store

METRICS = "metrics.jsonl"


def checkpoint_path(run: str | Path) -> Path | None:
    """The checkpoint a run folder resumes from: its store's latest (or its one ``checkpoint/``
    folder, from before the store); ``run`` may also be a store or a checkpoint folder. None
    when there is none."""
    path = Path(run)
    if (path / checkpoint.META).is_file():
        return path
    for store in (path / CHECKPOINTS, path):
        found = checkpoint.latest(store)
        if found is not None:
            return found
    legacy = path / CHECKPOINT
    return legacy if legacy.is_dir() else None


def build_optimizer(cfg: OptimConfig, steps: int) -> optim.GradientTransformation:
    """AdamW under warmup + cosine decay over ``steps`` updates, after global-norm clipping."""
    lr = optim.warmup_cosine(cfg.lr, min(cfg.warmup_steps, steps), steps, final_lr=cfg.final_lr)
    adamw = optim.adamw(lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.clip_norm == 0:
        return adamw
    return optim.chain(optim.clip_by_global_norm(cfg.clip_norm), adamw)


def plain_step(cfg: RunConfig, *, donate: bool = False) -> Any:
    """The run's single-device step: its loss and optimizer, with its ``lora`` adapters."""
    model = model_module(cfg.model)
    step_fn = train_step(
        model.loss(cfg.model), build_optimizer(cfg.optim, cfg.train.steps), donate=donate
    )
    lora = lora_config(cfg.lora)
    return step_fn if lora is None else adapters.lora(step_fn, **lora.kwargs())


def model_params(cfg: RunConfig, params: Any) -> Any:
    """The parameters of a run's model: a ``lora`` run's adapters merged into its base (what
    ``generate``, ``export --hf`` and ``serve`` read); any other run's as they are."""
    lora = lora_config(cfg.lora)
    if lora is None or not any(adapters.is_adapter(p) for p in tree.paths(params)):
        return params
    return adapters.merge(params, lora)


def run_base(cfg: RunConfig, given: Any = None) -> Any:
    """The parameters a run starts from (``given``, else its folder's weights or its model's
    init from ``train.seed``): a lora run's frozen base, which its checkpoints leave out."""
    if given is not None:
        return given
    if cfg.init is not None:
        from colfunc import hf

        return hf.load(cfg.init, model_impl=hf.impl_of(cfg.model))[1]
    return model_module(cfg.model).init(cfg.model, seed=cfg.train.seed)


def omits_base(cfg: RunConfig) -> bool:
    """Whether the run's checkpoints hold its adapters and their optimizer state only (a lora
    run: the frozen base is made again from where it came from, so a checkpoint is megabytes)."""
    return lora_config(cfg.lora) is not None


def saved_part(cfg: RunConfig, state: TrainState) -> TrainState:
    """What a checkpoint of ``state`` holds (see :func:`omits_base`)."""
    if not omits_base(cfg):
        return state
    return state._replace(params=tree.subset(state.params, adapters.is_adapter))


def _kept(cfg: RunConfig) -> Any:
    """Which of a state's keys (``params.<path>``) a load keeps from the fresh state, when the
    checkpoint lacks them: a lora run's frozen base."""
    if not omits_base(cfg):
        return lambda key: False
    return lambda key: key.startswith("params.") and not adapters.is_adapter(key[7:])


def make_step(cfg: RunConfig, mesh: Mesh | None, pc: Any) -> Any:
    """The run's step on this rank: its loss and optimizer, composed as ``parallel`` says."""
    step_fn = plain_step(cfg, donate=True)
    model = model_module(cfg.model)
    if pc is not None and mesh is not None:
        step_fn = parallel.build(step_fn, mesh, pc, parallel.model_plan(model, pc, cfg.model))
    return step_fn


def _layout_key(cfg: RunConfig) -> Any:
    """What decides how a parallel run lays out its state (not how it launches)."""
    return {k: v for k, v in cfg.parallel.items() if k not in ("backend", "timeout")}


def _fresh_layout(step_fn: Any, cfg: RunConfig, base: Any = None) -> TrainState:
    """A new state of ``step_fn`` on this rank, for its layout only: abstract parameters made
    as zeros (a load replaces every value, so the model's random initialisation would be
    work thrown away), each rank making its own pieces; a pipeline cuts made ones. A lora
    run's is made from its base (:func:`run_base`), which its checkpoints leave out."""
    if omits_base(cfg):
        return step_fn.init(run_base(cfg, base))
    model = model_module(cfg.model)
    described = tree.map(
        lambda x: (
            random.abstract(x.shape, functools.partial(random.zeros, x.shape, x.dtype), x.dtype)
            if isinstance(x, random.Abstract)
            else x
        ),
        model.init(cfg.model, seed=cfg.train.seed, abstract=True),
    )
    if cfg.parallel.get("pipeline"):
        described = random.materialize(described)
    return step_fn.init(described)


def element_layout(step_fn: Any, cfg: RunConfig) -> dict[str, reshard.Piece]:
    """Which global elements each of this rank's tensors holds under ``step_fn``'s layout."""
    described = model_module(cfg.model).init(cfg.model, seed=cfg.train.seed, abstract=True)
    plain = plain_step(cfg)
    described = plain.prepare(described)  # (a lora run's adapters)
    opt_like = plain.init_opt(random.as_meta(described))
    return reshard.element_runs(step_fn, described, opt_like)


class ShardedRun:
    """A sharded checkpoint (one file per rank) and the run config that wrote it: each rank
    of the same layout reads its own file (:meth:`local`); any other layout, one device
    included, reads on each rank just the slices of the files that hold its own pieces
    (:meth:`resharded`, through the index's table of which file holds which elements).
    Checkpoints written before that table load through :meth:`full`, which rebuilds the
    writing composition in this process (threads) to put the pieces back together."""

    def __init__(
        self, path: Path, cfg: RunConfig, info: dict[str, Any], reader: checkpoint.ShardReader
    ) -> None:
        self.path, self.config, self.info = path, cfg, info
        self.step = int(info["step"])
        self.mesh_shape = dict(info["mesh"])
        self.reader = reader  # the index and headers, read once for every loading rank
        self.partial = bool(reader.tensors)
        self.bytes_read: dict[int, dict[int, int]] = {}  # loading rank -> file rank -> bytes

    def resharded(
        self, step_fn: Any, mesh: Mesh | None, cfg: RunConfig, base: Any = None
    ) -> TrainState:
        """This rank's state under ``step_fn``'s layout (any composition, mesh or world size;
        ``mesh`` None for one device), reading from each file only the blocks that hold the
        elements of this rank's pieces (a lora run's base made from ``base``, or again from
        its source: :func:`run_base`)."""
        pieces = element_layout(step_fn, cfg)
        fresh = _fresh_layout(step_fn, cfg, base)
        reader = self.reader.with_own_counts()
        state = reshard.read_local(reader, fresh, pieces, keep=_kept(cfg))
        self.bytes_read[0 if mesh is None else mesh.rank] = dict(reader.bytes_read)
        return state

    def same_layout(self, cfg: RunConfig, pc: Any) -> bool:
        return (
            pc is not None
            and pc.mesh_shape == self.mesh_shape
            and _layout_key(cfg) == _layout_key(self.config)
        )

    def local(self, step_fn: Any, mesh: Mesh, cfg: RunConfig, base: Any = None) -> TrainState:
        """This rank's state, as the writing rank held it, under the same composition."""
        saved, _ = checkpoint.load_shard(self.path, mesh.rank)
        fresh = _fresh_layout(step_fn, cfg, base)
        where = f"{self.path / checkpoint.shard_name(mesh.rank)}"
        kept = _kept(cfg)

        def fill(fresh_part: Any, saved_part: Any, what: str) -> Any:
            flat, treedef = tree.flatten_with_paths(fresh_part)
            have = dict(tree.flatten_with_paths(saved_part)[0])
            out = []
            for path, x in flat:
                if path not in have and what == "parameter" and kept(f"params.{path}"):
                    out.append(x)  # (a lora run's frozen base: made, not saved)
                    continue
                if path not in have:
                    raise checkpoint.CheckpointError(f"{where} has no {what} {path!r}")
                y = have[path]
                if not isinstance(x, torch.Tensor):
                    out.append(y)
                    continue
                mine = local_piece(x)
                if not isinstance(y, torch.Tensor) or (tuple(y.shape), y.dtype) != (
                    tuple(mine.shape),
                    mine.dtype,
                ):
                    got = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y)
                    raise checkpoint.CheckpointError(
                        f"{where}: {what} {path!r} is {got}, but this rank's layout holds "
                        f"{(tuple(mine.shape), mine.dtype)}"
                    )
                out.append(rewrap(x, reshard.laid_out_as(y, mine)))
            return tree.unflatten(treedef, out)

        params = fill(fresh.params, saved.params, "parameter")
        opt_state = fill(fresh.opt_state, saved.opt_state, "optimizer state")
        extra = {
            **saved.extra,
            **{k: v for k, v in fresh.extra.items() if isinstance(v, StateLayout)},
        }
        return TrainState(params, opt_state, saved.step, extra)

    def full(self) -> TrainState:
        """The state in the single-device layout (memory: the whole state). Each piece is read
        once from the file that holds it; a checkpoint written before the index's table is put
        together by the writing mesh's ranks, as threads here, and its composition."""
        cfg = self.config
        if self.partial:
            return self.resharded(make_step(cfg, None, None), None, cfg)
        pc = parallel.parse(cfg.parallel, cfg.model)

        def body(mesh: Mesh) -> TrainState | None:
            local = self.local(make_step(cfg, mesh, pc), mesh, cfg)
            full = single_layout(local)
            return full if mesh.rank == 0 else None

        try:
            out = launch(body, mesh=self.mesh_shape, backend="threads", timeout=pc.timeout)[0]
        except RankFailedError as e:  # a damaged file: the error that names it
            if isinstance(e.__cause__, checkpoint.CheckpointError):
                raise e.__cause__ from None
            raise
        assert out is not None
        return out


def single_layout(state: TrainState) -> TrainState:
    """``full_state`` without the transforms' own entries of extra (made afresh on resuming);
    a collective under a mesh."""
    full = full_state(state)
    kept = {k: v for k, v in full.extra.items() if not isinstance(v, StateLayout)}
    return TrainState(full.params, full.opt_state, full.step, kept)


def load_run(run: str | Path, *, gather: bool = True) -> tuple[Any, RunConfig]:
    """``(state, config)`` of the run folder ``run`` (or of a checkpoint folder itself), the
    state in the single-device layout. ``gather=False`` returns the checkpoint as a
    :class:`ShardedRun` instead, read by :func:`run` on each rank: its own file under the same
    layout, or only the slices that hold its own pieces under any other (a single-device
    checkpoint too)."""
    path = checkpoint_path(run)
    if path is None:
        if Path(run, METRICS).is_file():
            raise checkpoint.CheckpointError(
                f"run folder {str(run)!r} has no checkpoint yet: it stopped before its first "
                f"save (set train.save_every to save as it goes); remove the folder to start "
                f"it again"
            )
        raise checkpoint.CheckpointError(
            f"{str(run)!r} is not a run folder or a checkpoint: it has no {CHECKPOINTS}/"
        )
    info = checkpoint.sharded_meta(path)
    if info is not None:
        reader = checkpoint.ShardReader(path)
        cfg = reader.config  # (the index's, no tensor read)
        if not isinstance(cfg, RunConfig):
            raise ValueError(f"{str(path)!r} is not the checkpoint of a colfunc training run")
        handle = ShardedRun(path, cfg, info, reader)
        return (handle if not gather else handle.full()), cfg
    if not gather:  # one file: each rank of any layout reads the slices of its own pieces
        reader = checkpoint.ShardReader(path)
        cfg = reader.config
        if isinstance(cfg, RunConfig) and reader.tensors:
            step, _ = reader.step_and_extra()
            return ShardedRun(path, cfg, {"step": step, "mesh": {}}, reader), cfg
    state, cfg = checkpoint.load(path)
    if not (isinstance(cfg, RunConfig) and isinstance(state, TrainState)):
        raise ValueError(f"{str(path)!r} is not the checkpoint of a colfunc training run")
    if omits_base(cfg) and all(adapters.is_adapter(p) for p in tree.paths(state.params)):
        made = plain_step(cfg).prepare(run_base(cfg))  # the adapters saved, the base made again
        state = state._replace(params=tree.merge(made, state.params))
    return state, cfg
