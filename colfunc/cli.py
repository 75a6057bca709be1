"""The ``colfunc`` command: ``train``, ``generate`` and ``bench``.

Bad input (a config mistake, a missing or corrupt checkpoint, an empty corpus, a run folder that
exists already) ends with one line on stderr, ``colfunc: error: ...``, and exit status 2.

Examples:
    colfunc train                                   # the tiny GPT on the standard library
    colfunc train examples/configs/llama_tiny.py --set train.steps=200 --set optim.lr=1e-3
    colfunc train --resume runs/gpt_tiny-20250101-120000 --set train.steps=2000
    colfunc generate --run runs/gpt_tiny-20250101-120000 --prompt "def " --max-new-tokens 200
    colfunc bench single_device
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"colfunc: error: {message} (see {self.prog} --help)\n")


def _checkpoint_dir(run: str) -> Path:
    from colfunc import checkpoint, train

    path = Path(run)
    nested = path / train.CHECKPOINT
    return nested if (nested / checkpoint.META).exists() else path


def _cmd_train(args: argparse.Namespace) -> int:
    from colfunc import checkpoint, config, train

    if args.resume is None:
        cfg = config.load(args.config, args.set)
        if args.name is not None:
            cfg = config.override(cfg, [f"train.name={args.name}"])
        stem = Path(args.config).stem if args.config else "gpt_tiny"
        name = cfg.train.name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.train.out_dir) / name
        if run_dir.exists():  # fail before loading the corpus, not after
            raise ValueError(
                f"run folder {str(run_dir)!r} already exists; pick another name (--name) or "
                f"continue it with --resume {run_dir}"
            )
        train.run(cfg, run_dir, progress=not args.no_progress)
        return 0
    if args.config is not None or args.name is not None:
        raise ValueError("--resume continues a run with its own config; drop CONFIG and --name")
    changed_model = [s for s in args.set if s.strip().startswith("model.")]
    if changed_model:
        raise ValueError(f"--set {changed_model[0]}: the model cannot change when resuming")
    run_dir = Path(args.resume)
    state, saved = checkpoint.load(run_dir / train.CHECKPOINT)
    if not isinstance(saved, config.RunConfig):
        raise ValueError(f"{str(run_dir)!r} is not a colfunc training run (no run config)")
    cfg = config.override(saved, args.set)
    if state.step >= cfg.train.steps:
        raise ValueError(
            f"{str(run_dir)!r} is already at step {state.step} of train.steps="
            f"{cfg.train.steps}; raise it with --set train.steps=N to train longer"
        )
    train.run(cfg, run_dir, state=state, progress=not args.no_progress)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from colfunc import checkpoint, config, data
    from colfunc.generate import sample

    path = _checkpoint_dir(args.run)
    state, cfg = checkpoint.load(path)
    if not isinstance(cfg, config.RunConfig):
        raise ValueError(f"{str(path)!r} holds no run config; it was not written by colfunc train")
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    model = config.model_module(cfg.model)
    ids = sample(
        # a byte-level run: logits past the 256 byte values are never sampled
        lambda p, x, c: model.apply(p, x, c)[..., : data.VOCAB_SIZE],
        state.params,
        cfg.model,
        data.encode(args.prompt),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(data.decode(ids), flush=True)
    return 0


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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="colfunc", description=__doc__.split("\n\n")[0])
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
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("--run", required=True, help="a run folder (or its checkpoint folder)")
    p.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench", help="run benchmarks/NAME.py with the given arguments")
    p.add_argument("name")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``colfunc`` command with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already reported in one line
        return e.code if isinstance(e.code, int) else 0
    try:
        status: Any = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())  # one line, whatever the message
        print(f"colfunc: error: {message}", file=sys.stderr)
        return 2
    return int(status)
