"""Bytes of the model states a rank holds: parameters, gradients, optimizer states."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colfunc import tree

__all__ = ["MemoryReport", "report"]


def _local_bytes(x: Any) -> int:
    if not isinstance(x, torch.Tensor):
        return 0
    local = x.to_local() if hasattr(x, "to_local") else x
    return local.numel() * local.element_size()


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes on this rank. ``grads`` is what one set of gradients takes as the step produces it."""

    params: int
    grads: int
    optimizer: int
    extra: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.extra


def report(state: Any, grads: Any = None) -> MemoryReport:
    """This rank's model-state bytes for a ``TrainState``.

    Gradients are not part of the state: pass ``grads`` (e.g. from ``step.forward_backward``) to
    count them exactly; otherwise they are taken to mirror the parameters, one of the same local
    size and dtype each, which is what the plain step produces.
    """
    if not hasattr(state, "params") or not hasattr(state, "opt_state"):
        raise TypeError(f"report expects a TrainState, got {type(state).__name__}")
    params = sum(_local_bytes(x) for x in tree.leaves(state.params))
    grad_bytes = params if grads is None else sum(_local_bytes(x) for x in tree.leaves(grads))
    return MemoryReport(
        params=params,
        grads=grad_bytes,
        optimizer=sum(_local_bytes(x) for x in tree.leaves(state.opt_state)),
        extra=sum(_local_bytes(x) for x in tree.leaves(state.extra)),
    )
