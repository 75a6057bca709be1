"""The distributed core: meshes, launch, collectives by axis name, and sharded tensors.

It knows nothing about models or training.
"""

from colfunc.sharding import comm
from colfunc.sharding.errors import CollectiveMismatchError, CollectiveTimeoutError, RankFailedError
from colfunc.sharding.launch import launch, run_cli
from colfunc.sharding.ledger import Ledger, ledger, recording
from colfunc.sharding.mesh import Mesh, current_mesh

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Ledger",
    "Mesh",
    "RankFailedError",
    "comm",
    "current_mesh",
    "launch",
    "ledger",
    "recording",
    "run_cli",
]
