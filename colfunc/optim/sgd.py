"""Stochastic gradient descent with the semantics, names and defaults of ``torch.optim.SGD``.

With ``g`` the gradient and ``p`` the parameter::

    g = g + weight_decay * p
    buf = g                                        (first update: torch's convention)
    buf = momentum * buf + (1 - dampening) * g     (later updates)
    d = g + momentum * buf if nesterov else buf
    update = -lr * d

Without momentum there is no buffer and ``d = g``. The buffer is fp32 whatever the parameters'
dtype (fp64 for fp64 parameters); new tensors come out and nothing passed in is written.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from colfunc import torch_private, tree
from colfunc.optim.base import (
    GradientTransformation,
    LearningRate,
    Tensors,
    check_lr,
    check_number,
    learning_rate,
    state_zeros,
    wide_leaves,
)

__all__ = ["SgdState", "sgd"]

PyTree = Any


class SgdState(NamedTuple):
    """``step``: updates done; ``momentum_buffer`` mirrors the parameters (None if no momentum)."""

    step: int
    momentum_buffer: PyTree | None


def sgd(
    lr: float | LearningRate = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` (momentum, dampening, L2 weight decay, Nesterov).

    ``lr`` is a number or a :data:`~colfunc.optim.LearningRate` (``Callable[[int], float]`` of
    the update count).

    Example:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    """
    lr = check_lr("sgd", lr)
    momentum = check_number("sgd", "momentum", momentum, low=0.0)
    dampening = check_number("sgd", "dampening", dampening, low=0.0)
    weight_decay = check_number("sgd", "weight_decay", weight_decay, low=0.0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"sgd: nesterov needs momentum > 0 and dampening == 0, got momentum={momentum} "
            f"and dampening={dampening}"
        )

    def init(params: PyTree) -> SgdState:
        return SgdState(0, state_zeros(params) if momentum else None)

    def update(grads: PyTree, state: SgdState, params: PyTree) -> tuple[PyTree, SgdState]:
        treedef = tree.structure(params)
        gs: Tensors = wide_leaves(treedef, grads)
        if weight_decay:
            gs = torch_private.foreach_add(gs, wide_leaves(treedef, params), alpha=weight_decay)
        buf: Tensors | None = None
        d: Tensors = gs
        if momentum:
            if state.step == 0:
                # A copy even when `gs` are the caller's tensors: the state must not alias them.
                buf = [g.clone() for g in gs]
            else:
                buf = torch_private.foreach_mul(
                    treedef.flatten_up_to(state.momentum_buffer), momentum
                )
                torch_private.foreach_add_(buf, gs, alpha=1 - dampening)
            d = torch_private.foreach_add(gs, buf, alpha=momentum) if nesterov else buf
        updates = torch_private.foreach_mul(d, -learning_rate(lr, state.step))
        new_buf = None if buf is None else tree.unflatten(treedef, buf)
        return tree.unflatten(treedef, updates), SgdState(state.step + 1, new_buf)

    def current_lr(state: SgdState) -> float:
        return learning_rate(lr, state.step)

    return GradientTransformation(init, update, current_lr)
