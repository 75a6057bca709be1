"""Loading a sharded checkpoint under another layout: each rank's partial reads against the old
way (the writing composition rebuilt in the loading process, the whole state gathered, then cut).

A GPT run is trained one step under ``--source`` (threads) and saved sharded; the checkpoint is
then loaded under ``--target`` both ways, interleaved ``--repeats`` times:

- ``partial``: every rank of the target finds its element runs (``reshard.element_runs``) and
  reads only the blocks that hold its pieces (``ShardedRun.resharded``);
- ``rebuild``: the source's ranks, as threads, each read their file, the composition gathers the
  whole state on rank 0 (``full_state``), and each target rank cuts its pieces from it
  (``place_state``).

Printed: the median wall time of each, their ratio, the bytes each target rank read against the
checkpoint's, and the peak memory of the largest tensor set one process held (the whole state
for ``rebuild``). Also the one-off cost of finding the runs at a run's first save.

    python benchmarks/reshard.py [--config small] [--source dp2-tp2-zero3] [--target pp2]
    colfunc bench reshard
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from colfunc import config, models, random, reshard, tree
from colfunc import train as trainer
from colfunc.sharding import launch

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2-tp2-zero3": {"data": 2, "tensor": 2, "zero": 3},
    "dp2-tp2-zero1": {"data": 2, "tensor": 2, "zero": 1},
    "pp2": {"pipeline": {"stages": 2, "microbatches": 2}},
    "tp2": {"tensor": 2},
    "dp2": {"data": 2},
    "zero3": {"data": 2, "zero": 3},
}


def run_config(corpus: Path, model: str, parallel: dict[str, Any]) -> config.RunConfig:
    size = models.gpt.Config.small() if model == "small" else models.gpt.Config.tiny()
    sets = {
        **{f"model.{f.name}": getattr(size, f.name) for f in dataclasses.fields(size)},
        "data.corpus": corpus,
        "data.seq_len": 64,
        "data.batch_size": 4,
        "data.val_fraction": 0.1,
        "train.steps": 1,
        "train.log_every": 1,
        "train.eval_every": 1,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
    }
    cfg = config.load(None, [f"{k}={v}" for k, v in sets.items() if v is not None])
    return dataclasses.replace(cfg, parallel=parallel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", choices=["tiny", "small"])
    parser.add_argument("--source", default="dp2-tp2-zero3", choices=sorted(LAYOUTS))
    parser.add_argument("--target", default="pp2", choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="colfunc-reshard-"))
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40)
    source_cfg = run_config(corpus, args.config, LAYOUTS[args.source])
    target_cfg = run_config(corpus, args.config, LAYOUTS[args.target])
    trainer.run(source_cfg, root / "run", progress=False)
    path = trainer.checkpoint_path(root / "run")
    assert path is not None
    total = sum(f.stat().st_size for f in path.glob("rank-*.safetensors"))
    target_pc = trainer.parallel.parse(target_cfg.parallel)
    source_pc = trainer.parallel.parse(source_cfg.parallel)

    def runs_cost(mesh: Any) -> float:  # the one-off cost at a run's first save
        step_fn = trainer.make_step(source_cfg, mesh, source_pc)
        model = trainer.model_module(source_cfg.model)
        described = model.init(source_cfg.model, abstract=True)
        opt_like = trainer.build_optimizer(source_cfg.optim, 1).init(random.as_meta(described))
        t0 = time.perf_counter()
        reshard.element_runs(step_fn, described, opt_like)
        return time.perf_counter() - t0

    def partial(mesh: Any) -> tuple[int, int]:
        handle, _ = trainer.load_run(root / "run", gather=False)
        step_fn = trainer.make_step(target_cfg, mesh, target_pc)
        state = handle.resharded(step_fn, mesh, target_cfg)
        own = sum(x.nbytes for x in tree.tensors(reshard.local_pieces(state)))
        return own, sum(handle.bytes_read[mesh.rank].values())

    def rebuild(mesh: Any, full: Any) -> int:
        step_fn = trainer.make_step(target_cfg, mesh, target_pc)
        state = step_fn.place_state(full)
        return sum(x.nbytes for x in tree.tensors(reshard.local_pieces(state)))

    cost = launch(runs_cost, mesh=source_pc.mesh_shape)
    times: dict[str, list[float]] = {"partial": [], "rebuild": []}
    read: list[tuple[int, int]] = []
    for i in range(args.repeats):
        for way in ("partial", "rebuild") if i % 2 == 0 else ("rebuild", "partial"):
            t0 = time.perf_counter()
            if way == "partial":
                read = launch(partial, mesh=target_pc.mesh_shape)
            else:
                handle, _ = trainer.load_run(root / "run", gather=False)
                handle.partial = False
                full = handle.full()
                launch(functools.partial(rebuild, full=full), mesh=target_pc.mesh_shape)
                whole = sum(x.nbytes for x in tree.tensors(full))
                del full
            times[way].append(time.perf_counter() - t0)
    p, r = statistics.median(times["partial"]), statistics.median(times["rebuild"])
    print(
        f"{args.config}: saved {args.source} ({len(list(path.glob('rank-*')))} files, "
        f"{total / 2**20:.1f} MiB), loaded as {args.target}, median of {args.repeats}"
    )
    print(
        "| way | load s | ratio | read per rank MiB | own pieces per rank MiB | one process holds |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    reads = ", ".join(f"{b / 2**20:.1f}" for _, b in read)
    owns = ", ".join(f"{o / 2**20:.1f}" for o, _ in read)
    print(f"| partial | {p:.2f} | {p / r:.2f} | {reads} | {owns} | its own pieces |")
    print(
        f"| rebuild | {r:.2f} | 1.00 | {total / 2**20:.1f} (all) | {owns} | {whole / 2**20:.1f} MiB |"
    )
    print(f"finding the runs at the first save: {max(cost):.2f} s per rank (largest)")


if __name__ == "__main__":
    main()
