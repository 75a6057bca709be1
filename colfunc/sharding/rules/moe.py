"""The experts' feed-forward (``torch.ops.colfunc.moe_ffn`` and its backward) as one op each.

Per mesh axis, one of three layouts:

- replicated: everything whole;
- tokens split (data parallelism): the tokens ``x[N, D]`` and their choices ``topi``/``topw``
  ``[N, K]`` split on N alike, the expert weights whole: each rank runs its own tokens; in the
  backward pass the weights' gradients are then partial sums over the ranks' tokens;
- expert widths split (tensor parallelism, Megatron's MLP per expert): ``w_gate``/``w_up``
  ``[E, D, F]`` on F, ``w_down`` ``[E, F, D]`` on F, the tokens whole: each rank's part of every
  expert, the output a partial sum (and in the backward pass the input and routing-weight
  gradients);
- experts split (expert parallelism): the expert weights on E, the tokens each rank's own (a
  batch axis, as ``shard(expert_axis=...)`` makes it): each rank routes its tokens, sends each
  chosen row to the rank holding its expert (an ``all_to_all_v``, the row counts exchanged
  first), runs its experts on what arrives, and sends the outputs back to be weighted and summed
  where the tokens live. The backward pass sends each row's input and output gradient out
  together, recomputes the gate and up products where the expert lives (so nothing of variable
  size is kept between the passes), and sends the input gradients back; the experts' weight
  gradients are then those of every rank's tokens on this axis, summed (their placement stays
  split: nothing is reduced over the axis afterwards).

Per MoE layer and rank, with ``s`` the rows this rank sends to the other ranks of the axis and
``r`` those it receives from them (``D`` wide, ``b`` bytes an element), the ``all_to_all_v``
bytes are ``(s + r) * D * b`` forward (rows out, outputs back) and ``(2 * s + r) * D * b``
backward (input and output gradient out, input gradient back), plus ``(n - 1) * E / n * 8`` bytes
of counts per pass (``all_to_all``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from colfunc.ops import moe as ops_moe  # (registers torch.ops.colfunc.moe_ffn)
from colfunc.sharding import comm
from colfunc.sharding.mesh import Mesh
from colfunc.sharding.placement import Partial, Shard
from colfunc.sharding.rules.registry import OpSharding, Option, R, Spec, pick, rule

P = Partial()


def _with_exchange(choice: OpSharding, w: int, spec: Spec, run: Any) -> OpSharding:
    """``choice``, computed by ``run`` (the all-to-all of the tokens) where it splits the
    experts (input ``w``, ``spec``, on dim 0) over some mesh axes."""
    assert choice.inputs is not None
    want = choice.inputs[w]
    assert want is not None
    axes = spec.axes_on(0, want)
    if not axes:
        return choice
    n, E = spec.mesh.axis_size(axes), spec.shape[0]
    if E % n:
        raise ValueError(
            f"moe_ffn: the {E} experts do not split evenly over {axes} ({n} ranks); use an "
            f"expert axis size that divides {E}"
        )
    compute = functools.partial(run, axes=axes, mesh=spec.mesh)
    return OpSharding(outputs=choice.outputs, inputs=choice.inputs, compute=compute)


@rule(torch.ops.colfunc.moe_ffn.default)
def moe_ffn(
    x: Spec, topi: Spec, topw: Spec, wg: Spec, wu: Spec, wd: Spec, capacity: float = 0.0
) -> OpSharding:
    # outputs: y [N, D]; kept for the backward pass the gate and up products [M, F] and the
    # experts' outputs [M, D] (M = N * K rows, sorted by expert); each expert's count of rows
    # (a rank's own tokens' counts: summed over the ranks of a data-parallel split)
    S0, S1 = Shard(0), Shard(1)
    options: list[Option] = [
        ((R, R, R, R, R), (R, R, R, R, R, R)),
        ((S0, S0, S0, S0, P), (S0, S0, S0, R, R, R)),
        ((P, S1, S1, P, R), (R, R, R, Shard(2), Shard(2), Shard(1))),
        ((R, R, R, R, R), (R, R, R, S0, S0, S0)),  # experts split (expert parallelism)
    ]
    M, Fw = topi.numel, wg.shape[2]
    sizes = (x.numel, M * Fw, M * Fw, M * x.shape[1], wg.shape[0])
    choice = pick([x, topi, topw, wg, wu, wd], options, out_numel=sizes)
    return _with_exchange(choice, 3, wg, _ep_forward)


@rule(torch.ops.colfunc.moe_ffn_backward.default)
def moe_ffn_backward(
    dy: Spec, x: Spec, topi: Spec, topw: Spec, wg: Spec, wu: Spec, wd: Spec,
    a: Spec, b: Spec, o: Spec, capacity: float = 0.0,
) -> OpSharding:  # fmt: skip
    S0, S1 = Shard(0), Shard(1)
    options: list[Option] = [
        ((R, R, R, R, R), (R, R, R, R, R, R, R, R, R, R)),
        ((S0, S0, P, P, P), (S0, S0, S0, S0, R, R, R, S0, S0, S0)),
        (
            (P, P, Shard(2), Shard(2), Shard(1)),
            (R, R, R, R, Shard(2), Shard(2), Shard(1), S1, S1, P),
        ),
        ((R, R, S0, S0, S0), (R, R, R, R, S0, S0, S0, R, R, R)),  # experts split
    ]
    sizes = (x.numel, topw.numel, wg.numel, wu.numel, wd.numel)
    choice = pick([dy, x, topi, topw, wg, wu, wd, a, b, o], options, out_numel=sizes)
    return _with_exchange(choice, 4, wg, _ep_backward)


# --- expert parallelism, on this rank's local tensors -------------------------------------------


Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # an MoE layer's gate, up and down


class Exchange:
    """One MoE layer's traffic over the expert axes: this rank's chosen rows (sorted by expert,
    so each rank's share is contiguous) go out in ``send`` sizes; ``recv`` rows arrive, from
    each source sorted by expert, and ``order`` sorts them by local expert (sources in order
    within one), ``sizes`` rows each. Built from this rank's ``counts_E`` (of every expert on
    the axes), which it exchanges first."""

    def __init__(self, counts_E: torch.Tensor, axes: tuple[str, ...], mesh: Mesh) -> None:
        n = mesh.axis_size(axes)
        L = counts_E.numel() // n
        self.axes, self.mesh = axes, mesh
        self.send = counts_E.view(n, L).sum(1).tolist()
        got_nL = comm.all_to_all(counts_E, axes, 0, 0, mesh).view(n, L)  # counts exchanged first
        self.recv = got_nL.sum(1).tolist()
        self.sizes: list[int] = got_nL.sum(0).tolist()
        expert = torch.arange(L, device=counts_E.device).repeat(n)
        self.order = torch.argsort(expert.repeat_interleave(got_nL.reshape(-1)), stable=True)

    def out(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows to their experts' ranks; what arrives, sorted by local expert."""
        got = comm.all_to_all_v(rows, self.axes, self.send, self.recv, self.mesh)
        return got.index_select(0, self.order)

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert back to the ranks they came from, in their order."""
        unsorted = torch.empty_like(rows).index_copy_(0, self.order, rows)
        return comm.all_to_all_v(unsorted, self.axes, self.recv, self.send, self.mesh)


def exchanged_forward(
    ex: Exchange, x: torch.Tensor, topw: torch.Tensor, picks: torch.Tensor,
    tokens: torch.Tensor, ws: Weights, sizes: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The layer's output ``[N, D]`` and its chosen rows' expert outputs ``[M, D]`` (sorted by
    expert), the rows run by the local experts ``ws`` (gate, up, down), ``sizes`` rows each, in
    the order of ``ex.sizes`` (experts that receive no row may be left out of both)."""
    x_M = ex.out(x.index_select(0, tokens))
    if ws[0].shape[0]:
        o_R = ops_moe.experts_forward(x_M, ws[0], ws[1], ws[2], sizes)[2]
    else:  # (no row came: the exchange back still runs, on every rank)
        o_R = x_M.new_zeros(0, x.shape[1])
    o_M = ex.back(o_R)
    return ops_moe.weighted_sum(o_M, x, topw, picks, tokens), o_M


