"""How transforms compose: one record of what was applied, built in one canonical order.

Every transform is a frozen, validated config (``ShardConfig``, ``ZeroConfig``, ...) whose
``build(step, composition) -> Step`` wraps the pieces of the step built so far. Applying a transform does not wrap the step handed in: it records the config in the
step's :class:`Composition` and builds the whole composition again from the plain step, in the
order of :data:`ORDER` (innermost first)::

    remat(amp(offload(zero(shard(pipeline(step))))))

So ``cf.zero(cf.shard(step, mesh), 2)`` and ``cf.shard(cf.zero(step, 2), mesh)`` are the same
step, and a builder knows, from typed fields of the composition, what the transforms around it
and beneath it will do. The data-parallel reduction is decided once, from the whole
composition, as one :class:`~colfunc.transforms.data_parallel.Reduction` (``reduction``): its
layer is applied right above ``zero``, and ``offload`` calls it on its host rows. Conflicts (a transform applied twice, an axis the mesh lacks) are refused here, when the
step is built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from colfunc.step import Step
from colfunc.transforms.data_parallel.buckets import BUCKET_BYTES
from colfunc.transforms.data_parallel.reducer import Reduction

if TYPE_CHECKING:
    from colfunc.sharding import Mesh
    from colfunc.transforms.amp import AmpConfig
    from colfunc.transforms.offload import OffloadConfig
    from colfunc.transforms.pipeline.transform import PipelineConfig
    from colfunc.transforms.remat import RematConfig
    from colfunc.transforms.shard import ShardConfig
    from colfunc.transforms.zero import ZeroConfig

__all__ = ["ORDER", "Composition", "apply_transform"]

# the canonical nesting, innermost first: pipeline replaces the whole backward pass, shard places
# what zero then cuts, offload moves what runs per layer, amp casts what zero gathers, remat
# checkpoints whatever runs per layer (outside offload's fetches, so a recomputation fetches again)
ORDER = ("pipeline", "shard", "zero", "offload", "amp", "remat")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Composition:
    """The transforms applied to a plain step, one typed config each (None: not applied)."""

    pipeline: PipelineConfig | None = None
    shard: ShardConfig | None = None
    zero: ZeroConfig | None = None
    offload: OffloadConfig | None = None
    amp: AmpConfig | None = None
    remat: RematConfig | None = None

    # --- what one transform reads of another ------------------------------------------------
    @property
    def mesh(self) -> Mesh | None:
        """The mesh ``shard`` bound (None without ``shard``: the current mesh is used)."""
        return self.shard.mesh if self.shard is not None else None

    @property
    def batch_axis(self) -> str | None:
        """The data-parallel axis over which ``shard`` splits the batch (None: not split)."""
        return self.shard.data_axis if self.shard is not None else None

    @property
    def bucket_bytes(self) -> int:
        """The size of the data-parallel gradient buckets."""
        return self.shard.bucket_bytes if self.shard is not None else BUCKET_BYTES

    @functools.cached_property
    def reduction(self) -> Reduction | None:
        """The data-parallel reduction, decided once from what ``shard``, ``zero``, ``offload``
        and the others were given (None: no data-parallel axis); see
        :mod:`colfunc.transforms.data_parallel`."""
        return Reduction.of(self)

    def applied(self) -> tuple[Any, ...]:
        """The configs applied, innermost first."""
        return tuple(c for c in (getattr(self, n) for n in ORDER) if c is not None)

    def check(self) -> None:
        """Refuse combinations that no order could carry out."""
        if self.offload is not None:
            # offload replaces the plain forward-backward pass with its own (fetches per layer,
            # gradients written home per layer); these transforms replace it too
            others = ["pipeline"] if self.pipeline is not None else []
            sh = self.shard
            if sh is not None and (sh.sequence_parallel or sh.tensor_mode != "1d"):
                others.append("shard with sequence parallelism or a 2D/2.5D/3D tensor mode")
            if others:
                raise ValueError(
                    f"offload: composing with {', '.join(others)} is not supported; offload "
                    f"composes with shard (data and 1D tensor parallel), zero (stages 0-3), amp, "
                    f"remat and optimizer wrappers (optim.accumulate)"
                )
        if self.zero is not None and self.mesh is not None:
            mesh = self.mesh
            if self.zero.axis not in mesh.axis_names:
                raise ValueError(
                    f"zero: axis {self.zero.axis!r} is not an axis of the mesh {mesh.shape}; "
                    f"pass axis= one of {mesh.axis_names}"
                )

    def build(self, base: Step) -> Step:
        """``base`` with every applied transform, in :data:`ORDER`."""
        step, red = base, self.reduction
        for name in ORDER:
            config = getattr(self, name)
            if config is not None:
                step = config.build(step, self)
            if name == "zero" and red is not None and not red.host:
                step = red.wrap(step)  # the data-parallel layer, above shard and zero
        overlap = red is not None and red.overlap_update
        return dataclasses.replace(step, base=base, composition=self, overlap_update=overlap)


def apply_transform(step: Step, name: str, config: Any) -> Step:
    """``step`` with the transform ``name`` (one of :data:`ORDER`) applied with ``config``:
    the composition rebuilt from the plain step in the canonical order."""
    if not isinstance(step, Step):
        raise TypeError(f"{name}: expected a Step (from cf.train_step), got {type(step).__name__}")
    comp = step.composition if step.composition is not None else Composition()
    if getattr(comp, name) is not None:
        raise ValueError(f"{name}: the step already has {name} applied; apply it once")
    comp = dataclasses.replace(comp, **{name: config})
    comp.check()
    return comp.build(step.base if step.base is not None else step)
