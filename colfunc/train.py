"""The training loop behind ``colfunc train``: one device, a byte-level corpus, a run folder.

A run folder ``runs/<name>/`` holds

``metrics.jsonl``
    one JSON object per record: ``step``, ``loss`` (mean training loss since the previous
    record), ``lr``, ``grad_norm``, ``tokens_per_s``, ``elapsed`` (seconds), and ``val_loss``
    where the validation loss was measured (also at step 0, before training);
``loss.png``
    the training and validation curves;
``checkpoints/``
    a store of step-numbered checkpoints (``step-00000100/``: the ``TrainState`` and the run
    config) and a ``latest`` file naming the newest (:func:`colfunc.checkpoint.commit`):
    written every ``train.save_every`` steps (keeping ``train.keep_last``), at the end, and when
    the run is stopped by Ctrl-C or SIGTERM. Each commit is atomic, so a crash or a SIGKILL at
    any moment leaves the previous checkpoint loadable. A parallel run's checkpoints are
    sharded: each rank writes its own pieces, nothing is gathered; resumed under the same
    layout each rank reads only its own file, under any other (or by ``generate``, ``export``,
    ``serve``) the writing composition is rebuilt in this process to lay the state out anew.
    (Runs written before the store kept one ``checkpoint/`` folder; they still load and resume.)

Batch ``i`` is a pure function of ``(data.seed, i)`` (the step is the data position; the loop
draws no other random numbers) and the state holds the optimizer's count, so a resumed run
continues exactly: 20 steps equal 10 steps, a checkpoint, and 10 more, bit for bit.

Ctrl-C (SIGINT) and SIGTERM (what ``timeout``, schedulers and ``docker stop`` send) never cut a
step short: the run stops after the step in progress, every rank of a parallel run at the same
step, saves, and raises :class:`Interrupted` (the CLI exits 130 or 143). A loss that is not
finite stops the run before anything is saved, so it never replaces a good checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from colfunc import checkpoint, hf, optim, parallel, random, reshard, tasks, tree
from colfunc.config import OptimConfig, RunConfig, model_module
from colfunc.sharding import Mesh, RankFailedError, comm, launch
from colfunc.step import StateLayout, TrainState, full_state, train_step
from colfunc.transforms.local import local_piece, rewrap

__all__ = [
    "CHECKPOINT",
    "CHECKPOINTS",
    "Interrupted",
    "build_optimizer",
    "checkpoint_path",
    "evaluate",
    "load_run",
    "plot",
    "run",
]

CHECKPOINTS = "checkpoints"  # the run's store
CHECKPOINT = "checkpoint"  # the one folder that runs kept before the store
METRICS = "metrics.jsonl"
PLOT = "loss.png"


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (``signum``: SIGINT or SIGTERM) after saving its state."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step = signum, step


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


def _make_step(cfg: RunConfig, mesh: Mesh | None, pc: Any) -> Any:
    """The run's step on this rank: its loss and optimizer, composed as ``parallel`` says."""
    model = model_module(cfg.model)
    # the loop never looks at a state again once it is stepped: let the step reuse its buffers
    step_fn = train_step(
        model.loss(cfg.model), build_optimizer(cfg.optim, cfg.train.steps), donate=True
    )
    if pc is not None and mesh is not None:
        step_fn = parallel.build(step_fn, mesh, pc, parallel.model_plan(model, pc))
    return step_fn


def _layout_key(cfg: RunConfig) -> Any:
    """What decides how a parallel run lays out its state (not how it launches)."""
    return {k: v for k, v in cfg.parallel.items() if k not in ("backend", "timeout")}


def _fresh_layout(step_fn: Any, cfg: RunConfig) -> TrainState:
    """A new state of ``step_fn`` on this rank, for its layout only: abstract parameters made
    as zeros (a load replaces every value, so the model's random initialisation would be
    work thrown away), each rank making its own pieces; a pipeline cuts made ones."""
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


