"""The ``parallel`` section of a config file: a mesh and the transforms that compose the step.

::

    parallel = dict(
        data=2,                                        # data-parallel ranks ("dp")
        expert=2,                                      # experts split over "ep" (a mixture of
                                                       # experts; "ep" splits the batch too)
        tensor=dict(size=2, sequence_parallel=True),   # or tensor=2 ("tp", the model's tp_plan);
                                                       # dict(mode="2d", size=4), "2.5d" with
                                                       # depth=, "3d" (colfunc.transforms.grid)
        sequence=dict(mode="zigzag", size=4),          # long contexts: "ulysses", "ring",
                                                       # "zigzag" ("sp"), "usp" with ulysses=U
        pipeline=dict(stages=2, microbatches=8, schedule="1f1b"),  # "pp"; pipeline=2 is
                                                       # ColossalAI's: 2 stages, 2 microbatches
        zero=dict(stage=3, prefetch=1),                # or zero=2; prefetch: layers gathered ahead
        amp=dict(dtype="bf16"),                        # or amp="bf16"; loss_scale="dynamic" for fp16
        remat="full",                                  # or "save_matmuls", "none"
        offload=dict(policy="auto", device_budget="2GiB", margin=0.8),  # see cf.offload
        backend="threads",                             # "threads" or "gloo"; "env" under torchrun
        timeout=600,                                   # s a collective waits before it fails
    )

A collective that waits longer than ``timeout`` for its group fails with an error naming the rank
and the collective (:class:`~colfunc.sharding.CollectiveTimeoutError`), so a hang ends. With
``COLFUNC_DEBUG_COLLECTIVES=1`` in the environment, every rank of a gloo or NCCL group first
checks that all call the same collective on the same axis with the same shape and dtype, and all
raise :class:`~colfunc.sharding.CollectiveMismatchError` naming each rank's call if not (the
threads backend always checks).

``sequence`` splits each sequence over an axis of its own (see
:mod:`colfunc.transforms.sequence`): ``mode`` is ``"ulysses"``, ``"ring"`` or ``"zigzag"`` over
``sp`` of ``size`` ranks, or ``"usp"`` over ``sp_ring`` x ``sp_ulysses`` (``ulysses=U`` of the
``size``); ``mode="megatron"`` is the same as ``tensor=dict(sequence_parallel=True)``. The mesh's
axes are ``dp, pp, sp (sp_ring, sp_ulysses), tp``.

``tensor=dict(mode=MODE, size=N)`` chooses the tensor-parallel layout: ``"1d"`` (Megatron-LM,
the default, over ``tp``), ``"2d"`` (N = q², over ``tp_row`` x ``tp_col``), ``"2.5d"`` (N = depth ·
q², ``depth=`` d, over ``tp_dep`` x ``tp_row`` x ``tp_col``) or ``"3d"`` (N = q³, over ``tp_z`` x
``tp_y`` x ``tp_x``), with the model's plan for the mode (``model.tp_plans[MODE]``). ColossalAI's
``dict(mode='2.5d', depth=1, size=4)`` reads the same.

``expert=N`` splits a mixture of experts' experts over an ``ep`` axis of ``N`` ranks
(``shard(expert_axis="ep")``); each of them routes a share of the batch of its own, so the global
batch splits over ``data * expert`` ranks. It composes with ``data``, ``tensor`` (1d), ``zero``,
``pipeline``, ``offload`` (with zero stages 0-3), ``amp`` and ``remat``.

The transforms are applied in one fixed, documented order (as torchtitan does): pipeline, shard,
zero, offload, amp, remat: ``remat(amp(offload(zero(shard(pipeline(step), mesh, plan)))))``.

ColossalAI's form of a placement, ``zero=dict(model_config=dict(tensor_placement_policy="auto"),
optimizer_config=dict(gpu_margin_mem_ratio=0.8))``, is read as the same offload (``"cuda"``,
``"cpu"`` and ``"auto"`` are the policies ``"device"``, ``"host"`` and ``"auto"``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from colfunc.nn.plans import MODES, grid_axes
from colfunc.sharding import Mesh
from colfunc.step import Step

__all__ = ["ParallelConfig", "build", "model_plan", "parse"]

_KEYS = (
    "data",
    "expert",
    "tensor",
    "sequence",
    "pipeline",
    "zero",
    "amp",
    "remat",
    "offload",
    "backend",
    "timeout",
)
_SEQUENCE_MODES = ("megatron", "ulysses", "ring", "zigzag", "usp")
_PLACEMENTS = {"cuda": "device", "cpu": "host", "auto": "auto"}  # ColossalAI's names


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A validated ``parallel`` section (see the module docs)."""

    data: int = 1
    expert: int = 1
    tensor: int = 1
    tensor_mode: str = "1d"
    tensor_depth: int | None = None
    sequence_parallel: bool = False
    sequence_mode: str | None = None
    sequence_size: int = 1
    sequence_ulysses: int | None = None
    pipeline: dict[str, Any] | None = None
    zero: int | None = None
    zero_prefetch: int = 1
    amp: dict[str, Any] | None = None
    remat: str = "none"
    offload: dict[str, Any] | None = None
    backend: str = "threads"
    timeout: float = 600.0

    def __post_init__(self) -> None:
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
            raise ValueError(
                f"parallel: timeout must be a number of seconds > 0 (how long a collective waits "
                f"for its group before failing with an error naming the rank), got {t!r}"
            )
        for name in ("data", "expert", "tensor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel: {name} must be an int >= 1, got {value!r}")
        if self.expert > 1:
            others = ["sequence"] if self.long_sequence or self.sequence_parallel else []
            others += ["a 2d/2.5d/3d tensor mode"] if self.tensor_mode != "1d" else []
            if others:
                raise ValueError(
                    f"parallel: expert={self.expert} composes with data, tensor (1d), zero, "
                    f"pipeline, offload, amp and remat, not with {others[0]}; remove one of them"
                )
        self._check_tensor_mode()
        self._check_sequence()
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3)):
            raise ValueError(f"parallel: zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        p = self.zero_prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"parallel: zero prefetch must be an int >= 0, got {p!r}")
        if self.offload is not None:
            from colfunc.transforms.offload import OffloadConfig

            others = ["pipeline"] if self.pipeline is not None else []
            others += ["sequence"] if self.long_sequence else []
            if self.tensor > 1 and (self.tensor_mode != "1d" or self.sequence_parallel):
                others.append("tensor with sequence parallelism or a 2d/2.5d/3d mode")
            if others:
                raise ValueError(
                    f"parallel: offload composes with data, tensor (1d) and zero, not with "
                    f"{', '.join(others)} yet; remove them or the offload section"
                )
            if not isinstance(self.offload, dict):
                raise ValueError(f"parallel['offload'] must be a dict, got {self.offload!r}")
            try:
                OffloadConfig(**self.offload)
            except TypeError as e:
                raise ValueError(f"parallel['offload']: {e}") from None
        if self.backend not in ("threads", "gloo", "nccl", "env"):
            raise ValueError(
                f"parallel: backend must be 'threads', 'gloo', 'nccl' or 'env', got {self.backend!r}"
            )

    def _check_tensor_mode(self) -> None:
        mode = self.tensor_mode
        if mode not in MODES:
            raise ValueError(f"parallel['tensor']: mode must be one of {list(MODES)}, got {mode!r}")
        grid_axes(mode, self.tensor, self.tensor_depth)  # ValueError naming the nearest sizes
        if mode == "1d":
            return
        clash = "sequence_parallel=True" if self.sequence_parallel else None
        clash = f"sequence=dict(mode={self.sequence_mode!r})" if self.long_sequence else clash
        if clash:
            raise ValueError(
                f"parallel['tensor']: mode={mode!r} splits the activations itself; it does not "
                f"combine with {clash}"
            )

    def _check_sequence(self) -> None:
        mode, n, u = self.sequence_mode, self.sequence_size, self.sequence_ulysses
        if mode is None:
            return
        if mode not in _SEQUENCE_MODES:
            raise ValueError(
                f"parallel['sequence']: mode must be one of {list(_SEQUENCE_MODES)}, got {mode!r}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"parallel['sequence']: size must be an int >= 1, got {n!r}")
        if mode == "megatron":
            if n not in (1, self.tensor) or self.tensor < 2:
                raise ValueError(
                    "parallel['sequence']: mode='megatron' splits the sequence over the "
                    f"tensor-parallel axis; give tensor=N (N >= 2) and no other size (got "
                    f"size={n}, tensor={self.tensor})"
                )
            return
        if mode == "usp":
            if u is None:
                pass  # the largest size the model's heads allow, chosen by parse(model=)
            elif isinstance(u, bool) or not isinstance(u, int) or u < 1 or n % u:
                raise ValueError(
                    f"parallel['sequence']: mode='usp' needs ulysses=U, a divisor of size={n} "
                    f"(the Ulysses part of sp = ring x ulysses), got ulysses={u!r}"
                )
        elif u is not None:
            raise ValueError(f"parallel['sequence']: ulysses= is for mode='usp', not mode={mode!r}")
        if self.sequence_parallel:
            raise ValueError(
                "parallel: tensor=dict(sequence_parallel=True) is Megatron's sequence parallelism "
                f"and sequence=dict(mode={mode!r}) another; choose one"
            )

    def check_seq_len(self, seq_len: int) -> None:
        """ValueError unless the long-context mode can split sequences of ``seq_len``."""
        if not self.long_sequence:
            return
        n = self.sequence_size * (2 if self.sequence_mode == "zigzag" else 1)
        if seq_len % n:
            why = f"2 x size = {n} (zigzag's chunks)" if self.sequence_mode == "zigzag" else n
            raise ValueError(
                f"data.seq_len={seq_len} is not divisible by {why} of parallel['sequence'] "
                f"(mode={self.sequence_mode!r}, size={self.sequence_size}); use a seq_len that "
                f"is a multiple of {n}"
            )

    def check_batch(self, batch_size: int) -> None:
        """ValueError unless ``batch_size`` (the global batch) splits over the data-parallel
        ranks and each rank's share into the pipeline's microbatches: a run checks it before
        it makes its folder, rather than failing at its first step."""
        dp = self.data * self.expert  # (each expert-parallel rank routes tokens of its own)
        if batch_size % dp:
            what = f"data={self.data} x expert={self.expert}" if self.expert > 1 else f"data={dp}"
            raise ValueError(
                f"data.batch_size={batch_size} is not divisible by parallel {what} (each "
                f"data-parallel rank takes an equal share); use a multiple of {dp}"
            )
        m = int(self.pipeline.get("microbatches", self.stages)) if self.pipeline else 1
        if (batch_size // dp) % m:
            raise ValueError(
                f"data.batch_size={batch_size} over data={dp} ranks leaves {batch_size // dp} "
                f"rows each, not divisible by the pipeline's microbatches={m}; use a batch size "
                f"that is a multiple of {dp * m}"
            )

    @property
    def long_sequence(self) -> bool:
        """Whether the sequence is split over an axis of its own (Ulysses, ring, ...)."""
        return self.sequence_mode not in (None, "megatron")

    @property
    def stages(self) -> int:
        return int(self.pipeline.get("stages", 1)) if self.pipeline else 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{"dp": data, "ep": expert, "pp": stages, "sp": sequence, "tp": tensor}``; ``ep``,
        ``pp`` and ``tp`` only when above 1, ``sp`` (or ``sp_ring`` and ``sp_ulysses``) with a long-context mode; the
        tensor mode's axes in place of ``tp`` for 2D, 2.5D and 3D."""
        shape = {"dp": self.data, "ep": self.expert, "pp": self.stages}
        if self.long_sequence and self.sequence_mode == "usp":
            u = self.sequence_ulysses
            if u is None:
                raise ValueError(
                    f"parallel['sequence']: mode='usp' needs ulysses=U, a divisor of "
                    f"size={self.sequence_size} (the Ulysses part of sp = ring x ulysses)"
                )
            shape.update(sp_ring=self.sequence_size // u, sp_ulysses=u)
        elif self.long_sequence:
            shape["sp"] = self.sequence_size
        grid = grid_axes(self.tensor_mode, self.tensor, self.tensor_depth)
        shape.update(grid)
        keep = ("sp", "sp_ring", "sp_ulysses") + (tuple(grid) if self.tensor_mode != "1d" else ())
        return {a: n for a, n in shape.items() if n > 1 or a == "dp" or a in keep}


def parse(section: dict[str, Any], model: Any = None) -> ParallelConfig:
    """A :class:`ParallelConfig` from a config's ``parallel`` dict; ValueError naming bad keys.

    With ``model`` (the run's model config), ``sequence=dict(mode="usp", size=N)`` without
    ``ulysses=`` takes the largest Ulysses size that divides ``N`` and each tensor-parallel
    rank's query and key/value heads (see :func:`ulysses_size`)."""
    pc = _parse(section)
    if pc.sequence_mode == "usp" and pc.sequence_ulysses is None:
        if model is None:  # nothing to choose it from
            raise ValueError(
                f"parallel['sequence']: mode='usp' needs ulysses=U, a divisor of "
                f"size={pc.sequence_size} (the Ulysses part of sp = ring x ulysses)"
            )
        pc = dataclasses.replace(pc, sequence_ulysses=ulysses_size(pc, model))
    return pc


def ulysses_size(pc: ParallelConfig, model: Any) -> int:
    """The largest Ulysses size for ``pc``'s ``usp`` over ``model``'s heads: a divisor of the
    sequence size that also divides each tensor-parallel rank's query and key/value heads (1:
    ring attention alone)."""
    n_head = getattr(model, "n_head", 1)
    n_kv = getattr(model, "n_kv_heads", None) or n_head
    tp = pc.tensor if pc.tensor_mode == "1d" else 1
    heads = [h // tp for h in (n_head, n_kv) if h % tp == 0] or [1]
    n = pc.sequence_size
    return max(u for u in range(1, n + 1) if n % u == 0 and all(h % u == 0 for h in heads))


def _parse(section: dict[str, Any]) -> ParallelConfig:
    if not isinstance(section, dict):
        raise ValueError(f"parallel must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise ValueError(f"parallel has unknown key {unknown[0]!r}; the keys are {list(_KEYS)}")
    kw: dict[str, Any] = {
        k: section[k]
        for k in ("data", "expert", "pipeline", "remat", "backend", "timeout")
        if k in section
    }
    tensor = section.get("tensor", 1)
    if isinstance(tensor, dict):
        extra = sorted(set(tensor) - {"size", "sequence_parallel", "mode", "depth"})
        if extra:
            raise ValueError(
                f"parallel['tensor'] has unknown key {extra[0]!r}; use size=, mode=, depth= "
                "(for '2.5d') and sequence_parallel="
            )
        kw["tensor"] = tensor.get("size", 1)
        kw["sequence_parallel"] = bool(tensor.get("sequence_parallel", False))
        kw["tensor_mode"] = tensor.get("mode", "1d")
        kw["tensor_depth"] = tensor.get("depth")
    else:
        kw["tensor"] = tensor
    sequence = section.get("sequence")
    if sequence is not None:
        if not isinstance(sequence, dict):
            raise ValueError(
                f"parallel['sequence'] must be a dict like dict(mode='ring', size=4), got "
                f"{sequence!r}"
            )
        extra = sorted(set(sequence) - {"mode", "size", "ulysses"})
        if extra:
            raise ValueError(
                f"parallel['sequence'] has unknown key {extra[0]!r}; use mode=, size= (and "
                "ulysses= for 'usp')"
            )
        if "mode" not in sequence:
            raise ValueError(f"parallel['sequence'] needs mode=, one of {list(_SEQUENCE_MODES)}")
        kw["sequence_mode"] = sequence["mode"]
        kw["sequence_size"] = sequence.get("size", 1)
        kw["sequence_ulysses"] = sequence.get("ulysses")
        if sequence["mode"] == "megatron":
            kw["sequence_parallel"] = True
    zero = section.get("zero")
    kw["offload"] = section.get("offload")
    if isinstance(zero, dict) and {"model_config", "optimizer_config"} & set(zero):
        kw["offload"], zero = _colossal_placement(zero), None
    if isinstance(zero, dict):
        if set(zero) - {"stage", "prefetch"}:
            raise ValueError(
                f"parallel['zero'] takes only stage= and prefetch=, got {sorted(zero)}"
            )
        kw["zero_prefetch"] = zero.get("prefetch", 1)
        zero = zero.get("stage", 1)
    kw["zero"] = zero
    amp = section.get("amp")
    kw["amp"] = {"dtype": amp} if isinstance(amp, str) else amp
    if kw["amp"] is not None and not isinstance(kw["amp"], dict):
        raise ValueError(f"parallel['amp'] must be a dtype name or a dict, got {amp!r}")
    stages = kw.get("pipeline")
    if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1:
        # ColossalAI's pipeline=N: N stages, as many microbatches (each stage busy in 1F1B)
        kw["pipeline"] = {"stages": stages, "microbatches": stages}
    if kw.get("pipeline") is not None and not isinstance(kw["pipeline"], dict):
        raise ValueError(
            f"parallel['pipeline'] must be a dict like dict(stages=2, microbatches=8), got "
            f"{kw['pipeline']!r}"
        )
    return ParallelConfig(**kw)


def _colossal_placement(zero: dict[str, Any]) -> dict[str, Any]:
    """ColossalAI's ``zero=dict(model_config=..., optimizer_config=...)`` as an offload section."""
    model = dict(zero.get("model_config") or {})
    optimizer = dict(zero.get("optimizer_config") or {})
    policy = model.pop("tensor_placement_policy", "cuda")
    if policy not in _PLACEMENTS:
        raise ValueError(
            f"parallel['zero']: tensor_placement_policy {policy!r} is not one of "
            f"{sorted(_PLACEMENTS)}"
        )
    out: dict[str, Any] = {"policy": _PLACEMENTS[policy]}
    if "gpu_margin_mem_ratio" in optimizer:
        out["margin"] = optimizer.pop("gpu_margin_mem_ratio")
    leftover = sorted(set(model) | set(optimizer))
    if leftover:
        raise ValueError(f"parallel['zero']: {leftover[0]!r} has no colfunc counterpart; remove it")
    if out["policy"] != "device":
        out["device_budget"] = zero.get("device_budget")
    return out


def backend(pc: ParallelConfig) -> str:
    """The launch backend: ``env`` when this process is already one rank under ``torchrun``."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "env"
    return pc.backend


def model_plan(model: Any, pc: ParallelConfig, cfg: Any = None) -> dict[str, Any] | None:
    """The plan of ``model`` (a model module) for the tensor mode of ``pc``; ValueError when the
    model has none for it. A module whose plan depends on the model's config (one run through
    its ``transformers`` module) has a ``tp_plan(cfg)`` function, called with ``cfg``."""
    if pc.tensor_mode == "1d":
        plan = getattr(model, "tp_plan", None)
        if callable(plan):  # (asked only where tensors are split: a config may have no plan)
            return plan(cfg) if pc.tensor > 1 else None
        return plan
    plans = getattr(model, "tp_plans", None) or {}
    if pc.tensor_mode not in plans:
        name = getattr(model, "__name__", type(model).__name__)
        raise ValueError(
            f"parallel['tensor']: mode={pc.tensor_mode!r} needs the model's plan for it "
            f"(tp_plans[{pc.tensor_mode!r}]), which {name} lacks; use mode='1d' or a model "
            "that describes its layers with colfunc.nn.tensor_plans"
        )
    return dict(plans[pc.tensor_mode])


def build(step: Step, mesh: Mesh | None, pc: ParallelConfig, plan: dict[str, Any] | None) -> Step:
    """``step`` with the transforms of ``pc`` applied in the fixed order, on this rank's mesh
    (``plan``: the model's plan for the tensor mode, :func:`model_plan`). An offload on one
    rank (or ``mesh=None``) places nothing: offload, amp and remat only."""
    from colfunc.transforms import amp, offload, remat

    one_rank = pc.data == 1 and pc.expert == 1 and pc.tensor == 1 and pc.zero is None
    if mesh is not None and not (pc.offload is not None and one_rank):
        step = _placed(step, mesh, pc, plan)
    if pc.offload is not None:  # over data, 1d tensor and zero only (parse refuses the rest)
        step = offload(step, **pc.offload)
    if pc.amp is not None:
        step = amp(step, **pc.amp)
    if pc.remat != "none":
        step = remat(step, pc.remat)
    return step


def _placed(step: Step, mesh: Mesh, pc: ParallelConfig, plan: dict[str, Any] | None) -> Step:
    """``step`` with the transforms that place it on the mesh: pipeline, shard and zero."""
    from colfunc.transforms import shard, zero

    if pc.pipeline is not None:
        from colfunc.transforms.pipeline import pipeline_from_config

        step = pipeline_from_config(step, pc.pipeline)
    sp: bool | str = pc.sequence_parallel and pc.tensor > 1
    if pc.long_sequence:
        assert pc.sequence_mode is not None
        sp = pc.sequence_mode
    if pc.tensor_mode != "1d":
        step = shard(step, mesh, plan=plan, tensor_mode=pc.tensor_mode)
    else:
        ep = "ep" if pc.expert > 1 else None
        plan = plan if pc.tensor > 1 else None
        step = shard(step, mesh, plan=plan, sequence_parallel=sp, expert_axis=ep)
    if pc.zero is not None:
        step = zero(step, pc.zero, prefetch=pc.zero_prefetch)
    return step
