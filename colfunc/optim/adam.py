"""Adam and AdamW, with the semantics, names and defaults of ``torch.optim.Adam``/``AdamW``.

With ``t`` the update number from 1, ``g`` the gradient and ``p`` the parameter::

    m = beta1 * m + (1 - beta1) * g                      (a lerp, as in torch)
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v) / sqrt(1 - beta2^t) + eps            (v -> max(v_max, v) with amsgrad)
    update = -lr / (1 - beta1^t) * m / denom
             - lr * weight_decay * p                     (AdamW: decoupled decay)

Adam instead adds ``weight_decay * p`` to ``g`` first (L2 regularisation). The moments are fp32
whatever the parameters' dtype (fp64 for fp64 parameters). Each line is one foreach op (``torch_private.foreach_*``)
pass over all tensors (the order of operations follows torch's ``foreach`` implementation, so
results agree to rounding); new tensors come out and nothing passed in is written.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from colfunc import torch_private, tree
from colfunc.core import GradArrival
from colfunc.ops import AdamWHyper as AdamWUpdate  # one update's values (this module's: the rule)
from colfunc.optim.base import (
    GradientTransformation,
    LearningRate,
    Tensors,
    by_rows,
    check_lr,
    check_number,
    contiguous_pieces,
    learning_rate,
    packed,
    packed_view,
    rows_alike,
    state_zeros,
    wide_leaves,
)

__all__ = ["AdamState", "AdamWHyper", "adam", "adamw"]

PyTree = Any


class AdamState(NamedTuple):
    """``step``: updates done; the moments mirror the parameters' tree, in fp32 (or fp64).

    ``max_exp_avg_sq`` is the running maximum of ``exp_avg_sq`` with ``amsgrad``, else None.
    """

    step: int
    exp_avg: PyTree
    exp_avg_sq: PyTree
    max_exp_avg_sq: PyTree | None


class AdamWHyper(NamedTuple):
    """The hyperparameters of a plain AdamW (no AMSGrad), as ``GradientTransformation.adamw``."""

    lr: float | LearningRate
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def at(self, step: int, lr: float) -> AdamWUpdate:
        """Update ``step``'s (1-based) values at the rate ``lr``, as the op layer's AdamW
        kernels take them (:class:`colfunc.ops.AdamWHyper`)."""
        return AdamWUpdate(
            step=step,
            lr=lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


def _fused_ready(ps: Tensors, gs: Tensors, ms: Tensors, vs: Tensors) -> bool:
    """Whether the fused kernel takes these lists: plain fp32 or fp64 tensors, each entry's
    four of one dtype and device."""
    for p, g, m, v in zip(ps, gs, ms, vs):
        dtype, device = p.dtype, p.device
        if type(p) is not torch.Tensor or dtype not in (torch.float32, torch.float64):
            return False
        for x in (g, m, v):
            if type(x) is not torch.Tensor or x.dtype != dtype or x.device != device:
                return False
    return True


def _scale_by_adam(
    owner: str,
    lr: float | LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    decoupled: bool,
) -> GradientTransformation:
    lr = check_lr(owner, lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    beta1 = check_number(owner, "betas[0]", betas[0], low=0.0, high=1.0)
    beta2 = check_number(owner, "betas[1]", betas[1], low=0.0, high=1.0)
    eps = check_number(owner, "eps", eps, low=0.0)
    weight_decay = check_number(owner, "weight_decay", weight_decay, low=0.0)

    def init(params: PyTree) -> AdamState:
        max_sq = state_zeros(params) if amsgrad else None
        return AdamState(0, state_zeros(params), state_zeros(params), max_sq)

    def update(grads: PyTree, state: AdamState, params: PyTree) -> tuple[PyTree, AdamState]:
        treedef = tree.structure(params)
        ps = wide_leaves(treedef, params)
        gs: Tensors = wide_leaves(treedef, grads)
        lr_t = learning_rate(lr, state.step)
        t = state.step + 1
        if weight_decay and not decoupled:
            gs = torch_private.foreach_add(gs, ps, alpha=weight_decay)
        m = torch_private.foreach_lerp(treedef.flatten_up_to(state.exp_avg), gs, 1 - beta1)
        v = torch_private.foreach_mul(treedef.flatten_up_to(state.exp_avg_sq), beta2)
        torch_private.foreach_addcmul_(v, gs, gs, 1 - beta2)
        v_max: Tensors | None = None
        if amsgrad:
            v_max = torch_private.foreach_maximum(treedef.flatten_up_to(state.max_exp_avg_sq), v)
        denom = torch_private.foreach_sqrt(v_max if v_max is not None else v)
        torch_private.foreach_div_(denom, (1 - beta2**t) ** 0.5)
        torch_private.foreach_add_(denom, eps)
        step_size = (lr_t / (1 - beta1**t)) * -1
        if weight_decay and decoupled:
            updates = torch_private.foreach_mul(ps, -lr_t * weight_decay)
            torch_private.foreach_addcdiv_(updates, m, denom, step_size)
        else:
            updates = torch_private.foreach_div(m, denom)
            torch_private.foreach_mul_(updates, step_size)
        new_state = AdamState(
            t,
            tree.unflatten(treedef, m),
            tree.unflatten(treedef, v),
            None if v_max is None else tree.unflatten(treedef, v_max),
        )
        return tree.unflatten(treedef, updates), new_state

    def current_lr(state: AdamState) -> float:
        return learning_rate(lr, state.step)

    # with donate, each stacked parameter's rows and its moments' rows, kept for the next
    # update (per thread: the threads backend's ranks may share an optimizer): the new state
    # holds the same tensors, so the rows are cut once, not every step
    local = threading.local()

    def rows_of(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, fresh: dict[int, Any]) -> Any:
        kept = getattr(local, "rows", {}).get(id(p))
        if (
            kept is not None
            and kept[0] is p
            and kept[1] is m
            and kept[2] is v
            and kept[3] == (p.data_ptr(), m.data_ptr(), v.data_ptr())
        ):
            fresh[id(p)] = kept
            return kept[4:]
        cut = tuple([packed_view(r) for r in x.unbind(0)] for x in (p, m, v))
        fresh[id(p)] = (p, m, v, (p.data_ptr(), m.data_ptr(), v.data_ptr()), *cut)
        return cut

    def apply(
        grads: PyTree,
        state: AdamState,
        params: PyTree,
        donate: bool = False,
        arrival: GradArrival | None = None,
    ) -> tuple[PyTree, AdamState] | None:
        # torch's fused kernel (in place) run on fresh copies of the parameters and moments:
        # nothing passed in is modified, in about half the passes over memory of `update`; with
        # `donate`, on the buffers passed in (no copies). With `arrival` (gradients still being
        # reduced), one kernel per part, each once its part has arrived: the same elementwise
        # update, while the rest is on the wire
        treedef = tree.structure(params)
        ps: list[torch.Tensor] = treedef.flatten_up_to(params)
        gs: list[torch.Tensor] = treedef.flatten_up_to(grads)
        ms: list[torch.Tensor] = treedef.flatten_up_to(state.exp_avg)
        vs: list[torch.Tensor] = treedef.flatten_up_to(state.exp_avg_sq)
        if not (decoupled and not amsgrad and ps and _fused_ready(ps, gs, ms, vs)):
            return None
        t = state.step + 1
        new_p, new_m, new_v = (
            list(xs) if donate else list(torch_private.foreach_mul(xs, 1.0))  # copies
            for xs in (ps, ms, vs)
        )
        # the fused kernel reads each tensor's memory in order, as if contiguous: a strided
        # gradient (data parallelism's views into its flat buffer) goes in row by row, its
        # rows contiguous; a parameter packed in another order (a transposed view) goes in
        # whole with its moments, which share its strides, and a gradient brought into them,
        # or row by row where the gradient's rows are packed as the parameter's are (a
        # column-major weight of shard's matmul order and its bucket view)
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
        fresh: dict[int, Any] = {}
        for p, g, m, v in zip(new_p, gs, new_m, new_v):
            pieces: tuple[Any, ...]
            if p.is_contiguous() and m.is_contiguous() and v.is_contiguous():
                if donate and not g.is_contiguous() and by_rows(g):
                    p_rows, m_rows, v_rows = rows_of(p, m, v, fresh)
                    pieces = (p_rows, [packed_view(r) for r in g.unbind(0)], m_rows, v_rows)
                else:
                    if arrival is not None and not (g.is_contiguous() or by_rows(g)):
                        arrival.wait_for(g)  # copied now: read now
                    pieces = contiguous_pieces(p, g, m, v)
            elif m.stride() == p.stride() == v.stride() and packed(tuple(p.shape), p.stride()):
                # each piece as the 1-d view of the memory it covers: the kernel copies a
                # gradient that is not contiguous (into a copy it then never reads)
                if donate and g.stride() != p.stride() and rows_alike(p, g):
                    p_rows, m_rows, v_rows = rows_of(p, m, v, fresh)  # a column-major weight
                    pieces = (p_rows, [packed_view(r) for r in g.unbind(0)], m_rows, v_rows)
                else:
                    if g.stride() != p.stride():
                        if arrival is not None:
                            arrival.wait_for(g)  # copied now: read now
                        g = torch.empty_like(p).copy_(g)  # p's strides (empty_like keeps them)
                    pieces = tuple([packed_view(x)] for x in (p, g, m, v))
            else:  # laid out unlike each other: the unfused update, which follows strides
                return None
            for out, piece in zip(lists, pieces):
                out.extend(piece)
        if donate:
            local.rows = fresh
        # the kernel only reads the step count: one tensor per device serves every entry
        count: dict[torch.device, torch.Tensor] = {}
        for p in ps:
            if p.device not in count:
                count[p.device] = torch.full((), float(t), device=p.device)
        steps = [count[p.device] for p in lists[0]]
        kw = dict(
            lr=learning_rate(lr, state.step),
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        if arrival is not None and arrival.parts <= 1:  # one part: wait, then one kernel
            arrival.wait_all()
            arrival = None
        if arrival is None:
            torch_private.fused_adamw_(*lists, [], steps, **kw)
        else:
            # the pieces by the part their gradient lies in (-1: not in flight), each part's
            # kernel run once that part has arrived, parts in the order they were started
            parts: dict[int, list[int]] = {}
            for j, g in enumerate(lists[1]):
                parts.setdefault(arrival.part_of(g), []).append(j)
            for k in range(-1, arrival.parts):
                if k >= 0:
                    arrival.wait(k)
                js = parts.get(k)
                if js:
                    torch_private.fused_adamw_(
                        *([xs[j] for j in js] for xs in lists), [], [steps[j] for j in js], **kw
                    )
        m_tree, v_tree = tree.unflatten(treedef, new_m), tree.unflatten(treedef, new_v)
        return tree.unflatten(treedef, new_p), AdamState(t, m_tree, v_tree, None)

    hyper = AdamWHyper(lr, beta1, beta2, eps, weight_decay) if decoupled and not amsgrad else None
    return GradientTransformation(init, update, current_lr, apply, hyper, in_parts=True)


def adamw(
    lr: float | LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019) as ``torch.optim.AdamW``: decay ``p *= 1 - lr * wd``.

    ``lr`` is a number or a :data:`~colfunc.optim.LearningRate` (``Callable[[int], float]`` of
    the update count).

    Example:
        >>> opt = adamw(warmup_cosine(3e-4, warmup_steps=100, total_steps=10_000))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = apply_updates(params, updates)
    """
    return _scale_by_adam("adamw", lr, betas, eps, weight_decay, amsgrad, decoupled=True)


def adam(
    lr: float | LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) as ``torch.optim.Adam``: weight decay is L2 (``g += wd * p``)."""
    return _scale_by_adam("adam", lr, betas, eps, weight_decay, amsgrad, decoupled=False)
