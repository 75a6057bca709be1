"""``amp``: mixed precision with fp32 master weights and (optionally) dynamic loss scaling.

The state keeps fp32 parameters and optimizer states; each step computes the loss and gradients
with a copy of the parameters cast to ``dtype`` (bf16 or fp16), then widens the gradients to fp32
for the optimizer (Micikevicius et al. 2018).

fp16's narrow exponent lets small gradients underflow, so its loss is multiplied by a scale before
the backward pass and the gradients divided by it after. With ``loss_scale="dynamic"`` the scale
is state (``state.extra["loss_scale"]``): it starts at ``2**16``, halves and skips the update when
any gradient is inf or NaN, and doubles after ``growth_interval`` good steps in a row (the policy
of ``torch.amp.GradScaler``). bf16 has fp32's exponent range and needs no scaling (the default).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from colfunc import core, torch_private, tree
from colfunc.sharding import Mesh, ShardedTensor, comm
from colfunc.step import Step, TrainState
from colfunc.transforms.composition import apply_transform

if TYPE_CHECKING:
    from colfunc.transforms.composition import Composition

__all__ = ["AmpConfig", "amp", "bf16_is_native", "bf16_slowdown"]

PyTree = Any
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    # no cast for fp64 parameters: amp's scaling and skipping alone (exact with a power-of-two
    # scale), as the equivalence tests draw it
    "fp64": torch.float64,
    "float64": torch.float64,
}


def bf16_is_native() -> bool:
    """Whether bf16 runs at speed here: a GPU, or a CPU with AVX512-BF16 or AMX. On an
    AVX2-only CPU torch emulates bf16 arithmetic, many times slower than fp32."""
    if torch.cuda.is_available():
        return True
    return bool(torch_private.get("cpu_avx512_bf16")() or torch_private.get("cpu_amx")())


def bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """How many times longer a ``size`` x ``size`` bf16 matmul takes than an fp32 one on this
    CPU, measured now (the best of ``repeats`` each): what amp's bf16 costs here."""
    import time

    a = torch.randn(size, size)
    times = {}
    for x in (a, a.bfloat16()):
        x @ x  # (warm)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - t)
        times[x.dtype] = best
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"amp: unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(
            f"amp: dtype must be torch.bfloat16, torch.float16, torch.float32 or torch.float64, "
            f"got {dtype}"
        )
    return dtype


def _cast(params: PyTree, dtype: torch.dtype) -> PyTree:
    return tree.map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        params,
    )


def _wide_loss(loss: torch.Tensor, params: PyTree) -> torch.Tensor:
    """The loss in the masters' dtype (fp32 when they have several), as the reference has it."""
    masters = {x.dtype for x in tree.tensors(params) if x.is_floating_point()}
    return loss.to(masters.pop() if len(masters) == 1 else torch.float32)


def _overflow(grads: PyTree) -> bool:
    """Whether any gradient on any rank is inf or NaN.

    Every rank must take the same decision, or those that skip would leave the others waiting in
    the update's collectives; under a mesh the ranks' local findings are combined (a max over all
    axes), since a sharded, pipelined or ZeRO step gives each rank only its own gradients.
    """
    local = [(x._local if isinstance(x, ShardedTensor) else x).float() for x in tree.tensors(grads)]
    norms = torch_private.foreach_norm(local) if local else []
    bad = torch.stack([~torch.isfinite(n) for n in norms]).any() if norms else torch.tensor(False)
    mesh = core.innermost(Mesh)
    if mesh is not None and mesh.size > 1:
        flag = comm.all_reduce(bad.to(torch.float32), mesh.axis_names, op="max", mesh=mesh)
        return bool(flag > 0)
    return bool(bad)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmpConfig:
    """The arguments of :func:`amp`, checked."""

    dtype: torch.dtype | str = torch.bfloat16
    loss_scale: str | float | None = None
    init_scale: float = 2.0**16
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        ls = self.loss_scale
        if isinstance(ls, str) and ls != "dynamic":
            raise ValueError(f"amp: loss_scale must be None, 'dynamic' or a number, got {ls!r}")
        if (
            ls is not None
            and ls != "dynamic"
            and (isinstance(ls, bool) or not isinstance(ls, int | float) or not ls > 0)
        ):
            raise ValueError(f"amp: a fixed loss_scale must be a number > 0, got {ls!r}")
        if not self.init_scale > 0 or self.growth_interval < 1:
            raise ValueError(
                f"amp: need init_scale > 0 and growth_interval >= 1, got {self.init_scale}, "
                f"{self.growth_interval}"
            )

    def build(self, step: Step, comp: Composition) -> Step:
        # under offload the parameters stay in host memory: its fetches cast each chunk, and
        # its gradients stay there too, unscaled by offload in the masters' dtype
        return _build(step, self, offloaded=comp.offload is not None and comp.offload.fetches)


