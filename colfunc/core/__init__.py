"""The one context stack, and the primitives that transforms intercept through it.

Everything ambient in colfunc lives on a thread-local stack of *frames* entered with ``with``: the
current mesh, the active transforms. Model code never reads it; it only calls the primitives below,
and a transform that wants to change how they run pushes a frame for the duration of a call.

``scan_layers`` is the hook point for pipeline (run only this stage's layers), remat (checkpoint
each layer), ZeRO-3 (gather each layer's parameters on use), offload (fetch each layer's chunks
from host memory) and sequence parallelism (split the
carry's sequence dim between layers): a :class:`ScanInterceptor` frame defines
``scan_layers(block, carry, blocks, xs, inner)``, sees the call first and may delegate to
``inner``, the next frame's version (finally the plain loop).

Every frame, who pushes it, who reads it, and when it is read (*call*: while a step runs; no
frame is read when a step is built, since transforms learn of each other through
:class:`~colfunc.transforms.composition.Composition`, not the stack):

===================== ============================================ ============================================ =====
frame                 pushed by                                    read by                                      when
===================== ============================================ ============================================ =====
``Mesh``              ``launch`` (each rank's thread or process)   ``current_mesh``, amp's overflow check,      call
                                                                   zero and pipeline without ``shard``
``LossScale``         ``amp``'s forward-backward                   :func:`loss_scale`: the step's               call
                                                                   forward-backward, the pipeline runner
``WidenGrads``        ``amp``'s forward-backward                   gradient buckets (reduce in the masters'     call
                                                                   dtype)
``LayerGrads``        ``shard`` and ``zero`` 0-2 forward-backward  the step's forward-backward (``track``),     call
                      (their gradient buckets)                     :func:`scan_layers` (take each layer's
                                                                   gradients during the backward pass),
                                                                   :func:`loss_scale` (its ``scale``)
``StepRun``           ``Step.__call__`` (around its pieces)        ``shard`` and ``zero`` 0 forward-backward    call
                                                                   (hand gradients in flight), the step's
                                                                   update (update each part as it arrives)
``NormReduction``     ``shard`` (local update), ``zero`` 1-3       ``optim.clip_by_global_norm``, the step's    call
                      update, ``pipeline`` update                  gradient norm; ``pipeline`` nests it
``SplitBackward``     ``pipeline`` with ``"zero_bubble"``          remat (full checkpoints), ZeRO-3 gathers     call
``_KnownNorm``        the step's update                            ``clip_by_global_norm`` (reuse the norm)     call
``_Remat``            ``remat``'s forward-backward                 :func:`scan_layers` (an interceptor)         call
``LayerGather``       ``zero`` stage 3 forward(-backward)          :func:`scan_layers` (an interceptor)         call
``_SequenceParallel`` ``shard(sequence_parallel=True)``            :func:`scan_layers` (an interceptor)         call
``LongSequence``      ``shard(sequence_parallel="ulysses"`` and    :func:`scan_layers`, ``ops.attention``       call
                      the other sequence-axis modes)               (an ``AttentionInterceptor``),
                                                                   :func:`positions`
``GridLinear``        ``shard(tensor_mode="2d"`` and ``"2.5d"``,     ``nn.linear`` (a ``LinearInterceptor``:      call
                      ``"3d"``)                                    the mode's matmul on the grid)
``Streaming``         ``offload``'s forward(-backward)             :func:`scan_layers` (an interceptor: fetch   call
                                                                   each layer's chunks)
``DryRun``            :func:`colfunc.memory.predict`               ``offload`` (its state, pool and update:     call
                                                                   meta tensors, no kernels)
``Sown``              ``Step.__call__`` (around its pieces)        :func:`sow` (model code: expert counts);     call
                                                                   ``shard`` and the data-parallel layer make
                                                                   each value whole and sum it over the batch
``Trace``             the user, around a step                      the pipeline runner (records its actions)    call
===================== ============================================ ============================================ =====
"""

from colfunc.core.frames import (
    AttentionInterceptor,
    DryRun,
    GradArrival,
    LayerGrads,
    LinearInterceptor,
    LossScale,
    NormReduction,
    PositionsInterceptor,
    ScanInterceptor,
    Sown,
    SplitBackward,
    SplitSequence,
    StepRun,
    WidenGrads,
    attention_frames,
    linear_frames,
    loss_scale,
    positions,
    sequence_split,
    sow,
)
from colfunc.core.partition import P, Plan
from colfunc.core.scan import Layered, ScanBlock, layered, num_layers, scan_layers
from colfunc.core.stack import context, frames, innermost

__all__ = [
    "AttentionInterceptor",
    "DryRun",
    "GradArrival",
    "LayerGrads",
    "Layered",
    "LinearInterceptor",
    "LossScale",
    "NormReduction",
    "P",
    "Plan",
    "PositionsInterceptor",
    "ScanBlock",
    "ScanInterceptor",
    "Sown",
    "SplitBackward",
    "SplitSequence",
    "StepRun",
    "WidenGrads",
    "attention_frames",
    "context",
    "frames",
    "innermost",
    "layered",
    "linear_frames",
    "loss_scale",
    "num_layers",
    "positions",
    "scan_layers",
    "sequence_split",
    "sow",
]
