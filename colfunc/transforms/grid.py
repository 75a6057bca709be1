"""Tensor parallelism in 2D, 2.5D and 3D: layouts on a grid of mesh axes, and their matmuls.

1D tensor parallelism (Megatron-LM) splits each weight over one axis and keeps activations
whole. The multi-dimensional modes split the activations too, so that parameters *and*
activations shrink with the number of ranks. Each is a layout on named mesh axes, innermost in
the mesh (a tensor-parallel group is contiguous in rank order, as in ColossalAI), plus the
matmul the layout needs, which :class:`GridLinear` runs in place of :func:`colfunc.nn.linear`
for the weights laid out for it. Every other op (norms, attention, embeddings, the loss) goes
through the propagation rules on the same placements, so no model code changes.

- ``1d``: ``tp`` (P ranks); activations whole; weights split by in or out features.
- ``2d``: ``tp_row`` x ``tp_col`` (q x q); the batch over row, the width over col; weights' in
  features over row, out features over col.
- ``2.5d``: ``tp_dep`` x ``tp_row`` x ``tp_col`` (d x q x q); the batch over (dep, row), the width
  over col; weights as 2D, held whole on every depth.
- ``3d``: ``tp_z`` x ``tp_y`` x ``tp_x`` (q x q x q); the batch over (y, x) and the width over z,
  inside attention and the MLP the batch over (z, x) and the width over y; column-parallel
  weights' in features over (z, x) and out over y, row-parallel ones' in over (y, x), out over z.

**2D (Optimus; SUMMA, arXiv 2104.05343).** Rank (i, j) of the q x q grid holds block (i, j) of the
activation ``X`` (rows: the batch) and of each weight ``W`` (rows: in-features). ``Y = X W`` is q
steps: in step l, column l broadcasts its ``X[:, l]`` blocks along each grid row, row l broadcasts
its ``W[l, :]`` blocks along each grid column, and every rank adds the product of what it got.
The backward runs SUMMA's two transposed forms: ``dX = dY W^T`` broadcasts ``W`` along columns and
reduces each product to its owner along rows; ``dW = X^T dY`` broadcasts ``X`` along rows and
reduces along columns. Only the local blocks are kept for the backward.

**2.5D (Tesseract, arXiv 2105.14500).** d grids of q x q stacked over ``tp_dep``: the batch is
split over the d*q (dep, row) pairs, each depth runs 2D's SUMMA on its part, and a weight's
gradient is summed over the depths (the weights are held whole on each depth, as in the paper
and ColossalAI: parameters take Ψ/q² per rank, activations 1/(d q²)).

**3D (arXiv 2105.14450).** Rank (i, j, k) of the q x q x q cube (``tp_x`` = i, ``tp_y`` = j,
``tp_z`` = k) computes ``C[i, j] += A[i, k] B[k, j]``: ``A`` is all-gathered over its input axis,
the weight over ``tp_x`` (its shards are split q² ways), and the product is reduce-scattered over
the output axis. The output's layout is the next layer's input layout with the input and output
axes swapped (ColossalAI's ``swap_in_out_group``), so a block's column-parallel layers (q, k, v,
the MLP's first) run with input axis ``tp_y`` and output axis ``tp_z``, its row-parallel layers
(the attention and MLP outputs) the other way round, and the residual stream keeps one layout:
no redistribution between layers. Parameters and activations both take 1/q³: the backward
gathers the input and the weight again (all-gathers the output's gradient, reduce-scatters the
input's and the weight's) rather than keeping them gathered, as ColossalAI's ``_Linear3D`` does
at q times the memory.

The rank layout of each mode's groups is ColossalAI's (``colossalai/legacy/context/
process_group_initializer``): on a mesh ``{..., "tp_row": q, "tp_col": q}`` the ``tp_col`` groups
are its ``PARALLEL_2D_ROW`` groups and the ``tp_row`` groups its ``PARALLEL_2D_COL``; for 2.5D
``tp_col``, ``tp_row`` and ``tp_dep`` are ``PARALLEL_2P5D_ROW``, ``_COL`` and ``_DEP``; for 3D
``tp_y``, ``tp_x`` and ``tp_z`` are ``PARALLEL_3D_INPUT``, ``_WEIGHT`` and ``_OUTPUT``.

A model gives one description of its layers to :func:`colfunc.nn.tensor_plans` (which weights
are column- and row-parallel, which vectors run along its width, which tables hold the
vocabulary) and gets a plan per mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from colfunc import tree
from colfunc.nn.plans import AXES, MODES, check_mode, grid_axes
from colfunc.sharding import Mesh, ShardedTensor, comm, distribute, from_local
from colfunc.sharding.placement import Placement, Replicate, Shard

__all__ = ["AXES", "MODES", "GridLayout", "GridLinear", "grid_axes", "split_batch"]

PyTree = Any


# --- the layout on a mesh ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GridLayout:
    """A multi-dimensional mode's axes on a mesh (see the module docs)."""

    mode: str
    mesh: Mesh

    @classmethod
    def make(cls, mode: str, mesh: Mesh) -> GridLayout:
        mode = check_mode(mode)
        if mode == "1d":
            raise ValueError("GridLayout is for the modes '2d', '2.5d' and '3d'")
        missing = [a for a in AXES[mode] if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"tensor mode {mode!r} runs on mesh axes {AXES[mode]}; the mesh {mesh.shape} "
                f"lacks {missing}. Build the mesh with colfunc.transforms.grid.grid_axes"
            )
        names = [a for a in mesh.axis_names if a in AXES[mode]]
        if tuple(names) != AXES[mode]:
            raise ValueError(
                f"tensor mode {mode!r}: the mesh must order its axes {AXES[mode]}, got {names}"
            )
        sizes = {a: mesh.axis_size(a) for a in AXES[mode]}
        q = sizes[AXES[mode][-1]]
        if any(sizes[a] != q for a in AXES[mode] if a != "tp_dep"):
            raise ValueError(
                f"tensor mode {mode!r} needs equal sizes on {[a for a in AXES[mode] if a != 'tp_dep']}, "
                f"got {sizes}"
            )
        return cls(mode, mesh)

    @property
    def q(self) -> int:
        return self.mesh.axis_size(AXES[self.mode][-1])

    @property
    def depth(self) -> int:
        return self.mesh.axis_size("tp_dep") if self.mode == "2.5d" else 1

    @property
    def size(self) -> int:
        return self.mesh.axis_size(AXES[self.mode])

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes that split the batch (dim 0) of the model's input, major first."""
        return {"2d": ("tp_row",), "2.5d": ("tp_dep", "tp_row"), "3d": ("tp_y", "tp_x")}[self.mode]

    @property
    def batch_ranks(self) -> int:
        return self.mesh.axis_size(self.batch_axes)

    def placements(self, ndim: int, batch: Sequence[str], hidden: str | None) -> tuple[Any, ...]:
        """Dim 0 split over ``batch``, the last dim over ``hidden``, the rest replicated."""
        out: list[Placement] = []
        for a in self.mesh.axis_names:
            if a in batch:
                out.append(Shard(0))
            elif a == hidden:
                out.append(Shard(ndim - 1))
            else:
                out.append(Replicate())
        return tuple(out)