def _layout_pieces(step_fn: Any, cfg: RunConfig) -> dict[str, reshard.Piece]:
    """Which global elements each of this rank's tensors holds under ``step_fn``'s layout."""
    described = model_module(cfg.model).init(cfg.model, seed=cfg.train.seed, abstract=True)
    opt_like = build_optimizer(cfg.optim, cfg.train.steps).init(random.as_meta(described))
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

    def resharded(self, step_fn: Any, mesh: Mesh | None, cfg: RunConfig) -> TrainState:
        """This rank's state under ``step_fn``'s layout (any composition, mesh or world size;
        ``mesh`` None for one device), reading from each file only the blocks that hold the
        elements of this rank's pieces."""
        pieces = _layout_pieces(step_fn, cfg)
        fresh = _fresh_layout(step_fn, cfg)
        reader = self.reader.with_own_counts()
        state = reshard.read_local(reader, fresh, pieces)
        self.bytes_read[0 if mesh is None else mesh.rank] = dict(reader.bytes_read)
        return state

    def same_layout(self, cfg: RunConfig, pc: Any) -> bool:
        return (
            pc is not None
            and pc.mesh_shape == self.mesh_shape
            and _layout_key(cfg) == _layout_key(self.config)
        )

    def local(self, step_fn: Any, mesh: Mesh, cfg: RunConfig) -> TrainState:
        """This rank's state, as the writing rank held it, under the same composition."""
        saved, _ = checkpoint.load_shard(self.path, mesh.rank)
        fresh = _fresh_layout(step_fn, cfg)
        where = f"{self.path / checkpoint.shard_name(mesh.rank)}"

        def fill(fresh_part: Any, saved_part: Any, what: str) -> Any:
            flat, treedef = tree.flatten_with_paths(fresh_part)
            have = dict(tree.flatten_with_paths(saved_part)[0])
            out = []
            for path, x in flat:
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
            return self.resharded(_make_step(cfg, None, None), None, cfg)
        pc = parallel.parse(cfg.parallel)

        def body(mesh: Mesh) -> TrainState | None:
            local = self.local(_make_step(cfg, mesh, pc), mesh, cfg)
            full = _single_layout(local)
            return full if mesh.rank == 0 else None

        try:
            out = launch(body, mesh=self.mesh_shape, backend="threads", timeout=pc.timeout)[0]
        except RankFailedError as e:  # a damaged file: the error that names it
            if isinstance(e.__cause__, checkpoint.CheckpointError):
                raise e.__cause__ from None
            raise
        assert out is not None
        return out


def _single_layout(state: TrainState) -> TrainState:
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
    return state, cfg


