"""Deterministic initialisation keyed by ``(seed, path)``.

A parameter's initial values depend only on the run's seed and the parameter's dotted path, never
on the order in which parameters are created or on how they are later sharded: a sharded run
initialises the full value from the same key and keeps its slice, so it starts exactly where the
single-device run starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "Abstract",
    "abstract",
    "as_meta",
    "generator",
    "is_abstract",
    "key",
    "materialize",
    "normal",
    "ones",
    "uniform",
    "zeros",
]


def key(seed: int, path: str) -> int:
    """A 63-bit integer derived from ``(seed, path)`` by BLAKE2b (stable across runs and machines)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(seed: int, path: str) -> torch.Generator:
    """A CPU generator seeded by :func:`key`."""
    g = torch.Generator(device="cpu")
    g.manual_seed(key(seed, path))
    return g


def normal(
    seed: int, path: str, shape: tuple[int, ...], std: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``N(0, std^2)`` values for the parameter at ``path``; drawn in fp32 on the CPU, then cast."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"std for {path!r} must be finite and >= 0, got {std}")
    x = torch.randn(shape, generator=generator(seed, path), dtype=torch.float32)
    return x.mul_(std).to(dtype)


def uniform(
    seed: int,
    path: str,
    shape: tuple[int, ...],
    low: float,
    high: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``U(low, high)`` values for the parameter at ``path``."""
    if not low < high:
        raise ValueError(f"uniform init for {path!r} needs low < high, got {low} and {high}")
    x = torch.rand(shape, generator=generator(seed, path), dtype=torch.float32)
    return (x * (high - low) + low).to(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Abstract:
    """A parameter described but not yet made: its shape, dtype and how to make it (the
    ``(seed, path)`` initialiser), as PyTorch's meta-device init or ColossalAI's
    ``LazyInitContext`` defer it. A transform that lays parameters out (``zero`` stage 3,
    ``offload``) makes each one just before it takes its piece, one tensor at a time, so the
    whole model is never held; :meth:`then` defers a per-tensor layout step too."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def materialize(self) -> torch.Tensor:
        x = self.make()
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(
                f"Abstract: the initialiser made {x.dtype} {tuple(x.shape)}, not the "
                f"{self.dtype} {self.shape} it described"
            )
        return x

    def then(self, fn: Callable[[torch.Tensor], Any]) -> Abstract:
        """The same parameter, with ``fn`` applied once it is made (shape and dtype kept)."""
        make = self.make
        return dataclasses.replace(self, make=lambda: fn(make()))


def abstract(
    shape: tuple[int, ...], make: Callable[[], torch.Tensor], dtype: torch.dtype = torch.float32
) -> Abstract:
    """An :class:`Abstract` parameter of ``shape`` made by ``make()``."""
    return Abstract(tuple(shape), dtype, make)


def is_abstract(params: Any) -> bool:
    """Whether any leaf of ``params`` is an :class:`Abstract` parameter."""
    from colfunc import tree

    return any(isinstance(x, Abstract) for x in tree.leaves(params))


def materialize(params: Any) -> Any:
    """``params`` with every :class:`Abstract` leaf made, one at a time, in leaf order."""
    from colfunc import tree

    return tree.map(lambda x: x.materialize() if isinstance(x, Abstract) else x, params)


def as_meta(params: Any) -> Any:
    """``params`` with every :class:`Abstract` leaf a meta tensor of its shape and dtype (for
    what needs only shapes: chunk layouts, ZeRO's cut)."""
    from colfunc import tree

    return tree.map(
        lambda x: (
            torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Abstract) else x
        ),
        params,
    )