def split_batch(batch: PyTree, layout: GridLayout) -> PyTree:
    """Every batch tensor (of one or more dims) as a ShardedTensor split on dim 0 over the
    layout's batch axes; ValueError when its rows do not divide."""
    n = layout.batch_ranks

    def split(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] % n:
            raise ValueError(
                f"shard: tensor mode {layout.mode!r} splits the batch over {layout.batch_axes} "
                f"({n} ranks); batch entry {path!r} has {x.shape[0]} rows on this data-parallel "
                f"rank: use a batch size that is a multiple of {n} per data-parallel rank"
            )
        pl = [Shard(0) if a in layout.batch_axes else Replicate() for a in layout.mesh.axis_names]
        return distribute(x, layout.mesh, pl)

    return tree.map_with_path(split, batch)


# --- the matmuls -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Summa:
    """SUMMA on one q x q grid: ``row`` (the axis along which a grid column runs) and ``col``."""

    mesh: Mesh
    row: str
    col: str
    q: int
    depth: str | None  # 2.5D: the weight gradient is summed over this axis

    def ab(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = None
        for l in range(self.q):  # noqa: E741
            a = comm.broadcast(x, self.col, l, self.mesh)
            b = comm.broadcast(w, self.row, l, self.mesh)
            # out of place: selective remat caches matmul outputs and refuses their mutation
            out = a @ b if out is None else torch.addmm(out, a, b)
        assert out is not None
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` on the grid's local blocks, differentiable."""
        out: torch.Tensor = _SummaMatmul.apply(x, w, self)
        return out

    def _to_owners(self, along: str, part: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """Step l reduces ``part(l)`` along ``along`` to index l; this rank keeps its own."""
        mine = self.mesh.axis_index(along)
        out = None
        for l in range(self.q):  # noqa: E741
            reduced = comm.reduce(part(l), along, l, self.mesh)
            if l == mine:
                out = reduced
        assert out is not None
        return out

    def abt(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dX = dY W^T``: block (i, l) = sum_j dY(i, j) W(l, j)^T, reduced to column l."""
        return self._to_owners(
            self.col, lambda step: g @ comm.broadcast(w, self.row, step, self.mesh).t()
        )

    def atb(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``dW = X^T dY``: block (l, j) = sum_i X(i, l)^T dY(i, j), reduced to row l."""
        out = self._to_owners(
            self.row, lambda step: comm.broadcast(x, self.col, step, self.mesh).t() @ g
        )
        if self.depth is not None and self.mesh.axis_size(self.depth) > 1:
            out = comm.all_reduce(out, self.depth, "sum", self.mesh)
        return out


class _SummaMatmul(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, grid: _Summa) -> torch.Tensor:
        return grid.ab(x, w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, ctx.grid = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = ctx.grid.abt(g, w) if ctx.needs_input_grad[0] else None
        dw = ctx.grid.atb(x, g) if ctx.needs_input_grad[1] else None
        return dx, dw, None


@dataclasses.dataclass(frozen=True)
class _Cube:
    """The 3D matmul of one layer: gathers over ``inp`` (activations) and ``weight``, reduce-
    scatter over ``out``."""

    mesh: Mesh
    inp: str
    weight: str
    out: str

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` on the cube's local blocks, differentiable."""
        y: torch.Tensor = _CubeMatmul.apply(x, w, self)
        return y


class _CubeMatmul(torch.autograd.Function):
    """Saves only the local blocks (1/q³ of each activation) and gathers them again in the
    backward, which ColossalAI's ``_Linear3D`` saves gathered (q times the memory, two
    all_gathers fewer)."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, cube: _Cube) -> torch.Tensor:
        xg = comm.all_gather(x, cube.inp, 0, cube.mesh)
        wg = comm.all_gather(w, cube.weight, 0, cube.mesh)
        return comm.reduce_scatter(xg @ wg, cube.out, 0, "sum", cube.mesh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, ctx.cube = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        cube: _Cube = ctx.cube
        gg = comm.all_gather(g.contiguous(), cube.out, 0, cube.mesh)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wg = comm.all_gather(w, cube.weight, 0, cube.mesh)
            dx = comm.reduce_scatter(gg @ wg.t(), cube.inp, 0, "sum", cube.mesh)
        if ctx.needs_input_grad[1]:
            xg = comm.all_gather(x, cube.inp, 0, cube.mesh)
            dw = comm.reduce_scatter(xg.t() @ gg, cube.weight, 0, "sum", cube.mesh)
        return dx, dw, None


@dataclasses.dataclass(frozen=True)
class _Role:
    """How a linear with one weight layout runs: the input's and the output's layouts (batch
    axes, width axis) and the matmul."""

    batch_in: tuple[str, ...]
    hidden_in: str
    batch_out: tuple[str, ...]
    hidden_out: str
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GridLinear:
    """Frame (a :class:`~colfunc.core.LinearInterceptor`): :func:`colfunc.nn.linear` with a weight
    laid out by the mode's plan runs the mode's matmul on the local blocks; any other weight is
    left to the propagation rules."""

    def __init__(self, layout: GridLayout) -> None:
        self.layout = layout
        mesh = layout.mesh
        self._roles: dict[tuple[Any, ...], _Role] = {}
        if layout.mode == "3d":
            # column-parallel layers take the width over z and give it over y; row ones back
            for ins, out, b_in, b_out in (
                ("tp_z", "tp_y", ("tp_y", "tp_x"), ("tp_z", "tp_x")),
                ("tp_y", "tp_z", ("tp_z", "tp_x"), ("tp_y", "tp_x")),
            ):
                cube = _Cube(mesh, inp=b_in[0], weight="tp_x", out=b_out[0])
                self._roles[self._weight_placements((ins, "tp_x"), out)] = _Role(
                    b_in, ins, b_out, out, cube
                )
        else:
            summa = _Summa(
                mesh, "tp_row", "tp_col", layout.q, "tp_dep" if layout.depth > 1 else None
            )
            batch = layout.batch_axes
            self._roles[self._weight_placements(("tp_row",), "tp_col")] = _Role(
                batch, "tp_col", batch, "tp_col", summa
            )

    def _weight_placements(self, ins: tuple[str, ...], out: str) -> tuple[Any, ...]:
        return tuple(
            Shard(0) if a in ins else Shard(1) if a == out else Replicate()
            for a in self.layout.mesh.axis_names
        )

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
    ) -> torch.Tensor | None:
        lay = self.layout
        if not isinstance(w, ShardedTensor) or w.dim() != 2 or w._mesh is not lay.mesh:
            return None
        role = self._roles.get(w.placements)
        if role is None or x.dim() < 2:
            return None
        want = lay.placements(x.dim(), role.batch_in, role.hidden_in)
        if not isinstance(x, ShardedTensor):
            x = distribute(x, lay.mesh)
        if x.placements != want:
            x = x.redistribute(want)
        xl = x.to_local()
        y2 = role.matmul(xl.reshape(-1, xl.shape[-1]), w.to_local())
        # 3D's output rows are another block of the batch, as many as the input's
        shape = (*x.shape[:-1], w.shape[1])
        y_local = y2.reshape(*xl.shape[:-1], y2.shape[-1])
        out = lay.placements(len(shape), role.batch_out, role.hidden_out)
        y = from_local(y_local, lay.mesh, out, shape)
        return y if b is None else y + b
