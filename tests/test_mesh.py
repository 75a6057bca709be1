"""Mesh: coordinates and groups against a numpy grid of ranks; validation errors name the values."""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_comm import group_of, meshes

import colfunc as cf
from colfunc.sharding import Mesh, current_mesh, launch


@given(shape=meshes(max_size=24), data=st.data())
def test_coords_and_groups_match_a_grid_of_ranks(shape: dict[str, int], data: Any) -> None:
    size = math.prod(shape.values())
    rank = data.draw(st.integers(0, size - 1))
    axes = tuple(data.draw(st.permutations(list(shape)))[: data.draw(st.integers(1, len(shape)))])
    mesh = Mesh(shape, rank)
    grid = np.arange(size).reshape(list(shape.values()))
    assert mesh.size == size and mesh.rank == rank
    assert mesh.shape == shape and mesh.axis_names == tuple(shape)
    assert mesh.coords == dict(zip(shape, (int(c) for c in np.argwhere(grid == rank)[0])))
    group = mesh.group_ranks(axes)
    assert list(group) == group_of(shape, rank, axes)
    assert mesh.axis_index(axes) == group.index(rank)
    assert mesh.axis_size(axes) == len(group) == math.prod(shape[a] for a in axes)
    # a rank's index over a tuple of axes is row-major over its coordinates in tuple order
    index = 0
    for a in axes:
        index = index * shape[a] + mesh.coords[a]
    assert mesh.axis_index(axes) == index
    # the groups over `axes` partition the world, and every member sees the same group
    groups = mesh.groups(axes)
    assert sorted(r for g in groups for r in g) == list(range(size))
    assert all(Mesh(shape, r).group_ranks(axes) == g for g in groups for r in g)
    assert mesh.group_ranks(axes[0]) == mesh.group_ranks((axes[0],))


def test_example_from_the_docs() -> None:
    mesh = Mesh({"dp": 2, "tp": 4}, rank=6)
    assert mesh.coords == {"dp": 1, "tp": 2}
    assert mesh.group_ranks("tp") == (4, 5, 6, 7)
    assert mesh.group_ranks("dp") == (2, 6)
    assert Mesh({"dp": 2, "tp": 4}).group_ranks(("tp", "dp")) == (0, 4, 1, 5, 2, 6, 3, 7)


def test_value_semantics() -> None:
    a, b = Mesh({"dp": 2, "tp": 2}, 1), Mesh([("dp", 2), ("tp", 2)], 1)
    assert a == b and hash(a) == hash(b)
    assert a != Mesh({"dp": 2, "tp": 2}, 2) and a != Mesh({"tp": 2, "dp": 2}, 1)
    with pytest.raises(AttributeError, match="immutable"):
        a.world = None  # type: ignore[misc]
    a.shape["dp"] = 7  # a copy: the mesh is unchanged
    assert a.shape == {"dp": 2, "tp": 2}
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "Mesh({'dp': 2, 'tp': 2}, rank=1, backend='none')"


@pytest.mark.parametrize(
    "shape, rank, match",
    [
        ([("dp", 2), ("dp", 2)], 0, "'dp' appears 2 times"),
        ({"dp": 0}, 0, "'dp' must be a positive int; got 0"),
        ({"dp": -2}, 0, "got -2"),
        ({"dp": 2.0}, 0, "got 2.0"),
        ({"dp": True}, 0, "got True"),
        ({"": 2}, 0, "got ''"),
        ({}, 0, "at least one axis"),
        ({"dp": 2, "tp": 2}, 4, r"\[0, 4\).*got 4"),
    ],
)
def test_bad_meshes_name_the_value(shape: Any, rank: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Mesh(shape, rank)


def test_bad_axes_name_the_value() -> None:
    mesh = Mesh({"dp": 2, "tp": 2})
    with pytest.raises(
        ValueError, match="unknown mesh axis 'pp'; this mesh has axes \\('dp', 'tp'\\)"
    ):
        mesh.group_ranks("pp")
    with pytest.raises(ValueError, match="names an axis twice"):
        mesh.axis_size(("dp", "dp"))
    with pytest.raises(TypeError, match="\\['dp'\\]"):
        mesh.axis_index(["dp"])  # type: ignore[arg-type]


def test_mesh_must_match_the_world_size() -> None:
    class World:
        name, size = "fake", 8

        def ledger(self, rank: int) -> Any:
            return None

    with pytest.raises(ValueError, match="multiply to 4 ranks but the world has 8"):
        Mesh({"dp": 2, "tp": 2}, world=World())


def test_current_mesh_is_each_ranks_mesh() -> None:
    with pytest.raises(RuntimeError, match="no current mesh"):
        current_mesh()

    def fn(mesh: Mesh) -> tuple[int, bool]:
        # also from a backward: CPU autograd runs it on the rank's own thread
        x = torch.ones(2, requires_grad=True)
        seen = []
        x.register_hook(lambda g: seen.append(current_mesh()) or g)
        (x * 2).sum().backward()
        return current_mesh().rank, seen == [mesh] and current_mesh() is mesh

    assert launch(fn, {"dp": 2, "tp": 3}) == [(r, True) for r in range(6)]
    assert cf.launch is launch and cf.Mesh is Mesh