def exchanged_backward(
    ex: Exchange, dy: torch.Tensor, x: torch.Tensor, topw: torch.Tensor, picks: torch.Tensor,
    tokens: torch.Tensor, o_M: torch.Tensor, ws: Weights, sizes: list[int],
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The backward pass of :func:`exchanged_forward`: the gradients of ``x``, ``topw`` and the
    local experts ``ws``, the rows' input and output gradients sent out together and the gate
    and up products recomputed where the experts live."""
    dg_M, do_M = ops_moe.output_grads(dy, topw, picks, tokens, o_M)
    x_M = x.index_select(0, tokens)
    if x_M.dtype == do_M.dtype:  # both in one exchange
        x_R, do_R = ex.out(torch.cat([x_M, do_M], 1)).split([x.shape[1], do_M.shape[1]], 1)
    else:
        x_R, do_R = ex.out(x_M), ex.out(do_M)
    if ws[0].shape[0]:
        wg, wu, wd = ws
        a_R = ops_moe._grouped(x_R, wg, sizes)
        b_R = ops_moe._grouped(x_R, wu, sizes)
        dx_R, *dws = ops_moe.experts_backward(x_R, do_R, wg, wu, wd, sizes, a_R, b_R)
    else:
        dx_R, dws = x_R.new_zeros(0, x.shape[1]), [torch.zeros_like(w) for w in ws]
    dx, dtopw = ops_moe.input_grads(ex.back(dx_R), dg_M, x, topw, picks, tokens)
    return dx, dtopw, *dws


def _ep_forward(
    x: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor,
    wd: torch.Tensor, capacity: float = 0.0, *, axes: tuple[str, ...], mesh: Mesh,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    picks, tokens, _, counts = ops_moe.routed(topi, wg.shape[0] * mesh.axis_size(axes), capacity)
    ex = Exchange(counts, axes, mesh)
    y, o_M = exchanged_forward(ex, x, topw, picks, tokens, (wg, wu, wd), ex.sizes)
    # the gate and up products are recomputed where the experts live in the backward pass:
    # in their place, zeros of their shape that take no memory
    nothing = x.new_zeros(()).expand(topi.numel(), wg.shape[2])
    return y, nothing, nothing, ops_moe.padded(o_M, topi.numel()), counts


def _ep_backward(
    dy: torch.Tensor, x: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor, wg: torch.Tensor,
    wu: torch.Tensor, wd: torch.Tensor, a: torch.Tensor, b: torch.Tensor, o: torch.Tensor,
    capacity: float = 0.0, *, axes: tuple[str, ...], mesh: Mesh,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    picks, tokens, _, counts = ops_moe.routed(topi, wg.shape[0] * mesh.axis_size(axes), capacity)
    ex = Exchange(counts, axes, mesh)
    ws = (wg, wu, wd)
    return exchanged_backward(ex, dy, x, topw, picks, tokens, o[: picks.numel()], ws, ex.sizes)
