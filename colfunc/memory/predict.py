"""``cf.memory.predict``: the device peak and traffic of an offloaded step, predicted before running.

No peer predicts these; we can because an offloaded step's placement is a pure function of the
order in which the step uses its chunks and of the memory it allocates between uses, and both can
be had without computing anything: the step runs on the *meta* device, where tensors have shapes,
dtypes and lifetimes but no values and no memory. The same code (fetches, evictions, saved-tensor
tokens, the warm-up trace) runs as in the real step; only the update, which needs values, is left
out (it adds no device memory but the device-homed chunks' AdamW temporaries, small next to the
activations). So the prediction is what the run will measure, not a model of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colfunc import core, models, nn

__all__ = ["Prediction", "predict"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a step will need, per step after the warm-up (bytes).

    ``device_peak_bytes``, ``h2d_bytes``, ``d2h_bytes``: as the step's ``offload/`` metrics will
    report them at ``budget``. ``smallest_budget``: the least budget the composition can run in
    (its layers streamed one at a time); ``feasible``: whether ``budget`` is at least that.
    """

    budget: int
    device_peak_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    smallest_budget: int
    feasible: bool


def _meta_params(model_cfg: Any, dtype: torch.dtype) -> Any:
    shapes = models.of_config(model_cfg).module.param_shapes(model_cfg)
    return nn.nest({p: torch.empty(s, dtype=dtype, device="meta") for p, s in shapes.items()})


def _meta_batch(batch_shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    ids = torch.empty(batch_shape, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": torch.empty_like(ids)}


def _run(step: Any, params: Any, batch: Any, steps: int) -> dict[str, Any]:
    state = step.init(params)
    metrics: dict[str, Any] = {}
    for _ in range(steps):
        state, metrics = step(state, batch)
    return metrics


def predict(
    model_cfg: Any,
    step: Any,
    batch_shape: tuple[int, int],
    budget: int | float | str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> Prediction:
    """Predict the device peak and bytes moved per step of ``step`` (a step with ``cf.offload``
    in its composition) for a model of ``model_cfg`` on batches of ``batch_shape`` (batch,
    sequence), at ``budget`` (None: the budget the step's offload was given), before running.

    Example:
        >>> step = cf.remat(cf.offload(cf.train_step(loss, optim.adamw(3e-4)), "auto", "2GiB"))
        >>> p = cf.memory.predict(cfg, step, (8, 1024), "1GiB")
        >>> p.device_peak_bytes, p.h2d_bytes, p.smallest_budget
    """
    comp = getattr(step, "composition", None)
    if comp is None or comp.offload is None:
        raise ValueError(
            "memory.predict: the step has no cf.offload in its composition; predict an offloaded "
            "step (cf.offload(step, policy, device_budget))"
        )
    over = [n for n in ("shard", "zero") if getattr(comp, n) is not None]
    if over:
        raise ValueError(
            f"memory.predict: predicts one rank's offloaded step, and this one also has "
            f"{' and '.join(over)}; predict the same offload without them (a data-parallel rank "
            f"holds what one device does, for its rows of the batch)"
        )
    if not (isinstance(batch_shape, tuple) and len(batch_shape) == 2):
        raise ValueError(
            f"memory.predict: batch_shape must be (batch, sequence), got {batch_shape!r}"
        )
    from colfunc.memory.placement import device_budget

    target = (
        comp.offload if budget is None else dataclasses.replace(comp.offload, device_budget=budget)
    )
    at = device_budget(target.device_budget, torch.device("cpu"))
    # the least budget: the layers streamed one at a time (a static placement as it is, since
    # what it keeps is fixed; the in-memory step as it is)
    if comp.offload.policy in ("device", "static"):
        floor_cfg = dataclasses.replace(target, device_budget=1 << 62)
    else:
        floor_cfg = dataclasses.replace(
            target, policy="host", prefetch=0, margin=0.0, device_budget=1 << 62
        )
    params, batch = _meta_params(model_cfg, dtype), _meta_batch(batch_shape)
    with core.context(core.DryRun()):
        floor_step = dataclasses.replace(comp, offload=floor_cfg).build(step.base)
        smallest = int(_run(floor_step, params, batch, 1)["offload/device_peak_bytes"])
        if at < smallest:
            return Prediction(at, smallest, 0, 0, smallest, False)
        target_step = dataclasses.replace(comp, offload=target).build(step.base)
        m = _run(target_step, params, batch, 3)  # the third: after any chunk is device-homed
    return Prediction(
        budget=at,
        device_peak_bytes=int(m["offload/device_peak_bytes"]),
        h2d_bytes=int(m["offload/h2d_bytes"]),
        d2h_bytes=int(m["offload/d2h_bytes"]),
        smallest_budget=smallest,
        feasible=True,
    )
