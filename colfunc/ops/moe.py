"""Mixture-of-experts ops: the grouped matmul and the experts' feed-forward over routed tokens.

:func:`grouped_matmul` multiplies rows sorted by expert by their expert's weight: ``x[N, I]``
(the rows of expert 0, then expert 1, ...), ``w[E, I, O]``, ``counts[E]`` rows each. On the CPU
(and as the reference) it is PyTorch's grouped matmul where it takes the inputs, else one
matmul per expert's block of rows, and differentiated its backward is written out (the grouped
product with each ``w[e].T``, and each block's ``x_e.T @ dy_e``); on CUDA tensors the Triton
kernel (:mod:`colfunc.kernels.grouped_matmul`) runs every block in one launch.

:func:`moe_ffn` is the experts' part of a sparse MLP: each token ``t`` and each of its ``k``
choices ``(e, g)`` (``topi[t]``, ``topw[t]``) adds ``g * down_e(act(x_t gate_e) * (x_t up_e))``.
The tokens' choices are flattened, sorted by expert (a stable sort: equal experts keep the
tokens' order), each expert's rows run through :func:`grouped_matmul`, and the results are
scattered back and summed per token. The forward pass keeps the gate and up products and each
row's expert output for the backward pass, which computes their gradients, written out. It is one operator (``torch.ops.colfunc.moe_ffn``, with its
backward ``moe_ffn_backward``), so that a ShardedTensor sees one op with one sharding rule
(:mod:`colfunc.sharding.rules.moe`: tokens split over data-parallel ranks, expert widths over
tensor-parallel ones), never the data-dependent sort inside.

Legend: N tokens, K choices per token, E experts, D width, F expert width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from colfunc import torch_private
from colfunc.kernels import checks

__all__ = [
    "RoutedExperts",
    "compact",
    "experts_backward",
    "experts_forward",
    "grouped_matmul",
    "moe_ffn",
    "routed",
]


class RoutedExperts:
    """An expert weight ``[E, ...]`` (``shape``, ``dtype``, ``device``) that is not at hand
    whole: :func:`moe_ffn` given three of these (gate, up, down) of one ``layer`` calls
    ``layer.run(x, topi, topw, capacity, weights)`` for the experts' output and counts, which
    fetches only the experts the tokens are routed to (``offload``'s host-homed experts). Any
    other use of it fails, naming it."""

    def __init__(self, layer: Any, leaf: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.layer, self.leaf = layer, leaf
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device

    def __repr__(self) -> str:
        return f"RoutedExperts(leaf={self.leaf}, shape={tuple(self.shape)}, dtype={self.dtype})"


def compact(
    topi_NK: torch.Tensor, n_experts: int, capacity: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The experts ``topi`` routes to (sorted), ``topi`` as indices into them, and the capacity
    factor that gives each of them the capacity it has among all ``n_experts``: what
    :func:`moe_ffn` of only those experts' weights computes the same with."""
    used = torch.unique(topi_NK)
    topi_c = torch.searchsorted(used, topi_NK)
    if capacity <= 0:
        return used, topi_c, capacity
    N, K = topi_NK.shape
    cap = math.ceil(capacity * N * K / n_experts)  # (as routed() takes it)
    # ceil((cap - 1/2) * n / (N K) * N K / n) = cap: half a choice of room for rounding
    return used, topi_c, (cap - 0.5) * used.numel() / (N * K)


def _counts_list(counts: torch.Tensor | Sequence[int], n_rows: int, n_experts: int) -> list[int]:
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    if len(sizes) != n_experts:
        raise ValueError(f"grouped_matmul: counts has {len(sizes)} entries for {n_experts} experts")
    if any(c < 0 for c in sizes) or sum(sizes) != n_rows:
        raise ValueError(
            f"grouped_matmul: counts {sizes} must be >= 0 and sum to the {n_rows} rows of x"
        )
    return sizes


def grouped_matmul(
    x_NI: torch.Tensor, w_EIO: torch.Tensor, counts: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``x[N, I]`` (rows sorted by expert, ``counts[e]`` rows of expert ``e``) times each row's
    expert weight ``w[e]`` (``[E, I, O]``): ``[N, O]``. Differentiable."""
    if x_NI.dim() != 2 or w_EIO.dim() != 3 or x_NI.shape[1] != w_EIO.shape[1]:
        raise ValueError(
            f"grouped_matmul: x must be [N, I] and w [E, I, O] with the same I, got "
            f"{tuple(x_NI.shape)} and {tuple(w_EIO.shape)}"
        )
    sizes = _counts_list(counts, x_NI.shape[0], w_EIO.shape[0])
    differentiated = torch.is_grad_enabled() and (x_NI.requires_grad or w_EIO.requires_grad)
    plain = type(x_NI) is torch.Tensor and type(w_EIO) is torch.Tensor and not x_NI.is_cuda
    if differentiated and plain and not torch_private.are_functorch_transforms_active():
        out: torch.Tensor = _GroupedCPU.apply(x_NI, w_EIO, sizes)
        return out
    return _grouped(x_NI, w_EIO, sizes, fused=not differentiated)


class _GroupedCPU(torch.autograd.Function):
    """:func:`grouped_matmul` of plain CPU tensors with its backward written out: ``dx`` by the
    grouped product with each ``w[e].T``, ``dw[e] = x_e.T @ dy_e`` (autograd through one matmul
    per block would add every block's ``w[e]`` gradient into a zero tensor of all of ``w``)."""

    @staticmethod
    def forward(ctx: Any, x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: list[int]) -> Any:
        ctx.save_for_backward(x_NI, w_EIO)
        ctx.sizes = sizes
        return _blocks(x_NI, w_EIO, sizes, fused=True)

    @staticmethod
    def backward(ctx: Any, dy_NO: torch.Tensor) -> Any:
        x_NI, w_EIO = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        dx = _blocks(dy_NO, w_EIO.transpose(1, 2), ctx.sizes, fused=True)
        dw = _weight_grads(x_NI, dy_NO, ctx.sizes, w_EIO)
        return (
            (dx if ctx.needs_input_grad[0] else None),
            (dw if ctx.needs_input_grad[1] else None),
            None,
        )


def _grouped(
    x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: list[int], fused: bool = True
) -> torch.Tensor:
    """The Triton kernel where it applies, else :func:`_blocks` (``fused``: by PyTorch's grouped
    matmul where it takes the inputs; it is not differentiated)."""
    from colfunc.ops import dispatch  # (not at import: dispatch imports the kernels' checks)

    check = lambda: checks.grouped_matmul(x_NI, w_EIO, sizes)  # noqa: E731
    if dispatch._use_triton("grouped_matmul", check, (x_NI, w_EIO)):
        out: torch.Tensor = dispatch._kernel("grouped_matmul").grouped_matmul(x_NI, w_EIO, sizes)
        return out
    return _blocks(x_NI, w_EIO, sizes, fused)


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Strides (and the output's rows) in multiples of 16 bytes, as PyTorch's grouped matmul
    needs them."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
        for t in tensors
    )


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
    """PyTorch's grouped matmul of plain CPU tensors of the dtypes and alignments it takes (x
    ``[N, I]`` with w ``[E, I, O]``, or ``[I, N]`` with ``[N, O]`` for each block's
    ``x.T @ dy``), not differentiated; else None."""
    plain = type(x) is torch.Tensor and type(w) is torch.Tensor and not x.is_cuda
    if not (plain and x.dtype in _GROUPED_DTYPES and w.dtype == x.dtype and sum(sizes) > 0):
        return None
    if w.shape[-1] * w.element_size() % 16 or not _aligned(x, w):
        return None
    if torch_private.are_functorch_transforms_active():
        return None
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    out: torch.Tensor = torch_private.get("grouped_mm")(x, w, offs=offs)
    return out


def _blocks(
    x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: list[int], fused: bool = False
) -> torch.Tensor:
    """The CPU path and the reference: one matmul per expert's block of rows (experts with none
    skipped); with ``fused``, by PyTorch's grouped matmul where it takes the inputs."""
    whole = _grouped_mm(x_NI, w_EIO, sizes) if fused else None
    if whole is not None:
        return whole
    pieces = x_NI.split(sizes)
    out = [p @ w_EIO[e] for e, p in enumerate(pieces) if sizes[e]]
    if not out:  # (no rows: an empty product, still of the inputs)
        return x_NI @ w_EIO[0]
    return torch.cat(out)


def routed(
    topi_NK: torch.Tensor, n_experts: int, capacity: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """``(picks, tokens, sizes, counts)``: the choices an expert runs, sorted by expert and
    within it by priority (every token's first choice before any second choice, then token
    order, as Switch Transformer and GShard rank them): each one's index into ``topi.reshape(-1)``
    and its token; each expert's number of them; and as a tensor, how many each expert runs.
    ``capacity > 0``: an expert runs at most ``ceil(capacity * N * K / E)`` choices, the rest
    (the lowest in priority) are dropped: ``picks`` and ``tokens`` leave them out."""
    N, K = topi_NK.shape
    flat = topi_NK.t().reshape(-1)  # choice-major: q = j * N + t
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    if capacity > 0:  # each expert's choices past its capacity dropped
        cap = math.ceil(capacity * N * K / n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
        order = order[rank < cap]
        counts = counts.clamp(max=cap)
    tokens = order % N
    return tokens * K + order // N, tokens, counts.tolist(), counts


def _moe_plain(
    x_ND: torch.Tensor,
    topi_NK: torch.Tensor,
    topw_NK: torch.Tensor,
    w_gate_EDF: torch.Tensor,
    w_up_EDF: torch.Tensor,
    w_down_EFD: torch.Tensor,
    capacity: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output, and what the backward pass reads: the gate and up products and each row's
    expert output, rows sorted by expert (M = N * K, less the dropped); and each expert's
    count of rows."""
    picks, tokens, sizes, counts = routed(topi_NK, w_gate_EDF.shape[0], capacity)
    x_MD = x_ND.index_select(0, tokens)
    a_MF, b_MF, o_MD = experts_forward(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, sizes)
    y_ND = weighted_sum(o_MD, x_ND, topw_NK, picks, tokens)
    # (kept for the backward pass at the full N * K rows, the dropped ones zero: a fixed shape)
    a_MF, b_MF, o_MD = (padded(t, topi_NK.numel()) for t in (a_MF, b_MF, o_MD))
    return y_ND, a_MF, b_MF, o_MD, counts


def weighted_sum(
    o_MD: torch.Tensor, x_ND: torch.Tensor, topw_NK: torch.Tensor, picks: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Each token's kept choices' expert outputs ``o`` weighted by their routing weights and
    summed (in ``x``'s dtype): ``[N, D]``."""
    y_MD = o_MD * topw_NK.reshape(-1).index_select(0, picks)[:, None].to(o_MD.dtype)
    return torch.zeros_like(x_ND).index_add_(0, tokens, y_MD.to(x_ND.dtype))


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    pad = rows - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def output_grads(
    dy_ND: torch.Tensor, topw_NK: torch.Tensor, picks: torch.Tensor, tokens: torch.Tensor,
    o_MD: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """From the tokens' output gradient, each kept choice's routing-weight gradient and its
    expert output's gradient (in the experts' dtype)."""
    g_M = topw_NK.reshape(-1).index_select(0, picks)
    dy_MD = dy_ND.index_select(0, tokens).to(o_MD.dtype)
    return (o_MD * dy_MD).sum(-1), dy_MD * g_M[:, None].to(o_MD.dtype)


def input_grads(
    dx_MD: torch.Tensor, dg_M: torch.Tensor, x_ND: torch.Tensor, topw_NK: torch.Tensor,
    picks: torch.Tensor, tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The tokens' input gradient (each choice's rows summed) and the routing weights'."""
    dx = torch.zeros_like(x_ND).index_add_(0, tokens, dx_MD.to(x_ND.dtype))
    dtopw = torch.zeros(topw_NK.numel(), dtype=topw_NK.dtype, device=topw_NK.device)
    return dx, dtopw.index_copy_(0, picks, dg_M.to(topw_NK.dtype)).reshape(topw_NK.shape)


@torch.library.custom_op("colfunc::moe_ffn", mutates_args=())
def _moe_ffn_op(
    x: torch.Tensor,
    topi: torch.Tensor,
    topw: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    capacity: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _moe_plain(x, topi, topw, w_gate, w_up, w_down, capacity)


@_moe_ffn_op.register_fake
def _(
    x: torch.Tensor,
    topi: torch.Tensor,
    topw: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    capacity: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    M, Fw = topi.numel(), w_gate.shape[2]
    counts = topi.new_empty(w_gate.shape[0], dtype=torch.int64)
    return (torch.empty_like(x), x.new_empty(M, Fw), x.new_empty(M, Fw), x.new_empty(M, x.shape[1]), counts)  # fmt: skip


@torch.library.custom_op("colfunc::moe_ffn_backward", mutates_args=())
def _moe_ffn_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    topi: torch.Tensor,
    topw: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    a_M: torch.Tensor,
    b_M: torch.Tensor,
    o_M: torch.Tensor,
    capacity: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the gradients of the forward's products (kept from the forward pass), written out
    picks, tokens, sizes, _ = routed(topi, w_gate.shape[0], capacity)
    kept = picks.numel()  # (the kept products: the dropped rows past them are zeros)
    a_M, b_M, o_M = a_M[:kept], b_M[:kept], o_M[:kept]
    dg_M, do_M = output_grads(dy, topw, picks, tokens, o_M)
    x_M = x.index_select(0, tokens)
    dx_M, dwg, dwu, dwd = experts_backward(x_M, do_M, w_gate, w_up, w_down, sizes, a_M, b_M)
    dx, dtopw = input_grads(dx_M, dg_M, x, topw, picks, tokens)
    return dx, dtopw, dwg, dwu, dwd


def experts_forward(
    x_MD: torch.Tensor,
    w_gate_EDF: torch.Tensor,
    w_up_EDF: torch.Tensor,
    w_down_EFD: torch.Tensor,
    sizes: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' SwiGLU of rows sorted by expert (``sizes[e]`` rows of expert ``e``): the
    gate and up products and each row's output."""
    a_MF = _grouped(x_MD, w_gate_EDF, sizes)
    b_MF = _grouped(x_MD, w_up_EDF, sizes)
    return a_MF, b_MF, _grouped(F.silu(a_MF) * b_MF, w_down_EFD, sizes)


def experts_backward(
    x_MD: torch.Tensor,
    do_MD: torch.Tensor,
    w_gate_EDF: torch.Tensor,
    w_up_EDF: torch.Tensor,
    w_down_EFD: torch.Tensor,
    sizes: list[int],
    a_MF: torch.Tensor,
    b_MF: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`experts_forward`'s backward, written out: from the rows' output gradients
    ``do`` (and the gate and up products it kept), the rows' input gradients and each expert's
    weight gradients."""
    s_MF = F.silu(a_MF)
    h_MF = s_MF * b_MF
    dh_MF = _grouped(do_MD, w_down_EFD.transpose(1, 2), sizes)
    db_MF = dh_MF * s_MF
    # silu's derivative sig * (1 + a * (1 - sig)) applied by its own fused kernel
    da_MF = torch.ops.aten.silu_backward(dh_MF * b_MF, a_MF)
    dx_MD = _grouped(da_MF, w_gate_EDF.transpose(1, 2), sizes) + _grouped(
        db_MF, w_up_EDF.transpose(1, 2), sizes
    )
    return (dx_MD, _weight_grads(x_MD, da_MF, sizes, w_gate_EDF),
            _weight_grads(x_MD, db_MF, sizes, w_up_EDF),
            _weight_grads(h_MF, do_MD, sizes, w_down_EFD))  # fmt: skip


def _weight_grads(
    x_MI: torch.Tensor, dy_MO: torch.Tensor, sizes: list[int], like: torch.Tensor
) -> torch.Tensor:
    """Each expert's ``x_e.T @ dy_e`` (``[E, I, O]``, zero for an expert with no rows)."""
    fused = _grouped_mm(x_MI.t(), dy_MO, sizes)
    if fused is not None:
        return fused.to(like.dtype)
    out = torch.zeros_like(like)
    for e, (xe, de) in enumerate(zip(x_MI.split(sizes), dy_MO.split(sizes))):
        if sizes[e]:
            out[e] = xe.t() @ de
    return out


@_moe_ffn_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor,
      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
      *saved: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
    return (torch.empty_like(x), torch.empty_like(topw), torch.empty_like(w_gate),
            torch.empty_like(w_up), torch.empty_like(w_down))  # fmt: skip


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.save_for_backward(*inputs[:6], *output[1:4])
    ctx.capacity = inputs[6]


def _backward(ctx: Any, dy: torch.Tensor, *unused: torch.Tensor | None) -> tuple[Any, ...]:
    x, topi, topw, w_gate, w_up, w_down, a, b, o = ctx.saved_tensors
    dx, dtopw, dg, du, dd = torch.ops.colfunc.moe_ffn_backward(
        dy, x, topi, topw, w_gate, w_up, w_down, a, b, o, ctx.capacity
    )
    return dx, None, dtopw, dg, du, dd, None


_moe_ffn_op.register_autograd(_backward, setup_context=_setup)


def moe_ffn(
    x_ND: torch.Tensor,
    topi_NK: torch.Tensor,
    topw_NK: torch.Tensor,
    w_gate_EDF: torch.Tensor,
    w_up_EDF: torch.Tensor,
    w_down_EFD: torch.Tensor,
    capacity: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' SwiGLU feed-forward of each token, weighted by its routing weights and
    summed over its ``K`` choices: ``[N, D]`` (see the module docstring); and how many choices
    each expert ran (``[E]``, int64). ``topi[N, K]`` holds expert indices in ``[0, E)``;
    ``topw[N, K]`` their weights (any float dtype: the products are taken in it and summed in
    ``x``'s). ``capacity`` (a number > 0): each expert runs at most ``ceil(capacity * N * K /
    E)`` choices, by priority (every first choice before any second, then token order); the
    others are dropped (they add nothing). None: dropless."""
    E = w_gate_EDF.shape[0]
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    away = [isinstance(w, RoutedExperts) for w in weights]
    layers = {id(w.layer) for w in weights if isinstance(w, RoutedExperts)}
    if any(away) and not (all(away) and len(layers) == 1):
        raise TypeError(
            f"moe_ffn: expert weights fetched when routed to (RoutedExperts) come as the three "
            f"of one layer, got {[type(w).__name__ for w in weights]}"
        )
    if topi_NK.dim() != 2 or topi_NK.shape != topw_NK.shape or topi_NK.shape[0] != x_ND.shape[0]:
        raise ValueError(
            f"moe_ffn: topi and topw must both be [N, K] with N = {x_ND.shape[0]} tokens, got "
            f"{tuple(topi_NK.shape)} and {tuple(topw_NK.shape)}"
        )
    shapes = (tuple(w_gate_EDF.shape), tuple(w_up_EDF.shape), tuple(w_down_EFD.shape))
    D = x_ND.shape[1]
    if shapes[0] != shapes[1] or shapes[0][1] != D or shapes[2] != (E, shapes[0][2], D):
        raise ValueError(
            f"moe_ffn: expert weights must be gate/up [E, D, F] and down [E, F, D] with D = {D}, "
            f"got {shapes}"
        )
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int | float) or not capacity > 0
    ):
        raise ValueError(
            f"moe_ffn: capacity must be None (dropless) or a number > 0, got {capacity!r}"
        )
    if all(away):
        layer = cast(RoutedExperts, w_gate_EDF).layer
        y, counts = layer.run(x_ND, topi_NK, topw_NK, float(capacity or 0.0), weights)
        return y, counts
    out = torch.ops.colfunc.moe_ffn(
        x_ND, topi_NK, topw_NK, w_gate_EDF, w_up_EDF, w_down_EFD, float(capacity or 0.0)
    )
    return out[0], out[4]  # (the others are what the backward pass reads)
