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
import dataclasses
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

from colfunc import adapters, hf, parallel, random, tasks, tree
from colfunc.config import RunConfig, lora_config, model_module
from colfunc.resume import (
    CHECKPOINT,
    CHECKPOINTS,
    METRICS,
    ShardedRun,
    build_optimizer,
    checkpoint_path,
    load_run,
    make_step,
    model_params,
    plain_step,
    single_layout,
)
from colfunc.saving import Saver, max_over_ranks
from colfunc.sharding import Mesh, launch
from colfunc.step import TrainState

__all__ = [
    "CHECKPOINT",
    "CHECKPOINTS",
    "Interrupted",
    "build_optimizer",
    "checkpoint_path",
    "evaluate",
    "load_run",
    "model_params",
    "plot",
    "run",
]

PLOT = "loss.png"


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (``signum``: SIGINT or SIGTERM) after saving its state."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step = signum, step


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
        return max_over_ranks(cls.caught, mesh)


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


def _warn_emulated_bf16(pc: parallel.ParallelConfig) -> None:
    """Say once, with its measured cost, that amp's bf16 is emulated on this CPU."""
    from colfunc.transforms.amp import bf16_is_native, bf16_slowdown

    dtype = (pc.amp or {}).get("dtype")
    if dtype not in ("bf16", "bfloat16", torch.bfloat16) or bf16_is_native():
        return
    if os.environ.get("RANK", "0") != "0":
        return
    slow = bf16_slowdown()
    print(
        f"colfunc: amp dtype bf16 on a CPU without native bf16 "
        f"({torch.backends.cpu.get_cpu_capability()}: no AVX512-BF16 or AMX): a bf16 matmul "
        f"took {slow:.0f}x an fp32 one here, so each step will be slow; "
        f"parallel amp=dict(dtype='fp32') (or no amp) runs at fp32 speed",
        file=sys.stderr,
        flush=True,
    )


def _check_same_optimizer(saved: RunConfig, cfg: RunConfig) -> None:
    """Refuse to resume under an optimizer whose state is laid out otherwise than the one the
    checkpoint holds (``optim.clip_norm=0`` drops the clipping from the chain, say), naming
    what changed: its state cannot carry over."""
    like = random.as_meta(model_module(cfg.model).init(cfg.model, abstract=True))
    was = build_optimizer(saved.optim, saved.train.steps).init(like)
    now = build_optimizer(cfg.optim, cfg.train.steps).init(like)
    if tree.structure(was) == tree.structure(now):
        return
    changed = [
        f"optim.{f}={getattr(cfg.optim, f)!r} (was {getattr(saved.optim, f)!r})"
        for f in (f.name for f in dataclasses.fields(cfg.optim))
        if getattr(cfg.optim, f) != getattr(saved.optim, f)
    ]
    raise ValueError(
        f"the optimizer differs from the checkpoint's ({', '.join(changed) or 'its chain'}): its "
        f"state is laid out otherwise and cannot carry over; resume with the run's optimizer "
        f"settings, or start a new run from the checkpoint's weights"
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


# what goes to TensorBoard, under which tag (the record's other fields stay in the jsonl)
_TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "expert_imbalance": "train/expert_imbalance",
}