def build_optimizer(cfg: OptimConfig, steps: int) -> optim.GradientTransformation:
    """AdamW under warmup + cosine decay over ``steps`` updates, after global-norm clipping."""
    lr = optim.warmup_cosine(cfg.lr, min(cfg.warmup_steps, steps), steps, final_lr=cfg.final_lr)
    adamw = optim.adamw(lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.clip_norm == 0:
        return adamw
    return optim.chain(optim.clip_by_global_norm(cfg.clip_norm), adamw)


@torch.no_grad()
def evaluate(loss_fn: Any, params: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    """The mean loss over ``batches`` (nats per token; per byte for a byte-level model)."""
    return sum(float(loss_fn(params, b)) for b in batches) / len(batches)


def plot(
    records: list[dict[str, Any]], path: Path, title: str = "", unit: str = "nats/byte"
) -> None:
    """Training and validation loss against step, written to ``path`` (PNG)."""
    # The object API needs no pyplot and no global backend: safe inside any host program.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:  # (a run resumed for no steps has nothing to draw)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _max_over_ranks(value: int, mesh: Mesh | None) -> int:
    """The largest ``value`` of all ranks (a collective over every axis under a mesh)."""
    if mesh is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    return int(comm.all_reduce(t, tuple(mesh.axis_names), "max", mesh)[0])


class _Signals:
    """SIGINT and SIGTERM noted, not raised, while installed (main thread only): the loop
    stops at the end of its step. The note is process-wide, so every rank thread sees it."""

    caught = 0  # the signal number, 0 for none
    stopped = 0  # the signal the ranks stopped on
    installed = False

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or cls.installed:
            yield
            return
        cls.caught = cls.stopped = 0

        def note(signum: int, frame: Any) -> None:
            cls.caught = cls.caught or signum
            for child in multiprocessing.active_children():  # the ranks of a gloo launch
                if child.name.startswith("colfunc-rank-") and child.pid:
                    with contextlib.suppress(OSError):
                        os.kill(child.pid, signum)

        previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
        cls.installed = True
        try:
            yield
        finally:
            cls.installed = False
            for s, handler in previous.items():
                signal.signal(s, handler)

    @classmethod
    def agreed(cls, mesh: Mesh | None) -> int:
        """The signal every rank stops on (0: go on); a collective under a mesh, so that all
        ranks stop after the same step."""
        return _max_over_ranks(cls.caught, mesh)


def _check_finite(loss: torch.Tensor, step: int, last_saved: int | None) -> None:
    if bool(torch.isfinite(loss)):
        return
    kept = (
        f"the checkpoint of step {last_saved} is kept"
        if last_saved is not None
        else "nothing was saved"
    )
    raise ValueError(
        f"step {step}: the training loss is {float(loss)} (not finite); the run stops without "
        f"saving ({kept}); lower optim.lr, raise optim.warmup_steps or clip harder"
    )


def _check_resumable(state: Any, fresh: TrainState) -> None:
    if not isinstance(state, TrainState):
        raise ValueError(f"the checkpoint holds a {type(state).__name__}, not a TrainState")
    want = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(fresh)[0] if hasattr(x, "shape")}
    got = {p: tuple(x.shape) for p, x in tree.flatten_with_paths(state)[0] if hasattr(x, "shape")}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise ValueError(
            f"the checkpoint does not match the configured model and optimizer: {diff}"
        )


def _read_records(path: Path, up_to: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # a line cut short by a crash mid-write: drop it
                break
            raise ValueError(f"{str(path)!r} line {i + 1} is corrupt: {e}") from e
    return [r for r in records if r["step"] <= up_to]


class _Log:
    """``metrics.jsonl`` as it grows: the records so far, each appended and flushed at once."""

    def __init__(self, path: Path, records: list[dict[str, Any]], t0: float) -> None:
        self.records = records
        self.t0 = t0
        # a resumed run's clock continues from its last record
        self.offset = records[-1]["elapsed"] if records else 0.0
        self.file = open(path, "a")  # noqa: SIM115 (closed by close())

    def elapsed(self) -> float:
        return round(self.offset + time.perf_counter() - self.t0, 3)

    def emit(self, record: dict[str, Any]) -> None:
        record["elapsed"] = self.elapsed()
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _interval_record(
    step: int, metrics: dict[str, Any], losses: list[torch.Tensor], tokens: int, seconds: float
) -> dict[str, Any]:
    return {
        "step": step,
        "loss": float(torch.stack(losses).mean()),
        "lr": metrics["lr"],
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": round(len(losses) * tokens / seconds, 1),
    }


def _open_run(run_dir: Path, state: TrainState | None) -> list[dict[str, Any]]:
    """Create a fresh run's folder, or trim a resumed run's records to its checkpoint."""
    path = run_dir / METRICS
    if state is None:
        run_dir.mkdir(parents=True, exist_ok=True)  # (an empty folder claimed for this run)
        return []
    # Records past the checkpoint belong to steps that will now be trained again.
    records = _read_records(path, state.step)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def run(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    state: TrainState | None = None,
    stop_at: int | None = None,
    progress: bool = True,
    restart: bool = False,
) -> TrainState:
    """Train ``cfg`` into ``run_dir``; returns the final state.

    A fresh run needs a ``run_dir`` that does not exist yet (or is empty). Passing the ``state``
    of the run's checkpoint resumes it: training continues from ``state.step`` and appends to
    the run folder. ``stop_at`` ends the run early at that step (the learning-rate schedule
    still spans ``train.steps``). Ctrl-C and SIGTERM stop it after the step in progress, with a
    checkpoint (see the module). ``restart``: under torchrun's restarts
    (``colfunc run --max-restarts``), a restarted group may find the folder of its first attempt
    without a checkpoint, and starts it again.

    With a ``parallel`` section the same loop runs on every rank of its mesh (threads in this
    process, gloo processes, or the ranks of ``colfunc run``); rank 0 writes the run folder and
    every rank its own shard of each checkpoint. ``state`` may be the :class:`ShardedRun` of
    ``load_run(..., gather=False)``: the same layout then reads only each rank's own file; a run
    resumes under any ``parallel`` section, or none.
    """
    run_dir = Path(run_dir)
    pc = parallel.parse(cfg.parallel) if cfg.parallel else None
    if pc is not None:
        pc.check_seq_len(cfg.data.seq_len)
    lead_process = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 makes the folder
    restarted = restart and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if state is None and lead_process and run_dir.exists() and restarted:
        if checkpoint_path(run_dir) is not None:
            raise ValueError(f"run folder {str(run_dir)!r} has a checkpoint: resume it")
        for name in (METRICS, PLOT):  # a restart before the first save: start afresh
            (run_dir / name).unlink(missing_ok=True)
        if (run_dir / CHECKPOINTS).is_dir():  # (temporaries of a save cut short, at most)
            shutil.rmtree(run_dir / CHECKPOINTS)
        run_dir.rmdir()
    elif state is None and lead_process and run_dir.exists() and any(run_dir.iterdir()):
        if checkpoint_path(run_dir) is None:
            raise ValueError(
                f"run folder {str(run_dir)!r} already exists and holds no checkpoint (the run "
                f"stopped before its first save); remove it or pick another name (--name)"
            )
        raise ValueError(
            f"run folder {str(run_dir)!r} already exists; pick another name (--name) or "
            f"continue it with --resume {run_dir}"
        )
    t_start = time.perf_counter()
    task = tasks.for_run(cfg)  # the corpus (or the video set) read once, here
    # weights read once, here: ranks (threads) must not import transformers side by side
    params0 = hf.load(cfg.init)[1] if cfg.init is not None else None
    if isinstance(state, ShardedRun) and not state.same_layout(cfg, pc) and not state.partial:
        state = state.full()  # another layout, an old checkpoint: from the single-device one
    body = functools.partial(
        _train, cfg, run_dir, task, state, stop_at, progress, pc, t_start, params0
    )
    with _Signals.held():  # the rank threads' signals arrive here, in the main thread
        if pc is None:
            final: TrainState = body(None)
        else:
            backend = parallel.backend(pc)
            final = launch(body, mesh=pc.mesh_shape, backend=backend, timeout=pc.timeout)[0]
        signum = _Signals.stopped
        if not signum and pc is not None and parallel.backend(pc) == "gloo":
            signum = _Signals.caught  # forwarded to the rank processes, which stopped on it
        if signum:
            raise Interrupted(signum, final.step)
    return final


def _train(
    cfg: RunConfig,
    run_dir: Path,
    task: tasks.LanguageTask | tasks.VideoTask,
    state: TrainState | None,
    stop_at: int | None,
    progress: bool,
    pc: parallel.ParallelConfig | None,
    t_start: float,
    given: Any,
    mesh: Mesh | None,
) -> TrainState:
    """The loop on one rank (``mesh`` None: the single-device run); rank 0 does all the I/O."""
    lead = mesh is None or mesh.rank == 0
    tc = cfg.train
    stop = tc.steps if stop_at is None else min(stop_at, tc.steps)
    tokens_per_step = task.per_step
    model = model_module(cfg.model)
    loss_fn = model.loss(cfg.model)
    step_fn = _make_step(cfg, mesh, pc)
    params0 = model.init(cfg.model, seed=tc.seed) if given is None else given
    if isinstance(state, ShardedRun):
        if mesh is not None and state.same_layout(cfg, pc):  # this rank's own file, no other
            state = state.local(step_fn, mesh, cfg)
        else:  # another layout: the slices of each file that hold this rank's pieces
            state = state.resharded(step_fn, mesh, cfg)
    elif state is not None:  # in the single-device layout, whatever the mesh was
        _check_resumable(
            state, train_step(loss_fn, build_optimizer(cfg.optim, tc.steps)).init(params0)
        )
        if mesh is not None:
            state = step_fn.place_state(state)
    val_batches = task.validation()

    def validation(state: TrainState) -> float | None:
        # the composition's own forward pass on every rank (a collective under a mesh), which
        # gathers nothing its training forward pass does not
        losses = [float(step_fn.evaluate(state, b)["loss"]) for b in val_batches]
        return sum(losses) / len(losses) if lead else None

    def saved(state: TrainState) -> TrainState:
        # the single-device layout (a collective under a mesh)
        return state if mesh is None else _single_layout(state)

    log = _Log(run_dir / METRICS, _open_run(run_dir, state), t_start) if lead else None
    state = step_fn.init(params0) if state is None else state
    n_params = sum(x.numel() for x in tree.tensors(params0))
    where = (
        f"{torch.get_num_threads()} CPU threads"
        if mesh is None
        else f"mesh {mesh.shape} ({mesh.backend})"
    )
    if lead:
        print(
            f"colfunc: training {type(cfg.model).__module__.rsplit('.', 1)[-1]} "
            f"({n_params / 1e6:.2f}M parameters) {task.describe()} on {where} into {run_dir}/",
            flush=True,
        )

    from tqdm import tqdm

    bar = tqdm(
        total=stop,
        initial=state.step,
        unit="step",
        disable=not (progress and lead),
        mininterval=0.5 if sys.stderr.isatty() else 30.0,  # a log file gets a line per 30 s
        dynamic_ncols=True,
    )
    losses: list[torch.Tensor] = []
    metrics: dict[str, Any] = {}
    t_interval = time.perf_counter()
    store = run_dir / CHECKPOINTS
    # one device: the whole state in a background commit; under a mesh, each rank's shard
    writer = checkpoint.AsyncWriter() if tc.async_save and mesh is None else None
    last_saved = [state.step if state.step else None]
    keep = tc.keep_last or None

    def any_rank(flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (a collective under a mesh)."""
        return bool(_max_over_ranks(int(flag), mesh))

    def save(state: TrainState) -> None:
        if mesh is not None:
            return save_shards(state)
        bad = [p for p, x in tree.flatten_with_paths(state.params)[0] if not x.isfinite().all()]
        if bad:
            raise ValueError(
                f"step {state.step}: parameter {bad[0]!r} is not finite; the run stops without "
                f"saving, so the checkpoint of step {last_saved[0]} is kept"
            )
        if writer is not None:
            writer.submit(store, state.step, state, cfg, keep_last=keep)
        else:
            checkpoint.commit(store, state.step, state, cfg, keep_last=keep)
        last_saved[0] = state.step

    def pieces() -> dict[str, reshard.Piece]:
        """Which global elements each of this rank's tensors holds (the layout's, found once,
        at the first save: every rank saves at the same steps)."""
        if not layout_pieces:
            layout_pieces.append(_layout_pieces(step_fn, cfg))
        return layout_pieces[0]

    layout_pieces: list[dict[str, reshard.Piece]] = []

    def save_shards(state: TrainState) -> None:
        """Every rank writes its own pieces, as it holds them (no gathering), with which
        global elements they hold; rank 0 writes the index once all have, and commits."""
        assert mesh is not None
        local = reshard.local_pieces(state)
        described = pieces()
        floats = [
            (p, x) for p, x in tree.flatten_with_paths(local.params)[0] if x.is_floating_point()
        ]
        bad = [p for p, x in floats if not x.isfinite().all()]
        if any_rank(bool(bad)):
            raise ValueError(
                f"step {state.step}: parameter {bad[0] if bad else '(on another rank)'!r} is not "
                f"finite; the run stops without saving, so the checkpoint of step "
                f"{last_saved[0]} is kept"
            )
        settle(wait=True)  # the one before first (a new one clears the store's temporaries)
        fresh = checkpoint.begin_sharded(store, state.step) if lead else False
        if not any_rank(fresh):  # (rank 0's answer: that step is committed already)
            return
        if tc.async_save:  # the host copy now; the file in the background; commit in settle
            host = checkpoint.AsyncWriter.snapshot(local)
            errors: list[BaseException] = []

            def work(step: int = state.step) -> None:
                try:
                    checkpoint.write_shard(store, step, mesh.rank, host, described)
                except BaseException as e:  # raised on every rank by settle
                    errors.append(e)

            thread = threading.Thread(target=work, name=f"colfunc-shard-{state.step}", daemon=True)
            thread.start()
            pending[:] = [(state.step, thread, errors)]
            return
        error: BaseException | None = None
        try:
            checkpoint.write_shard(store, state.step, mesh.rank, local, described)
        except Exception as e:  # every rank must learn of it, or the others would commit
            error = e
        if any_rank(error is not None):
            if lead:
                checkpoint.abandon_sharded(store, state.step)
            raise error or checkpoint.CheckpointError(
                f"step {state.step}: another rank failed to write its shard; nothing was committed"
            )
        if lead:
            checkpoint.finish_sharded(store, state.step, cfg, mesh_shape=mesh.shape, keep_last=keep)
        last_saved[0] = state.step

    pending: list[tuple[int, threading.Thread, list[BaseException]]] = []

    def settle(wait: bool) -> None:
        """Commit the shard written in the background once every rank has written its own (a
        collective while one is pending: the ranks save at the same steps). ``wait``: block
        until then; otherwise commit only if all are done already."""
        if not pending:
            return
        assert mesh is not None
        step, thread, errors = pending[0]
        if wait:
            thread.join()
        if any_rank(thread.is_alive()):
            return
        pending.clear()
        if any_rank(bool(errors)):
            if lead:
                checkpoint.abandon_sharded(store, step)
            raise (
                errors[0]
                if errors
                else checkpoint.CheckpointError(
                    f"step {step}: another rank failed to write its shard; nothing was committed"
                )
            )
        if lead:
            checkpoint.finish_sharded(store, step, cfg, mesh_shape=mesh.shape, keep_last=keep)
        last_saved[0] = step

    stopped = 0
    signals = _Signals.held()  # (a spawned rank's main thread; elsewhere run() holds them)
    signals.__enter__()
    try:
        if state.step == 0:
            val = validation(state)
            if log is not None:
                log.emit({"step": 0, "val_loss": val})
        in_step = [False]
        try:
            while state.step < stop:
                batch = task.batch(state.step)
                in_step[0] = True
                state, metrics = step_fn(state, batch)
                in_step[0] = False
                _check_finite(metrics["loss"], state.step, last_saved[0])
                losses.append(metrics["loss"])
                bar.update(1)
                s = state.step
                stopped = _Signals.agreed(mesh)
                settle(wait=False)
                if not (s % tc.log_every and s % tc.eval_every and s != stop) or stopped:
                    seconds = time.perf_counter() - t_interval
                    record = _interval_record(s, metrics, losses, tokens_per_step, seconds)
                    if (s % tc.eval_every == 0 or s == stop) and not stopped:
                        record["val_loss"] = validation(state)
                    if log is not None:
                        log.emit(record)
                    shown = {
                        "loss": f"{record['loss']:.3f}",
                        f"{task.unit}/s": f"{record['tokens_per_s']:.0f}",
                    }
                    if record.get("val_loss") is not None:
                        shown["val"] = f"{record['val_loss']:.3f}"
                    bar.set_postfix(shown, refresh=False)
                    losses, t_interval = [], time.perf_counter()
                if stopped:
                    break
                if tc.save_every and s % tc.save_every == 0 and s != stop:
                    save(state)
        except KeyboardInterrupt:
            # raised by code, not a signal (those are held): outside a step the state is the
            # last complete step's, and one device stops on it as on Ctrl-C; inside a step the
            # donated state is half-written, and is not saved
            if mesh is not None or in_step[0]:
                raise
            stopped = signal.SIGINT
            if losses and log is not None:
                seconds = time.perf_counter() - t_interval
                log.emit(_interval_record(state.step, metrics, losses, tokens_per_step, seconds))
        bar.close()  # before the messages below, so the bar does not redraw over them
        save(state)
        settle(wait=True)
        if writer is not None:
            writer.wait()
    finally:
        signals.__exit__(None, None, None)
        for _, thread, _ in pending:  # an error on its way out: let the write end, uncommitted
            thread.join()
        bar.close()
        if writer is not None:
            with contextlib.suppress(Exception):  # an error already on its way out wins
                writer.wait()
        if log is not None:
            log.close()

    if stopped:
        _Signals.stopped = stopped
    # the end's sample needs the whole parameters (a gather under a mesh: every rank)
    final = saved(state) if tc.sample_tokens and not stopped else state
    if log is None:
        return state
    plot(log.records, run_dir / PLOT, title=run_dir.name, unit=task.loss_unit)
    if stopped:
        name = signal.Signals(stopped).name
        print(
            f"colfunc: stopped by {name} at step {state.step}; checkpoint saved. Continue with: "
            f"colfunc train --resume {run_dir}",
            file=sys.stderr,
            flush=True,
        )
        return state
    last_val = next((r["val_loss"] for r in reversed(log.records) if "val_loss" in r), None)
    val_text = f", validation loss {last_val:.3f} {task.loss_unit}" if last_val is not None else ""
    print(
        f"colfunc: step {state.step}{val_text}, {log.elapsed():.1f} s; wrote {run_dir}/",
        flush=True,
    )
    message = task.finish(final.params, run_dir)
    if message is not None:
        print(message, flush=True)
    return state
