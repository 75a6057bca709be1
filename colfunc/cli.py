"""The ``colfunc`` command: ``train``, ``generate``, ``sample``, ``export``, ``serve``, ``run`` and
``bench``.

Bad input (a config mistake, a missing or corrupt checkpoint, an empty corpus, a run folder that
exists already) ends with one line on stderr, ``colfunc: error: ...``, and exit status 2.

Examples:
    colfunc train                                   # the tiny GPT on the standard library
    colfunc train examples/configs/llama_tiny.py --set train.steps=200 --set optim.lr=1e-3
    colfunc train --resume runs/gpt_tiny-20250101-120000 --set train.steps=2000
    colfunc generate --run runs/gpt_tiny-20250101-120000 --prompt "def " --max-new-tokens 200
    colfunc train examples/configs/dit_video_tiny.py  # a video DiT; writes samples.gif
    colfunc sample --run runs/dit_video_tiny-20250101-120000 --prompt "red square moving right"
    colfunc export --run runs/gpt_tiny-20250101-120000 --hf exported/  # transformers can load it
    colfunc serve --run runs/gpt_tiny-20250101-120000 --port 8000   # OpenAI API on 127.0.0.1
    colfunc bench single_device
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"colfunc: error: {message} (see {self.prog} --help)\n")


_LOADAVG = "/proc/loadavg"  # Linux: its fourth field counts the tasks runnable now


def _busy_cores() -> int:
    """How many cores other work holds now: the runnable tasks of ``/proc/loadavg`` (this one
    not counted), the median of five looks 10 ms apart; elsewhere the 1-minute load average.

    The load average lags by minutes: right after another job ends it still counts that job,
    and a run then took one thread for a machine that had two idle.
    """
    try:
        looks = []
        for k in range(5):
            if k:
                time.sleep(0.01)
            with open(_LOADAVG) as f:
                looks.append(int(f.read().split()[3].split("/")[0]) - 1)
        return max(0, sorted(looks)[2])
    except (OSError, ValueError, IndexError):
        return round(os.getloadavg()[0])


@contextlib.contextmanager
def _threads(requested: int | None) -> Iterator[None]:
    """Use ``requested`` intra-op threads, or by default one per core that is not busy.

    OpenMP threads meet at a barrier in every parallel op, so one thread that shares its core with
    another process stalls the rest: on 2 cores with one busy, 2 threads trained 7x slower than 1.
    :func:`_busy_cores` says how many cores other work holds.
    """
    import torch

    before = torch.get_num_threads()
    if requested is not None and requested < 1:
        raise ValueError(f"--threads must be >= 1, got {requested}")
    if requested is None:
        idle = (os.cpu_count() or before) - _busy_cores()
        requested = min(before, max(1, idle))
    torch.set_num_threads(requested)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cmd_train(args: argparse.Namespace) -> int:
    from colfunc import config, train

    if args.resume is None:
        cfg = config.load(args.config, args.set)
        if args.name is not None:
            cfg = config.override(cfg, [f"train.name={args.name}"])
        stem = Path(args.config).stem if args.config else "gpt_tiny"
        # under torchrun every rank must pick the same name: colfunc run's start time (one
        # node), else the launch's id
        stamp = (
            os.environ.get("COLFUNC_RUN_STAMP")
            or os.environ.get("TORCHELASTIC_RUN_ID")
            or time.strftime("%Y%m%d-%H%M%S")
        )
        name = cfg.train.name or f"{stem}-{stamp}"
        run_dir = Path(cfg.train.out_dir) / name
        made: list[Path] = []  # what _claim made, removed again if the run never starts
        if not cfg.train.name and "TORCHELASTIC_RUN_ID" not in os.environ:
            run_dir = _claim(run_dir, made)  # two runs started in the same second: two folders
        state = None
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # torchrun restarted the group after a rank died: go on from the last checkpoint
            if train.checkpoint_path(run_dir) is not None:
                state, cfg = train.load_run(run_dir, gather=False)
            print(
                "colfunc: restarted by torchrun; "
                + (f"resuming from step {state.step}" if state else "starting again"),
                file=sys.stderr,
                flush=True,
            )
        try:
            with _threads(args.threads):
                train.run(cfg, run_dir, state=state, progress=not args.no_progress, restart=True)
        except BaseException:
            for path in made:  # (only while still empty: a run that started keeps its folder)
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return 0
    if args.config is not None or args.name is not None:
        raise ValueError("--resume continues a run with its own config; drop CONFIG and --name")
    changed_model = [s for s in args.set if s.strip().startswith("model.")]
    if changed_model:
        raise ValueError(f"--set {changed_model[0]}: the model cannot change when resuming")
    run_dir = _resumed_run(Path(args.resume))
    state, saved = train.load_run(args.resume, gather=False)  # each rank its own shard
    _set_aside_incomplete(run_dir, state.step)
    cfg = config.override(saved, args.set)
    if state.step >= cfg.train.steps:
        raise ValueError(
            f"{str(run_dir)!r} is already at step {state.step} of train.steps="
            f"{cfg.train.steps}; raise it with --set train.steps=N to train longer"
        )
    with _threads(args.threads):
        train.run(cfg, run_dir, state=state, progress=not args.no_progress)
    return 0


def _set_aside_incomplete(run_dir: Path, step: int) -> None:
    """Say which checkpoint a resume uses when a newer one is incomplete, and move that one
    aside (kept as ``.broken-...``), so that the run's next save of its step succeeds."""
    from colfunc import checkpoint, train

    for folder in checkpoint.incomplete(run_dir / train.CHECKPOINTS):
        aside = checkpoint.set_aside(folder)
        print(
            f"colfunc: resuming from step {step}: the newer {folder.name} is incomplete (no "
            f"{checkpoint.META}: a save cut short) and was moved aside to {aside}",
            file=sys.stderr,
            flush=True,
        )


