"""ZeRO's layout of chunks: how each parameter is cut by rank over the data-parallel axis
(:mod:`colfunc.transforms.data_parallel.chunks`), kept in ``state.extra["zero"]``, and how the
chunks are gathered back whole (parameters at stage 3, optimizer states at stages 1-3)."""

from __future__ import annotations

from typing import Any

import torch

from colfunc import tree
from colfunc.sharding import Mesh, comm
from colfunc.transforms.data_parallel.chunks import Chunked, cut_chunk, gather_flat, whole

__all__ = ["ZeroLayout"]

PyTree = Any


class ZeroLayout:
    """The cut of every parameter (``state.extra["zero"]``); gathers stage-3 parameters whole."""

    def __init__(self, metas: PyTree, axis: str, mesh: Mesh, stage: int) -> None:
        self.metas, self.axis, self.mesh, self.stage = metas, axis, mesh, stage

    def gather(self, chunk: torch.Tensor, meta: Chunked) -> torch.Tensor:
        return whole(comm.all_gather(chunk, self.axis, chunk.dim() - 1, self.mesh), meta)

    def metas_of(self, part: PyTree) -> PyTree:
        """The cuts of the leaves ``part`` holds: all of them, or a subset of the parameters'
        (an optimizer over part of them)."""
        if tree.structure(part) == tree.structure(self.metas):
            return self.metas
        return tree.subset(self.metas, set(tree.paths(part)).__contains__)

    def gather_params(self, params: PyTree) -> PyTree:
        """Whole parameters from stage-3 chunks (a collective; identity for stages 0-2)."""
        if self.stage < 3:
            return params
        with torch.no_grad():
            return tree.map(self.gather, params, self.metas_of(params))

    def gather_chunks(self, chunks: PyTree, metas: PyTree = None) -> PyTree:
        """Whole tensors from a tree of this rank's chunks (``[L, c]`` for stacked ones, ``[c]``
        for the others), in one all_gather per dtype. ``metas`` is the part of the layout that
        ``chunks`` holds, when it is not the whole parameter tree."""
        n = self.mesh.axis_size(self.axis)
        flat, treedef = tree.flatten_with_paths(chunks)
        metas = treedef.flatten_up_to(self.metas if metas is None else metas)
        cs = [c for _, c in flat]
        gathered = gather_flat([c.reshape(-1) for c in cs], self.axis, self.mesh)  # [n * numel]
        out = []
        for f, c, m in zip(gathered, cs, metas):
            if m.stacked:  # rank-major [n, L, c] to layer-major [L, n * c]
                f = f.view(n, *c.shape).transpose(0, 1).reshape(c.shape[0], -1)
            out.append(whole(f, m))
        return tree.unflatten(treedef, out)

    def gather_opt(self, states: PyTree) -> PyTree:
        """Whole tensors from a tree of this rank's chunks shaped like the parameters, as the
        optimizer states of stages 1-3 are kept (a collective; identity for stage 0)."""
        if self.stage == 0:
            return states
        if self.stage == 3:
            return self.gather_params(states)
        with torch.no_grad():
            return self.gather_chunks(states, self.metas_of(states))

    def place_opt(self, states: PyTree) -> PyTree:
        """This rank's chunks of whole (placed) tensors shaped like the parameters: the layout of
        the optimizer states in stages 1 and 2 (stage 3's parameters are chunks already)."""
        if self.stage not in (1, 2):
            return states
        n, i = self.mesh.axis_size(self.axis), self.mesh.axis_index(self.axis)
        metas = self.metas_of(states)
        return tree.map(lambda x, m: cut_chunk(x, n, i, m.stacked)[0], states, metas)

    def __repr__(self) -> str:
        return f"ZeroLayout(stage={self.stage}, axis={self.axis!r})"
