"""Checkpoints: a pytree of tensors in safetensors, its structure and the run config in JSON.

A checkpoint is a folder holding

``state.safetensors``
    every tensor leaf, keyed by its dotted path (``params.blocks.attn.wq``,
    ``opt_state.1.exp_avg.embed.tokens``), readable by any safetensors tool;
``meta.json``
    the tree's structure (dicts, lists, tuples, named tuples) with its non-tensor leaves (ints,
    floats, strings, bools, None) in place, and the config.

and, in ``meta.json``, a CRC-32 of every tensor's bytes, verified on load: a flipped bit is
an error naming the tensor, never a silent NaN. Files are written with the permissions the umask
gives (as any other file), so another user of a shared run folder can read them.

A training run keeps its checkpoints in a *store* (:func:`commit`, :func:`latest`): a folder of
step-numbered checkpoints (``step-00000100/``) and a ``latest`` file naming the newest. A commit
writes the new checkpoint under a temporary name (every file fsynced), renames it into place,
then replaces ``latest`` by a rename: each step is one atomic rename, so a crash or a SIGKILL at
any moment leaves the previous complete checkpoint loadable. Stale temporaries are removed by the
next commit; ``keep_last`` prunes the oldest. :class:`AsyncWriter` copies a state to host memory
and commits it in a background thread.

A parallel run's checkpoint is *sharded* (:func:`begin_sharded`, :func:`write_shard`,
:func:`finish_sharded`): each rank writes its own pieces as it holds them,
``rank-RRRRR.safetensors`` (its structure and checksums in the file's header; no gathering, and
no rank holds more than its own state), then rank 0 writes ``meta.json`` (the mesh, the files,
the run config) and commits the folder by the same one rename. :func:`colfunc.train.load_run`
lays a sharded checkpoint out for any other mesh or composition.

:func:`save` writes one checkpoint folder; an existing one there is replaced (its temporaries
removed by the next save, and :func:`load` recovers the old one if a crash came between the two
renames a replacement takes).

Example:
    >>> save("runs/demo/checkpoint", state, config=cfg)
    >>> state, cfg = load("runs/demo/checkpoint")
"""

from colfunc.checkpoint.checksums import checksum
from colfunc.checkpoint.files import (
    META,
    TENSORS,
    CheckpointError,
    load,
    save,
    shard_name,
    sharded_meta,
)
from colfunc.checkpoint.sharded import (
    RUNS,
    TENSOR,
    ShardReader,
    abandon_sharded,
    begin_sharded,
    finish_sharded,
    load_shard,
    write_shard,
)
from colfunc.checkpoint.store import (
    LATEST,
    AsyncWriter,
    commit,
    incomplete,
    latest,
    set_aside,
    steps,
)

__all__ = [
    "LATEST",
    "META",
    "RUNS",
    "TENSOR",
    "TENSORS",
    "AsyncWriter",
    "CheckpointError",
    "ShardReader",
    "abandon_sharded",
    "begin_sharded",
    "checksum",
    "commit",
    "finish_sharded",
    "incomplete",
    "latest",
    "load",
    "load_shard",
    "save",
    "set_aside",
    "shard_name",
    "sharded_meta",
    "steps",
    "write_shard",
]