def amp(
    step: Step,
    dtype: torch.dtype | str = torch.bfloat16,
    loss_scale: str | float | None = None,
    *,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
) -> Step:
    """Compute ``step`` in ``dtype`` with fp32 master weights; see the module docs.

    ``loss_scale``: None (no scaling), ``"dynamic"``, or a fixed positive number. Metrics gain
    ``loss_scale`` and ``skipped`` (whether the update was skipped for overflow).

    Example:
        >>> step = cf.amp(cf.train_step(loss_fn, optim.adamw(3e-4)), torch.float16, "dynamic")
    """
    if not isinstance(step, Step):
        raise TypeError(f"amp: expected a Step (from cf.train_step), got {type(step).__name__}")
    config = AmpConfig(
        dtype=dtype, loss_scale=loss_scale, init_scale=init_scale, growth_interval=growth_interval
    )
    return apply_transform(step, "amp", config)


def _build(step: Step, cfg: AmpConfig, offloaded: bool = False) -> Step:
    compute = _dtype(cfg.dtype)
    loss_scale, init_scale, growth_interval = cfg.loss_scale, cfg.init_scale, cfg.growth_interval
    dynamic = loss_scale == "dynamic"
    scaled = loss_scale is not None
    inner_init_extra, inner_fb, inner_update = step.init_extra, step.forward_backward, step.update
    inner_fwd = step.forward

    def init_extra(params: PyTree) -> dict[str, Any]:
        extra = dict(inner_init_extra(params))
        if scaled:
            extra["loss_scale"] = float(init_scale if dynamic else loss_scale)  # type: ignore[arg-type]
            extra["good_steps"] = 0
        return extra

    def forward_backward(
        params: PyTree, batch: PyTree, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, PyTree]:
        scale = float(extra["loss_scale"]) if scaled else 1.0
        masters = {x.dtype for x in tree.tensors(params) if x.is_floating_point()}
        with contextlib.ExitStack() as stack:
            stack.enter_context(core.context(core.LossScale(scale)))
            if len(masters) == 1:  # a reduction inside may widen to the masters' dtype first
                stack.enter_context(core.context(core.WidenGrads(masters.pop())))
            loss, grads = inner_fb(params if offloaded else _cast(params, compute), batch, extra)
        if offloaded:  # offload's gradients: in its masters' dtype, unscaled where they live
            return _wide_loss(loss, params), grads
        # widen to the masters' dtype, then unscale in fp32 (unscaling in fp16 could underflow)
        grads = tree.map(
            lambda g, p: g.to(p.dtype) / scale if scale != 1.0 else g.to(p.dtype),
            grads,
            step.trainable_part(params),  # (the parameters that have gradients)
        )
        return _wide_loss(loss, params), grads

    def forward(params: PyTree, batch: PyTree, extra: dict[str, Any]) -> torch.Tensor:
        given = params if offloaded else _cast(params, compute)
        return _wide_loss(inner_fwd(given, batch, extra), params)

    def update(grads: PyTree, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        if not scaled:
            return inner_update(grads, state)
        scale, good = float(state.extra["loss_scale"]), int(state.extra["good_steps"])
        if _overflow(grads):
            extra = {**state.extra, "good_steps": 0}
            if dynamic:
                extra["loss_scale"] = scale / 2
            # some gradient is not finite, on some rank: so is the global norm, on every rank
            # (a local norm here would differ between ranks holding different pieces)
            norm = torch.tensor(float("inf"))
            info = {"grad_norm": norm, "lr": step.optimizer.lr(state.opt_state)}
            return state._replace(extra=extra), {**info, "loss_scale": scale, "skipped": True}
        # the update computes the norm, under the frames that say how its pieces add up
        new_state, info = inner_update(grads, state)
        good += 1
        if dynamic and good >= growth_interval:
            scale, good = scale * 2, 0
        extra = {**new_state.extra, "loss_scale": scale, "good_steps": good}
        return new_state._replace(extra=extra), {
            **info,
            "loss_scale": float(state.extra["loss_scale"]),
            "skipped": False,
        }

    return step.replace(
        init_extra=init_extra, forward=forward, forward_backward=forward_backward, update=update
    )
