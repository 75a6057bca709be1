"""The distributed core: meshes, launch, collectives by axis name, and sharded tensors.

It knows nothing about models or training.
"""

from colfunc.sharding import comm
from colfunc.sharding.dispatch import fallback_counts, reset_fallback_counts, strict
from colfunc.sharding.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    RankFailedError,
)
from colfunc.sharding.launch import launch, run_cli
from colfunc.sharding.ledger import Ledger, ledger, recording
from colfunc.sharding.mesh import Mesh, current_mesh
from colfunc.sharding.placement import Partial, Replicate, Shard, placements_from_spec
from colfunc.sharding.shard_map import shard_map
from colfunc.sharding.tensor import ShardedTensor, distribute, from_local

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Ledger",
    "Mesh",
    "Partial",
    "PeerLostError",
    "RankFailedError",
    "Replicate",
    "Shard",
    "ShardedTensor",
    "comm",
    "current_mesh",
    "distribute",
    "fallback_counts",
    "from_local",
    "launch",
    "ledger",
    "placements_from_spec",
    "recording",
    "reset_fallback_counts",
    "run_cli",
    "shard_map",
    "strict",
]
