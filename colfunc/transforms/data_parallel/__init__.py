"""Data parallelism, owned in one place: the batch split, the loss mean, gradient buckets
(all-reduced, reduce-scattered, or reduced by the backward pass of a gather on use), ZeRO's
layout of chunks, and the overlap with the backward pass and with the update.

:class:`Reduction` (:mod:`.reducer`) is decided once per composition and applied as the step's
data-parallel layer; ``shard``, ``zero`` and ``offload`` call into it and reduce nothing of their
own. The pieces:

- :mod:`.buckets`: :class:`GradBuckets`, views of one flat gradient buffer per dtype, all-reduced
  as the backward pass hands each layer over (DDP's reducer), and :class:`PackedBuckets`;
- :mod:`.grad_layout`: the flat buffers' layout and their pool;
- :mod:`.scatter`: ZeRO 1-2's reduce-scatter buckets;
- :mod:`.chunks`: how ZeRO cuts a tensor into per-rank chunks, and the packed collectives;
- :mod:`.layout`: :class:`ZeroLayout`, the cut of every parameter;
- :mod:`.layer_gather`: ZeRO-3's per-layer gathers inside ``scan_layers``.
"""

from colfunc.transforms.data_parallel.layout import ZeroLayout
from colfunc.transforms.data_parallel.reducer import (
    LeafReduction,
    Reduction,
    reduce_leaves,
    split_batch,
)

__all__ = ["LeafReduction", "Reduction", "ZeroLayout", "reduce_leaves", "split_batch"]
