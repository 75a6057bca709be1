"""Tensor-parallel plans for every mode from one description of a model's parameters.

A plan maps parameter path patterns to partition specs (:class:`colfunc.P`) over named mesh
axes. :func:`tensor_plans` derives Megatron-LM's 1D plan and the 2D, 2.5D and 3D plans (see
:mod:`colfunc.transforms.grid`) from which weights are column- and row-parallel and which vectors
run along the model's width; :func:`grid_axes` gives the mesh axes of a mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from colfunc.core import P, Plan

__all__ = ["AXES", "MODES", "check_mode", "fitting_sizes", "grid_axes", "tensor_plans"]

MODES = ("1d", "2d", "2.5d", "3d")
AXES: dict[str, tuple[str, ...]] = {
    "1d": ("tp",),
    "2d": ("tp_row", "tp_col"),
    "2.5d": ("tp_dep", "tp_row", "tp_col"),
    "3d": ("tp_z", "tp_y", "tp_x"),
}


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"tensor parallel mode must be one of {MODES}, got {mode!r}")
    return str(mode)


def _nearest(valid: list[int], size: int) -> str:
    below = [v for v in valid if v <= size]
    above = [v for v in valid if v > size]
    near = ([max(below)] if below else []) + ([min(above)] if above else [])
    return " or ".join(map(str, near))


def fitting_sizes(mode: str, size: int, depth: int | None, fits: Any) -> str:
    """The sizes of ``mode`` nearest to ``size`` whose q (the grid's side) satisfies
    ``fits(q)``, as text ("4 or 16"), for errors."""
    d = depth or 1
    side = {"1d": lambda q: q, "2d": lambda q: q * q, "2.5d": lambda q: d * q * q}
    total = side.get(mode, lambda q: q**3)
    return _nearest([total(q) for q in range(1, 65) if fits(q)], size) or "none"


def grid_axes(mode: str, size: int, depth: int | None = None) -> dict[str, int]:
    """The mesh axes (in mesh order) of ``mode`` over ``size`` tensor-parallel ranks.

    ``2d``: size = q²; ``2.5d``: size = depth · q²; ``3d``: size = q³. ValueError naming the
    nearest valid sizes otherwise.
    """
    mode = check_mode(mode)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor parallel size must be an int >= 1, got {size!r}")
    if depth is not None and mode != "2.5d":
        raise ValueError(f"tensor parallel depth is for mode '2.5d'; mode {mode!r} has none")
    if mode == "1d":
        return {"tp": size}
    if mode == "2d":
        q = math.isqrt(size)
        if q * q != size:
            squares = [n * n for n in range(1, math.isqrt(size) + 2)]
            raise ValueError(
                f"tensor mode '2d' needs a square size (q x q grid), got {size}; "
                f"the nearest are {_nearest(squares, size)}"
            )
        return {"tp_row": q, "tp_col": q}
    if mode == "2.5d":
        d = 1 if depth is None else depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"tensor mode '2.5d': depth must be an int >= 1, got {depth!r}")
        q = math.isqrt(size // d) if size % d == 0 else 0
        if q < 1 or d * q * q != size:
            valid = [d * n * n for n in range(1, math.isqrt(max(size // d, 1)) + 2)]
            raise ValueError(
                f"tensor mode '2.5d' needs size = depth * q^2, got size={size} with depth={d}; "
                f"with depth {d} the nearest are {_nearest(valid, size)}"
            )
        return {"tp_dep": d, "tp_row": q, "tp_col": q}
    q = round(size ** (1 / 3))
    if q**3 != size:
        cubes = [n**3 for n in range(1, q + 3)]
        raise ValueError(
            f"tensor mode '3d' needs a cube size (q x q x q), got {size}; "
            f"the nearest are {_nearest(cubes, size)}"
        )
    return {"tp_z": q, "tp_y": q, "tp_x": q}


# --- plans --------------------------------------------------------------------------------------


def _lead(pattern: str, stacked: str) -> tuple[None, ...]:
    return (None,) if pattern.startswith(stacked) else ()


def tensor_plans(
    *,
    column: Sequence[str],
    row: Sequence[str],
    column_bias: Sequence[str] = (),
    hidden: Sequence[str] = (),
    vocab: Sequence[str] = (),
    head: Sequence[str] = (),
    stacked: str = "blocks.",
    optional: Sequence[str] = (),
) -> dict[str, dict[str, P]]:
    """One plan per mode, from one description of a model's parameters (path patterns):

    - ``column``: weights ``[in, out]`` whose output feeds attention or the MLP's activation
      (Megatron's column-parallel: q, k, v, the MLP's input);
    - ``row``: weights whose output returns to the residual stream (the attention and MLP outputs);
    - ``column_bias``: the column-parallel weights' biases;
    - ``hidden``: the other vectors along the model's width (row-parallel biases, norm weights);
    - ``vocab``: the token embedding ``[V, D]`` (split by vocabulary);
    - ``head``: an untied output projection ``[D, V]`` (split by vocabulary; optional, for a
      tied config has none: each plan is a :class:`~colfunc.core.Plan` naming it so);
    - ``stacked``: the prefix of the parameters stacked on a leading layer dim;
    - ``optional``: further patterns some configs lack (biases a config may leave out).

    ``plans(...)["1d"]`` is Megatron-LM's layout over ``tp``.
    """
    out: dict[str, dict[str, P]] = {}
    for mode in MODES:
        plan: dict[str, P] = {}
        vocab_axis = {"1d": "tp", "3d": "tp_z"}.get(mode, "tp_col")
        for pat in vocab:
            plan[pat] = P(vocab_axis, None)
        for pat in head:
            plan[pat] = P(None, vocab_axis)
        for pat in column:
            lead = _lead(pat, stacked)
            plan[pat] = {
                "1d": P(*lead, None, "tp"),
                "3d": P(*lead, ("tp_z", "tp_x"), "tp_y"),
            }.get(mode, P(*lead, "tp_row", "tp_col"))
        for pat in column_bias:
            lead = _lead(pat, stacked)
            plan[pat] = P(*lead, {"1d": "tp", "3d": "tp_y"}.get(mode, "tp_col"))
        for pat in row:
            lead = _lead(pat, stacked)
            plan[pat] = {
                "1d": P(*lead, "tp", None),
                "3d": P(*lead, ("tp_y", "tp_x"), "tp_z"),
            }.get(mode, P(*lead, "tp_row", "tp_col"))
        if mode != "1d":
            for pat in hidden:
                plan[pat] = P(*_lead(pat, stacked), "tp_z" if mode == "3d" else "tp_col")
        out[mode] = Plan(plan, optional={*head, *optional})
    return out