def _resumed_run(path: Path) -> Path:
    """The run folder ``--resume PATH`` continues: ``PATH`` itself, or, for a checkpoint folder
    (as ``generate --run`` takes), the run it belongs to when it is that run's latest (said on
    stderr); an older checkpoint of a run, or one outside any run, is refused."""
    from colfunc import checkpoint, train

    if not (path / checkpoint.META).is_file():
        return path  # a run folder (load_run says what is wrong with it otherwise)
    store = path.parent
    run = store.parent if store.name == train.CHECKPOINTS else store  # (old runs: run/checkpoint)
    latest = train.checkpoint_path(run) if (run / train.METRICS).is_file() else None
    if latest is None:
        raise ValueError(
            f"--resume {path}: a checkpoint folder outside a run folder; resume a run folder "
            f"(runs/NAME), or start a new run from the checkpoint's weights"
        )
    if latest.resolve() != path.resolve():
        raise ValueError(
            f"--resume {path}: an older checkpoint of run {str(run)!r}, whose latest is "
            f"{latest.name}; resume the run (--resume {run}), which continues from its latest"
        )
    print(f"colfunc: resuming run {run} from its checkpoint {path.name}", file=sys.stderr)
    return run


def _claim(run_dir: Path, made: list[Path]) -> Path:
    """Make ``run_dir`` (or ``run_dir-2``, ``-3``, ... when taken) as a new empty folder, by
    ``mkdir``, which exactly one process wins; what it made goes to ``made``, deepest first."""
    missing = [p for p in [run_dir.parent, *run_dir.parent.parents] if not p.exists()]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 1000):
        path = run_dir if k == 1 else run_dir.with_name(f"{run_dir.name}-{k}")
        try:
            path.mkdir()
            made[:] = [path, *missing]
            return path
        except FileExistsError:
            continue
    raise ValueError(f"{str(run_dir)!r}: 999 runs of that name exist; pass --name")


