"""``colfunc serve``: the OpenAI-compatible server over a run or a Hugging Face folder.

With one rank (``--tp 1``) the engine runs in a process of its own
(:class:`colfunc.inference.process_loop.ProcessLoop`), built there from the folder by
:func:`build_engine`, so that the HTTP side and the engine do not share a GIL
(``--engine-in-thread`` keeps it on a thread of the server's process). With ``--tp N`` the ranks
are threads of the server's process: rank 0 runs the loop the server feeds, the others follow
it step by step.

With one rank, decoding steps compute on the CPUs less one (``--engine-threads``), leaving a
core to the HTTP side, and steps of many prompt tokens on all of them (``--prefill-threads``);
see :mod:`colfunc.inference.threads`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import queue
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from colfunc import engines, hf
from colfunc.inference import Engine
from colfunc.inference.engine import KVMemoryError
from colfunc.inference.server import EngineLoop, build_app, follow
from colfunc.inference.threads import StepThreads

__all__ = ["Served", "build_engine", "main"]


def _check(args: argparse.Namespace) -> None:
    if (args.run is None) == (args.hf is None):
        raise ValueError("give one of --run DIR or --hf DIR")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    least = {"max-waiting": (args.max_waiting, 0), "tp": (args.tp, 1)}
    for flag in ("engine-threads", "prefill-threads"):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            if args.tp != 1:
                raise ValueError(f"--{flag} applies to one rank (--tp 1), got --tp {args.tp}")
            least[flag] = (value, 1)
    for flag, (value, low) in {**least, "max-request-bytes": (args.max_request_bytes, 1)}.items():
        if value < low:
            raise ValueError(f"--{flag} must be >= {low}, got {value}")


@dataclasses.dataclass(frozen=True)
class Served:
    """What :func:`build_engine` takes from the command line (plain values: it is sent to the
    engine's process)."""

    run: str | None
    hf: str | None
    model_impl: str
    max_num_seqs: int
    kv_memory: str | None
    speculative: tuple[int, str | None, int | None]  # --speculative-ngram, -model, -tokens
    loras: dict[str, str]
    name: str
    threads: tuple[int | None, int | None] = (None, None)  # --engine-threads, --prefill-threads


def _served(args: argparse.Namespace) -> Served:
    spec = (args.speculative_ngram, args.speculative_model, args.num_speculative_tokens)
    engines.speculative(*spec, load=False)  # (a ValueError names a bad flag, before any load)
    folder = args.run if args.run is not None else args.hf
    return Served(
        run=args.run,
        hf=args.hf,
        model_impl=args.model_impl or "auto",
        max_num_seqs=args.max_num_seqs,
        kv_memory=args.kv_memory,
        speculative=spec,
        loras=engines.parse_loras(args.lora or [], args.tp),
        name=args.model_name or Path(folder).resolve().name,
        threads=(args.engine_threads, args.prefill_threads),
    )


def _loaded(served: Served) -> dict[str, Any]:
    if served.run is not None:
        loaded = engines.load_run(served.run)
    else:
        assert served.hf is not None  # (one of the two: checked first)
        loaded = engines.load_hf(served.hf, model_impl=served.model_impl)
    print(f"colfunc: {hf.describe(loaded['cfg'])}", file=sys.stderr, flush=True)
    return loaded


def _engine(served: Served, loaded: dict[str, Any], **extra: Any) -> Engine:
    kw: dict[str, Any] = {"max_num_seqs": served.max_num_seqs, **extra}
    if served.kv_memory is not None:
        kw["kv_memory"] = served.kv_memory
    if served.loras:
        kw["max_loras"] = len(served.loras)
    try:
        engine = Engine(**loaded, **kw, speculative=engines.speculative(*served.speculative))
    except KVMemoryError as e:  # named as the command line names it
        raise ValueError(e.message("--kv-memory")) from None
    return engine


def build_engine(served: Served) -> Engine:
    """The engine ``colfunc serve`` serves with one rank, from its command line's options: the
    folder read, the engine built, the adapters added (what the engine's own process runs)."""
    engine = _engine(served, _loaded(served), threads=StepThreads.serving(*served.threads))
    engines.add_loras(engine, served.loras, served.name)
    _warm()
    return engine


def _warm() -> None:
    """Build the C++ decode attention (once) now, not while the first request waits."""
    import torch

    from colfunc.kernels import cpu_attention

    if not torch.cuda.is_available():
        cpu_attention.extension()


def _ranks(served: Served, loaded: dict[str, Any], tp: int, max_waiting: int) -> Any:
    """``(loop, thread)``: ``tp`` ranks as threads, rank 0 running the loop the server feeds,
    the others following it step by step."""
    from colfunc.sharding import launch

    commands = [queue.SimpleQueue[Any]() for _ in range(tp - 1)]
    ready: dict[str, Any] = {}
    started = threading.Event()

    def rank(mesh: Any) -> None:
        try:
            engine = _engine(served, loaded, mesh=mesh)
        except BaseException as e:
            ready["error"] = e
            started.set()
            raise
        if mesh.rank == 0:
            ready["loop"] = EngineLoop(
                engine, max_waiting=max_waiting, followers=commands, thread=False
            )
            started.set()
            ready["loop"].run()
        else:
            follow(engine, commands[mesh.rank - 1])

    ranks = threading.Thread(
        target=launch, args=(rank, {"tp": tp}), kwargs={"timeout": 600.0}, daemon=True
    )
    ranks.start()
    started.wait()
    if "error" in ready:
        raise ready["error"]
    return ready["loop"], ranks


def main(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM or Ctrl-C."""
    import uvicorn

    from colfunc.inference.process_loop import ProcessLoop

    _check(args)
    served = _served(args)
    ranks: threading.Thread | None = None
    if args.tp == 1 and not args.engine_in_thread:
        loop: Any = ProcessLoop(
            functools.partial(build_engine, served), max_waiting=args.max_waiting
        )
    elif args.tp == 1:
        # read on this thread (ranks as threads importing transformers at once can trip over its
        # lazy modules)
        loop = EngineLoop(build_engine(served), max_waiting=args.max_waiting)
    else:
        loop, ranks = _ranks(served, _loaded(served), args.tp, args.max_waiting)
        _warm()
    app = build_app(loop, served.name, args.max_request_bytes)
    print(f"colfunc: serving {served.name!r} on http://{args.host}:{args.port}", flush=True)
    # On SIGTERM uvicorn stops accepting, waits for the requests in flight, shuts the app down,
    # and raises the signal again with the handler found before it: this one (exit status 0).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    loop.stop()
    if ranks is not None:  # the followers have been told to stop: let the ranks end cleanly
        ranks.join(timeout=60)
    return 0
