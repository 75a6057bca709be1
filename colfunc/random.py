"""Deterministic initialisation keyed by ``(seed, path)``.

A parameter's initial values depend only on the run's seed and the parameter's dotted path, never
on the order in which parameters are created or on how they are later sharded: a sharded run
initialises the full value from the same key and keeps its slice, so it starts exactly where the
single-device run starts.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["generator", "key", "normal", "ones", "uniform", "zeros"]


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