def _cmd_generate(args: argparse.Namespace) -> int:
    from colfunc import tasks, train
    from colfunc.generate import generate

    state, cfg = train.load_run(args.run)
    tasks.check_language_run(cfg, args.run, "generate")
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    out = generate(
        cfg,
        state.params,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(out.text, flush=True)
    if out.new_tokens < args.max_new_tokens:  # the context ended it: say so, not a silent cut
        print(
            f"colfunc: the model's context of {cfg.model.max_seq_len} tokens ended generation "
            f"after {out.new_tokens} new tokens (of {args.max_new_tokens} asked)",
            file=sys.stderr,
            flush=True,
        )
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from colfunc import tasks, train, video_sample

    state, cfg = train.load_run(args.run)
    if not tasks.is_video_model(cfg.model):
        raise ValueError(
            f"--run {args.run}: colfunc sample draws videos from a DiT run; this run trains "
            f"{type(cfg.model).__module__.rsplit('.', 1)[-1]} (use colfunc generate)"
        )
    if args.num < 1 or args.steps < 1:
        raise ValueError("--num and --steps must be at least 1")
    prompts = [args.prompt] * args.num
    clips = video_sample.sample(
        cfg.model, state.params, prompts, seed=args.seed, steps=args.steps, guidance=args.guidance
    )
    out = (
        Path(args.out)
        if args.out
        else Path(args.run) / tasks.SAMPLES.replace(".gif", "-prompt.gif")
    )
    video_sample.write_gif(clips, out, labels=prompts)
    print(f"colfunc: wrote {args.num} clips of {args.prompt!r} to {out}", flush=True)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from colfunc import adapters, config, hf, tasks, train

    state, cfg = train.load_run(args.run)
    tasks.check_language_run(cfg, args.run, "export")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(
            "colfunc export writes a transformers folder and needs transformers: "
            "pip install transformers"
        ) from None
    lora = config.lora_config(cfg.lora)
    if (args.hf is None) == (args.peft is None):
        raise ValueError("give one of --hf OUT (the whole model) or --peft OUT (the adapters)")
    if args.peft is not None:
        if lora is None:
            raise ValueError(f"--peft: the run {args.run} trains no adapters (no lora section)")
        out = adapters.save_adapter(args.peft, cfg.model, state.params, lora, base=cfg.init)
        print(f"colfunc: wrote the peft adapter {out}/ (step {state.step})", flush=True)
        return 0
    if lora is not None and not args.merge:
        raise ValueError(
            f"--hf: the run {args.run} trains adapters of a frozen base; add --merge to write "
            "the base with them merged in, or write the adapters alone with --peft OUT"
        )
    byte_level = not (cfg.data.tokenizer and cfg.data.tokenizer.startswith("hf:"))
    tok = "bytes" if byte_level else cfg.data.tokenizer
    params = train.model_params(cfg, state.params)
    out = hf.save(args.hf, cfg.model, params, dtype=args.dtype, tokenizer=tok)
    note = " with its byte-level tokenizer (token id = byte value)" if byte_level else ""
    merged = " (adapters merged)" if lora is not None else ""
    print(f"colfunc: wrote {out}/ (step {state.step}){merged}{note}", flush=True)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from colfunc import serve

    return serve.main(args)


def _benchmark_dirs() -> list[Path]:
    here = Path.cwd() / "benchmarks"
    repo = Path(__file__).resolve().parents[1] / "benchmarks"
    return [d for d in dict.fromkeys([here, repo]) if d.is_dir()]


def _cmd_bench(args: argparse.Namespace) -> int:
    dirs = _benchmark_dirs()
    scripts = [d / f"{args.name}.py" for d in dirs if (d / f"{args.name}.py").is_file()]
    if not scripts:
        names = sorted({p.stem for d in dirs for p in d.glob("*.py") if p.stem[0] != "_"})
        where = " or ".join(str(d) for d in dirs) or "benchmarks/ (none here or in the repository)"
        raise ValueError(
            f"unknown benchmark {args.name!r} in {where}; available: {', '.join(names) or 'none'}"
        )
    script = scripts[0]
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    # as `python benchmarks/NAME.py args`: its own argv, and its folder importable
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the script's own sys.exit(status)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from colfunc.sharding import run_cli

    if args.target == "train":  # every rank runs `python -m colfunc train ...`
        script, rest = "-m", ["colfunc", "train", *args.args]
    elif args.target.endswith(".py"):
        if not Path(args.target).is_file():
            raise ValueError(f"colfunc run: no such script {args.target!r}")
        script, rest = args.target, list(args.args)
    else:
        raise ValueError(
            f"colfunc run: {args.target!r} is neither a .py script nor a colfunc command (train)"
        )
    return run_cli(
        args.n,
        script,
        rest,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
    )


def _version() -> str:
    """The installed distribution's version."""
    from importlib import metadata

    try:
        return metadata.version("colfunc")
    except metadata.PackageNotFoundError:
        return "(not installed: run pip install -e . in the repository)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="colfunc", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"colfunc {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a model from a config file (default: tiny GPT)")
    p.add_argument("config", nargs="?", help="a Python config file (default: the built-in one)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a config field, e.g. --set train.steps=100 (repeatable)",
    )
    p.add_argument("--name", help="the run's folder name under train.out_dir")
    p.add_argument("--resume", metavar="RUN", help="continue the run in this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads", type=int, help="CPU threads (default: one per core not busy elsewhere)"
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("--run", required=True, help="a run folder (or its checkpoint folder)")
    p.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely (0: all)")
    p.add_argument(
        "--seed", type=int, default=0, help="the sampling seed: the same seed, the same text"
    )
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("sample", help="sample video clips from a trained DiT run")
    p.add_argument("--run", required=True, help="the run folder (colfunc train's output)")
    p.add_argument("--prompt", required=True, help="a caption, e.g. 'red square moving right'")
    p.add_argument("--num", type=int, default=4, help="clips to sample (default 4)")
    p.add_argument("--steps", type=int, default=30, help="Euler steps (default 30)")
    p.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance (4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the GIF to write (default RUN/samples-prompt.gif)")
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser("export", help="write a trained run as a Hugging Face model folder")
    p.add_argument("--run", required=True, help="a run folder (or its checkpoint folder)")
    p.add_argument("--hf", metavar="OUT", help="the model folder to write (new or empty)")
    p.add_argument(
        "--peft", metavar="OUT", help="a lora run's adapters: a peft adapter folder to write"
    )
    p.add_argument(
        "--merge", action="store_true", help="with --hf: a lora run's adapters merged in"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="cast the weights (default: as trained)",
    )
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serve", help="serve a run or a Hugging Face folder over the OpenAI API")
    p.add_argument("--run", help="a run folder (or its checkpoint folder)")
    p.add_argument("--hf", help="a Hugging Face model folder (save_pretrained layout)")
    p.add_argument(
        "--model-impl", choices=("auto", "native", "hf"), help="native family or own module"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--model-name", help="the model's name in the API (default: the folder's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (256)")
    p.add_argument("--kv-memory", help="KV cache size, e.g. 1GiB (default: fit, at most 2GiB)")
    p.add_argument("--speculative-ngram", type=int, default=0, help="prompt-lookup drafts a step")
    p.add_argument("--speculative-model", metavar="FOLDER", help="a draft model's HF folder")
    p.add_argument("--num-speculative-tokens", type=int, help="the draft model's drafts a step")
    p.add_argument("--max-waiting", type=int, default=256, help="queue before 503 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="413 past it (4 MiB)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, threads (default: 1)")
    p.add_argument("--engine-in-thread", action="store_true", help="not in its own process")
    p.add_argument("--engine-threads", type=int, help="decoding threads (default: CPUs less 1)")
    p.add_argument("--prefill-threads", type=int, help="prompt steps' threads (default: CPUs)")
    p.add_argument(
        "--lora",
        action="append",
        metavar="NAME=FOLDER",
        help="also serve a peft LoRA adapter as the model NAME (repeatable)",
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "run",
        help="run a script, or a colfunc command such as train, as N ranks under torchrun",
    )
    p.add_argument(
        "-n", "--nproc-per-node", dest="n", type=int, required=True, help="ranks per node"
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="machines in the job (default 1); run this on each"
    )
    p.add_argument(
        "--node-rank", type=int, default=0, help="this machine's index, 0 .. nnodes-1 (default 0)"
    )
    p.add_argument(
        "--master-addr", help="address of the machine with node rank 0 (needed with --nnodes > 1)"
    )
    p.add_argument(
        "--master-port", type=int, help="a free port on that machine (needed with --nnodes > 1)"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the group this many times after a rank dies (train resumes from the "
        "latest checkpoint)",
    )
    p.add_argument("target", help="a script.py, or a colfunc command (train)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_run)

    names = sorted({f.stem for d in _benchmark_dirs() for f in d.glob("*.py") if f.stem[0] != "_"})
    p = sub.add_parser(
        "bench",
        help="run benchmarks/NAME.py with the given arguments",
        epilog=f"benchmarks: {', '.join(names)}" if names else "no benchmarks/ folder found",
    )
    p.add_argument("name")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``colfunc`` command with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    from colfunc.sharding import CollectiveTimeoutError, PeerLostError, RankFailedError

    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already reported in one line
        return e.code if isinstance(e.code, int) else 0
    try:
        status: Any = args.func(args)
    except KeyboardInterrupt as e:  # 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM
        return 128 + getattr(e, "signum", 2)
    except (ValueError, OSError, RankFailedError, PeerLostError, CollectiveTimeoutError) as e:
        if isinstance(e, RankFailedError):  # a parallel run: report the rank's own error
            if not isinstance(
                e.__cause__, ValueError | OSError | PeerLostError | CollectiveTimeoutError
            ):
                raise
            e = e.__cause__
        message = " ".join(str(e).split())  # one line, whatever the message
        print(f"colfunc: error: {message}", file=sys.stderr)
        # a lost peer or a hung collective is a fault, not bad input
        return 1 if isinstance(e, PeerLostError | CollectiveTimeoutError) else 2
    return int(status)
