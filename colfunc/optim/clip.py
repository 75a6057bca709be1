"""Gradient clipping by the global L2 norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from colfunc import core, torch_private, tree
from colfunc.optim.base import GradientTransformation, check_number, contiguous_pieces, flat_runs

__all__ = ["clip_by_global_norm", "global_norm", "known_norm"]

PyTree = Any


class _KnownNorm:
    """Frame: the global norm of the gradient tree ``grads`` (that very object) is ``norm``, as
    computed under the :class:`~colfunc.core.NormReduction` frame ``reduction``."""

    def __init__(self, grads: PyTree, norm: torch.Tensor) -> None:
        self.grads, self.norm = grads, norm
        self.reduction = core.innermost(core.NormReduction)


@contextmanager
def known_norm(grads: PyTree, norm: torch.Tensor) -> Iterator[None]:
    """Inside the block, :func:`global_norm` of ``grads`` (the same object) returns ``norm``.

    A training step computes the norm for its metrics once and lets ``clip_by_global_norm``
    reuse it; under a mesh that saves a collective as well as a pass over the gradients.
    """
    with core.context(_KnownNorm(grads, norm)):
        yield


def global_norm(grads: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves together (0-d fp32), computed as torch's clipping does.

    One norm per tensor, then the norm of those norms: the same reduction order as
    ``clip_grad_norm_``, so the two agree bit for bit on fp32 gradients. Gradients that tile flat
    buffers with strided leaves among them (data parallelism's, whose stacked leaves are views
    with their layers' rows apart) are normed over the buffers' runs instead, in blocks of
    :data:`NORM_BLOCK` elements: a few calls instead of one per layer row, and no less accurate
    (each block's sum of squares is short).
    """
    known = core.innermost(_KnownNorm)
    frame = core.innermost(core.NormReduction)
    # the same tree, whose pieces add up the same way (a transform in between may say that they
    # are pieces of a larger whole)
    if known is not None and known.grads is grads and known.reduction is frame:
        return known.norm
    # integer "gradients" (zeros, of integer leaves) count as floats
    ts = [t if t.is_floating_point() else t.float() for t in tree.tensors(grads)]
    if not ts:
        return torch.zeros(())
    # fp32 at least (half-precision grads are accumulated in fp32); fp64 grads keep fp64
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32
    # strided leaves among gradients that tile flat buffers (data parallelism's): by the runs
    strided = not all(t.is_contiguous() for t in ts)
    runs = flat_runs(ts) if frame is None and strided else None
    if runs is not None:
        return torch.linalg.vector_norm(torch.cat([_blocked_norms(r, dtype) for r in runs]))
    pieces, counts = _pieces(ts)
    norms = list(torch_private.foreach_norm(pieces, 2.0, dtype=dtype))
    device = ts[0].device
    if frame is not None:  # the leaves are local pieces of distributed tensors: per leaf
        squares, at = [], 0
        for k in counts:
            squares.append(torch.stack([n.to(device) for n in norms[at : at + k]]).square().sum())
            at += k
        return frame.reduce(squares).sqrt()
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


# elements per partial norm over a flat run. CPU reductions of fp32 accumulate in fp32 lanes: a
# norm over a 2M-element run is off by 3e-5 relative, over 1024-element blocks by about 1e-8
NORM_BLOCK = 1024


def _blocked_norms(run: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The norms of ``run`` (1-d) in blocks of :data:`NORM_BLOCK` elements, the last one short."""
    k = run.numel() // NORM_BLOCK * NORM_BLOCK
    parts = []
    if k:
        parts.append(torch.linalg.vector_norm(run[:k].view(-1, NORM_BLOCK), dim=1, dtype=dtype))
    if k < run.numel():
        parts.append(torch.linalg.vector_norm(run[k:], dtype=dtype).reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _pieces(ts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """``ts`` as contiguous pieces to norm, and how many pieces each tensor is.

    A reduction over a strided tensor sums in its memory order, less accurately than over a
    contiguous one. A tensor whose rows are contiguous (a stacked leaf's view into data
    parallelism's flat buffer) is normed row by row, without a copy; any other strided tensor
    is copied contiguous first.
    """
    pieces: list[torch.Tensor] = []
    counts: list[int] = []
    for t in ts:
        (own,) = contiguous_pieces(t, at=0)
        pieces.extend(own)
        counts.append(len(own))
    return pieces, counts


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the gradients by ``max_norm / (norm + 1e-6)`` when their global norm is larger.

    The scale is ``min(max_norm / (norm + 1e-6), 1)`` applied unconditionally (as torch does, which
    avoids a host sync on the device), so results equal ``clip_grad_norm_`` exactly. Stateless.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), adamw(3e-4))
    """
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0)

    def init(params: PyTree) -> tuple[()]:
        return ()

    def update(grads: PyTree, state: tuple[()], params: PyTree) -> tuple[PyTree, tuple[()]]:
        gs, treedef = tree.leaves(grads), tree.structure(grads)
        floats = [i for i, g in enumerate(gs) if _is_float(g)]
        if not floats:
            return grads, state
        coef = torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)
        scaled = torch_private.foreach_mul([gs[i] for i in floats], coef.to(gs[floats[0]].device))
        out = list(gs)  # other leaves (integer "gradients" of integer leaves) pass unchanged
        for i, g in zip(floats, scaled):
            out[i] = g
        return tree.unflatten(treedef, out), state

    return GradientTransformation(init, update)
