"""Gradient accumulation over ``k`` calls (optax's ``MultiSteps``).

The first ``k - 1`` calls add the gradients into an fp32 (or fp64) sum and return zero updates; the ``k``-th
applies the inner optimizer to the mean gradient and starts a new sum. With ``k`` equal
micro-batches and a mean loss, this is one step on the whole batch (up to rounding).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from colfunc import torch_private, tree
from colfunc.optim.base import GradientTransformation, state_zeros, wide_leaves

__all__ = ["AccumulateState", "accumulate"]

PyTree = Any


class AccumulateState(NamedTuple):
    """``micro_step``: gradients summed since the last inner update (``0 <= micro_step < k``);
    ``grad_sum``: their sum, mirroring the parameters; ``inner``: the inner optimizer's state.
    """

    micro_step: int
    grad_sum: PyTree
    inner: PyTree


def accumulate(opt: GradientTransformation, k: int) -> GradientTransformation:
    """``opt`` applied once every ``k`` calls, to the mean of the ``k`` gradients.

    ``lr`` reports the inner optimizer's learning rate (the one its next real update uses).

    Example:
        >>> opt = accumulate(adamw(3e-4), k=4)   # one AdamW update per 4 micro-batches
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"accumulate: opt must be a GradientTransformation, got {opt!r}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"accumulate: k must be an int, got {k!r}")
    if k < 1:
        raise ValueError(f"accumulate: k must be >= 1, got {k}")

    def init(params: PyTree) -> AccumulateState:
        return AccumulateState(0, state_zeros(params), opt.init(params))

    def update(
        grads: PyTree, state: AccumulateState, params: PyTree
    ) -> tuple[PyTree, AccumulateState]:
        treedef = tree.structure(params)
        total = torch_private.foreach_add(
            wide_leaves(treedef, state.grad_sum), wide_leaves(treedef, grads)
        )
        if state.micro_step + 1 < k:
            zeros = tree.map(torch.zeros_like, params)
            return zeros, state._replace(
                micro_step=state.micro_step + 1, grad_sum=tree.unflatten(treedef, total)
            )
        mean = tree.unflatten(treedef, torch_private.foreach_div(total, float(k)))
        updates, inner = opt.update(mean, state.inner, params)
        return updates, AccumulateState(0, state_zeros(params), inner)

    def current_lr(state: AccumulateState) -> float | None:
        return opt.lr(state.inner)

    return GradientTransformation(init, update, current_lr)
