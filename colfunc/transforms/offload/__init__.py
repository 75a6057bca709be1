"""``offload``: heterogeneous memory, model states in chunks under a device budget (Gemini).

The parameters are cut into fixed-size chunks in layer order (:mod:`colfunc.memory.chunks`).
A *host-homed* chunk keeps its parameters (the fp32 masters), gradients and Adam moments in host
memory: :func:`colfunc.scan_layers` fetches a layer's chunks to the device just before the layer
runs, its backward pass fetches them again if they were evicted (saved-tensor hooks stand in for
the weights the backward pass keeps, as ZeRO-3's gathers do), its gradients go back to the host
as soon as the layer's backward pass ends, and the update runs there, by the C++ CPU Adam
(:func:`colfunc.ops.cpu_adamw_`). A *device-homed* chunk lives on the device for the whole run
and is updated there by the fused AdamW (:func:`colfunc.ops.adamw_`). The leaves outside the
stacked layers (group 0: embeddings, final norm) are fetched once, at the start of the step.
Under ``amp`` each fetched copy is cast to the compute dtype (device-homed masters too), so the
device holds compute-dtype weights and the fp32 masters stay where they live.

A mixture of experts' expert weights are chunked one expert at a time and fetched only when a
layer's tokens are routed to them, inside :func:`colfunc.ops.moe_ffn`
(:mod:`colfunc.transforms.offload.experts`; ``experts="layer"``: with the layer).

Policies:

``"device"``
    everything on the device: the in-memory step, with the account kept (the reference).
``"host"``
    every chunk host-homed, each layer streamed in and dropped after use (ZeRO-Offload).
``"static"``
    the first ``1 - offload_optim`` of the chunks (by bytes, in layer order) device-homed, and
    the parameter copies of the first ``1 - offload_params`` kept on the device for the whole
    step once fetched; the rest streamed.
``"auto"``
    the first step records which groups the step uses, in which order, and the non-model memory
    (activations, gradients in flight) the device needs between each use and the next
    (:class:`~colfunc.memory.placement.Trace`). From then on each fetch keeps the device within
    the budget by evicting the cached copies whose next use is farthest away, and fetches the
    next ``prefetch`` groups ahead when they fit; ``margin`` of the memory the warm-up left
    spare holds device-homed chunks, whose update then runs on the device.

On CUDA the host chunks are pinned, each copy to the device runs on a side stream (so a
prefetched layer arrives while the layers before it compute) and records an event, and the
compute stream waits for that event only when it first uses the chunk; the update waits for
the copies in flight before it writes the masters they read. Gradients go home synchronously.

On a machine without a GPU the CPU stands for the device: the same code runs, copies are copies
within one memory, and the account of device bytes is exact, so the budget can be checked: the
first step of each batch shape is measured by a dispatch mode that sees every allocation, and the
later ones, which allocate the same, are accounted from that trace and the pool's residency (on
CUDA the allocator's counters are read on every step).
Each step's metrics carry ``offload/device_peak_bytes`` (the device pool's peak, model states
included), ``offload/h2d_bytes`` and ``offload/d2h_bytes``.

Over data parallelism each rank offloads its own part of the model states:

- data-parallel ``shard`` (no tensor-parallel plan), or ``zero`` stage 0: each rank offloads its
  replica, steps on its rows of the batch (when ``shard`` splits it), and the gradients are
  averaged over the data-parallel axis in place, in host memory and in the device-homed
  mirrors, before the update;
- ``zero`` stages 1 and 2 (ZeRO-Offload): the parameters are streamed from each rank's replica
  as above (the whole parameters and gradients stay in its host memory), but the averaged
  gradients are reduce-scattered, so each rank keeps only its chunk of the Adam moments and
  updates (by the CPU Adam) only its chunk of the parameters; the new chunks are all-gathered
  into the replicas. Chunks cannot be device-homed here (their optimizer state is cut by rank):
  use ``margin=0`` and ``offload_optim=1``, or stage 3;
- ``zero`` stage 3 (Gemini over data parallelism): each rank's host holds only its ZeRO chunks
  of every parameter, offload chunks those, and a layer's fetched chunks are all-gathered on the
  device into the whole layer just before it runs (group 0 once per step); the gather's
  backward reduce-scatters the gradients, so each rank writes home only its chunks' gradients,
  and updates only them (device-homed chunks included). The backward pass keeps tokens instead
  of the gathered weights, and fetches and gathers a layer again when it needs it.

Over tensor-parallel ``shard`` (a 1D plan, with or without the above) each rank offloads its
local pieces: a fetched piece is wrapped back as the ShardedTensor it is a piece of, so the
propagation rules run as in memory, and its gradient comes home in the parameter's placement
(a Partial sum reduced first); the gradient norm adds the pieces' squares over the axes that
split them. Sequence parallelism and the 2D/2.5D/3D modes are refused.

The state is updated in place (an offloaded step donates its state, see
:func:`colfunc.train_step`): the state passed in must not be used again. The host rows of
device-homed chunks are stale while they live on the device; :func:`colfunc.full_state` writes
them back first.
"""

from colfunc.transforms.offload.state import OffloadState
from colfunc.transforms.offload.transform import EXPERTS, POLICIES, OffloadConfig, offload

__all__ = ["EXPERTS", "POLICIES", "OffloadConfig", "OffloadState", "offload"]