class _Log:
    """``metrics.jsonl`` as it grows: the records so far, each appended and flushed at once;
    with ``tensorboard``, each also written to event files in the same folder."""

    def __init__(
        self, path: Path, records: list[dict[str, Any]], t0: float, tensorboard: bool = False
    ) -> None:
        self.records = records
        self.t0 = t0
        # a resumed run's clock continues from its last record
        self.offset = records[-1]["elapsed"] if records else 0.0
        self.board: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "train.tensorboard=True writes TensorBoard event files and needs the "
                    "tensorboard package: pip install tensorboard"
                ) from None
            self.board = SummaryWriter(log_dir=str(path.parent))
        self.file = open(path, "a")  # noqa: SIM115 (closed by close())

    def elapsed(self) -> float:
        return round(self.offset + time.perf_counter() - self.t0, 3)

    def emit(self, record: dict[str, Any]) -> None:
        record["elapsed"] = self.elapsed()
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, tag in _TENSORBOARD_TAGS.items():
                if record.get(key) is not None:
                    self.board.add_scalar(tag, record[key], record["step"])
            self.board.flush()

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _interval_record(
    step: int, metrics: dict[str, Any], losses: list[torch.Tensor], tokens: int, seconds: float
) -> dict[str, Any]:
    record = {
        "step": step,
        "loss": float(torch.stack(losses).mean()),
        "lr": metrics["lr"],
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": round(len(losses) * tokens / seconds, 1),
    }
    counts = metrics.get("expert_counts")  # a mixture of experts: the last step's, per layer
    if counts is not None:
        record["expert_counts"] = counts.tolist()
        per_layer = counts.double()  # (the busiest expert over the mean, in the worst layer)
        record["expert_imbalance"] = float((per_layer.amax(1) / per_layer.mean(1)).max())
    return record


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
    pc = parallel.parse(cfg.parallel, cfg.model) if cfg.parallel else None
    if pc is not None:  # what the composition needs of the data, before the folder is made
        pc.check_seq_len(cfg.data.seq_len)
        pc.check_batch(cfg.data.batch_size)
        _warn_emulated_bf16(pc)
        usp = cfg.parallel.get("sequence") or {}
        u = pc.sequence_ulysses
        if u is not None and "ulysses" not in usp and os.environ.get("RANK", "0") == "0":
            print(
                f"colfunc: parallel['sequence']: mode='usp' without ulysses=: ulysses={u}, the "
                f"largest that divides size={pc.sequence_size} and each tensor-parallel rank's "
                f"heads (ring attention over the other {pc.sequence_size // u})",
                file=sys.stderr,
                flush=True,
            )
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
    params0 = None
    if cfg.init is not None:
        params0 = hf.load(cfg.init, model_impl=hf.impl_of(cfg.model))[1]
        if progress:
            print(f"colfunc: {hf.describe(cfg.model)}", file=sys.stderr, flush=True)
    if isinstance(state, ShardedRun):
        _check_same_optimizer(state.config, cfg)
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
    step_fn = make_step(cfg, mesh, pc)
    params0 = model.init(cfg.model, seed=tc.seed) if given is None else given
    if isinstance(state, ShardedRun):
        if mesh is not None and state.same_layout(cfg, pc):  # this rank's own file, no other
            state = state.local(step_fn, mesh, cfg, given)
        else:  # another layout: the slices of each file that hold this rank's pieces
            state = state.resharded(step_fn, mesh, cfg, given)
    elif state is not None:  # in the single-device layout, whatever the mesh was
        _check_resumable(state, plain_step(cfg).init(params0))
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
        return state if mesh is None else single_layout(state)

    log = (
        _Log(run_dir / METRICS, _open_run(run_dir, state), t_start, tc.tensorboard)
        if lead
        else None
    )
    state = step_fn.init(params0) if state is None else state
    n_params = sum(x.numel() for x in tree.tensors(params0))
    n_params_text = f"{n_params / 1e6:.2f}M parameters"
    lora = lora_config(cfg.lora)
    if lora is not None:  # how many train: the adapters' a [in, r] and b [r, out] per layer
        n_train = adapters.adapter_numel(lora, params0)
        n_params_text += f", {n_train / 1e6:.2f}M in rank-{lora.rank} adapters trained"
    where = (
        f"{torch.get_num_threads()} CPU threads"
        if mesh is None
        else f"mesh {mesh.shape} ({mesh.backend})"
    )
    if lead:
        print(
            f"colfunc: training {getattr(cfg.model, 'architecture', None) or type(cfg.model).__module__.rsplit('.', 1)[-1]} "
            f"({n_params_text}) {task.describe()} on {where} into {run_dir}/",
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
    saver = Saver(run_dir / CHECKPOINTS, cfg, step_fn, mesh, state.step or None)
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
                _check_finite(metrics["loss"], state.step, saver.last_saved)
                losses.append(metrics["loss"])
                bar.update(1)
                s = state.step
                stopped = _Signals.agreed(mesh)
                saver.settle(wait=False)
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
                    saver.save(state)
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
        saver.save(state)
        saver.finish()
    finally:
        signals.__exit__(None, None, None)
        saver.close()  # an error on its way out: let a write end, uncommitted
        bar.close()
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
