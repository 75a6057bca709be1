"""Checksums of a checkpoint's tensors: a CRC-32 of each, whole and per block.

A load verifies every tensor against its CRC-32 (a flipped bit is an error naming the tensor),
and a partial read of a sharded checkpoint verifies the :data:`BLOCK_BYTES` blocks it reads.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

BLOCK_BYTES = 1 << 16  # the unit of a partial read, each with its own CRC-32


def _bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes (a memoryview, no copy of a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def checksum(t: torch.Tensor) -> str:
    """The CRC-32 of a CPU tensor's bytes, as 8 hex digits."""
    return _crc(_bytes(t))


def _crc(data: Any) -> str:
    """The CRC-32 of ``data`` (bytes-like) as 8 hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


# CRC-32 is linear over GF(2): the CRC of ``a + b`` follows from the CRCs of ``a`` and ``b`` and
# the length of ``b`` (zlib's ``crc32_combine``, which Python's zlib does not expose), by the
# 32x32 bit matrix that runs the CRC register over that many zero bytes. A save then takes the
# whole tensor's CRC from its blocks' CRCs instead of a second pass over its bytes.
_CRC_POLY = 0xEDB88320  # the CRC-32 polynomial, bit-reversed, as zlib's register uses it


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix @ vector`` over GF(2); ``matrix[k]`` is the image of bit ``k``."""
    out, k = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[k]
        vector >>= 1
        k += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The matrix of ``a`` after ``b``."""
    return tuple(_gf2_times(a, column) for column in b)


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that runs the CRC-32 register over ``nbytes`` zero bytes."""
    op = (_CRC_POLY, *(1 << k for k in range(31)))  # one zero bit: shift right, XOR the poly
    for _ in range(3):  # 2, 4, 8 bits: one zero byte
        op = _compose(op, op)
    out = tuple(1 << k for k in range(32))  # the identity
    while nbytes:  # by squaring: the powers of one byte that nbytes's bits name
        if nbytes & 1:
            out = _compose(op, out)
        nbytes >>= 1
        if nbytes:
            op = _compose(op, op)
    return out


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``, as
    zlib's ``crc32_combine``."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2 if len2 else crc1


def _sums(t: torch.Tensor, block: int) -> tuple[str, list[str]]:
    """The CRC-32 of a CPU tensor's bytes and of each ``block`` bytes of them (the last one
    short), in one pass over the bytes: the whole one combined from the blocks'."""
    data = _bytes(t)
    crcs = [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
    whole = 0  # the CRC-32 of no bytes
    for i, crc in enumerate(crcs):
        whole = _crc32_combine(whole, crc, min(block, len(data) - i * block))
    return f"{whole:08x}", [f"{crc:08x}" for crc in crcs]


def _checksums(storable: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The header entries that let a load check every tensor: whole and per block."""
    sums = {k: _sums(t, BLOCK_BYTES) for k, t in storable.items()}
    return {
        "checksums": {k: whole for k, (whole, _) in sums.items()},
        "block_bytes": BLOCK_BYTES,
        "blocks": {k: blocks for k, (_, blocks) in sums.items()},
    }
