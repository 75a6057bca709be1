"""The paged KV cache's bookkeeping: blocks of token slots, reference counts, a prefix cache.

The cache tensors (``{"k", "v"}``, ``[L, C blocks, B slots, K, E]``) belong to the engine; this
module decides which block holds what (Kwon et al. 2023, vLLM's PagedAttention). A sequence's
block table lists its blocks in order; a block shared by several sequences (the ``n`` samples of
one prompt, or a cached prefix) has a reference count, and a sequence about to write into a
shared block first gets its own copy (copy on write).

Prefix caching: a full block is keyed by a chained hash of its tokens and of every token before
it (the hash of the previous block), so equal keys mean equal keys and values. A block whose last
reference is dropped keeps its contents and its key, and is handed out again on a hit; blocks
needed for new contents are taken from the never-cached ones first, then from the cached ones
least recently released (LRU eviction).

:func:`paged_batch`, :func:`copy_blocks` and :func:`store` lay a step's new tokens out over a cache
of that layout: the engine's, and a draft model's that shares its block tables.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Sequence

import torch

from colfunc import nn

__all__ = [
    "BlockAllocator",
    "KVMemoryError",
    "block_hash",
    "copy_blocks",
    "kv_bytes",
    "paged_batch",
    "store",
]

ROOT = b"colfunc-kv"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30}


def kv_bytes(value: int | str) -> int:
    """A KV cache size in bytes: an int, or a string such as ``"512MiB"`` or ``"2GB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"Engine: kv_memory must be bytes > 0 or a size like '512MiB', got {value!r}")


class KVMemoryError(ValueError):
    """A KV cache size (``kv_memory``) too small for one sequence at the model's context: the
    size given, the bytes it is, and the least that holds one sequence."""

    def __init__(self, given: int | str, budget: int, needed: int, context: int) -> None:
        self.given, self.budget, self.needed, self.context = given, budget, needed, context
        super().__init__(self.message("kv_memory"))

    def message(self, name: str) -> str:
        """The message, naming the size as the caller knows it (``--kv-memory`` on the CLI)."""
        mib = -(-self.needed // 2**20)
        return (
            f"{name}={self.given!r} ({self.budget} bytes) cannot hold one sequence at the "
            f"model's context of {self.context} tokens, which takes {self.needed} bytes; give "
            f"at least {mib}MiB"
        )


def paged_batch(
    items: Sequence[tuple[Sequence[int], int, int, int]], block_size: int, device: torch.device
) -> tuple[nn.PagedBatch, torch.Tensor]:
    """A step's :class:`~colfunc.nn.PagedBatch` and the cache slot of each new token, from each
    sequence's ``(block table, first new position, new tokens, its length)``, in batch order. A
    block given back before a sliding window reads as -1: the attention skips it."""
    tables = torch.zeros(len(items), max(len(b) for b, _, _, _ in items), dtype=torch.int32)
    positions: list[int] = []
    slots: list[int] = []
    for s, (blocks, lo, n, _) in enumerate(items):
        tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions += range(lo, lo + n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(lo, lo + n)]
    batch = nn.PagedBatch(
        positions=torch.tensor(positions, device=device),
        block_tables=tables.to(device),
        context_lens=tuple(lo for _, lo, _, _ in items),
        query_lens=tuple(n for _, _, n, _ in items),
        seq_lens=tuple(length for _, _, _, length in items),
    )
    return batch, torch.tensor(slots, device=device)


def copy_blocks(cache: dict[str, torch.Tensor], copies: Sequence[tuple[int, int]]) -> None:
    """Copy on write: each ``(source, destination)`` block of every layer's keys and values."""
    for src, dst in copies:
        for c in cache.values():
            c[:, dst] = c[:, src]


def store(
    cache: dict[str, torch.Tensor], slots_N: torch.Tensor, new: dict[str, torch.Tensor]
) -> None:
    """The new tokens' keys and values (``[L, N, K, E]`` each) into their cache slots."""
    for key, c in cache.items():
        c.view(c.shape[0], -1, *c.shape[3:])[:, slots_N] = new[key]


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding ``tokens`` after the block keyed ``parent`` (None first)."""
    h = hashlib.sha256(parent if parent is not None else ROOT)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockAllocator:
    """Blocks ``0 .. num_blocks - 1``: a free list, reference counts and the prefix cache.

    Example:
        >>> a = BlockAllocator(num_blocks=8, block_size=16)
        >>> b = a.allocate(); a.free_count()
        7
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.prefix_caching = (
            num_blocks,
            block_size,
            prefix_caching,
        )
        self.refs = [0] * num_blocks
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.key_of: dict[int, bytes] = {}  # a cached block's key
        self.cached: dict[bytes, int] = {}  # key -> block
        # unreferenced cached blocks, least recently released first
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hits = 0  # blocks served from the prefix cache
        self.queries = 0  # full blocks looked up

    def free_count(self) -> int:
        """Blocks that :meth:`allocate` can hand out now (never-cached ones and evictable ones)."""
        return len(self.free) + len(self.evictable)

    def used_count(self) -> int:
        """Blocks referenced by some sequence."""
        return self.num_blocks - self.free_count()

    def allocate(self) -> int:
        """A block for new contents, with one reference."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of.pop(block)]
        else:
            raise RuntimeError("BlockAllocator: no free block (the scheduler checks first)")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more reference to ``block`` (a forked sequence's)."""
        if self.refs[block] < 1:
            raise RuntimeError(f"BlockAllocator: block {block} is not in use")
        self.refs[block] += 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; the last one frees the block (a cached one stays, evictable)."""
        if self.refs[block] < 1:
            raise RuntimeError(f"BlockAllocator: block {block} released more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None  # the most recently released
            else:
                self.free.append(block)

    def lookup(self, key: bytes) -> int | None:
        """The cached block keyed ``key``, with one more reference, or None."""
        self.queries += 1
        block = self.cached.get(key) if self.prefix_caching else None
        if block is None:
            return None
        self.hits += 1
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1
        return block

    def register(self, block: int, key: bytes) -> None:
        """Record that the full ``block`` holds the tokens keyed ``key`` (first one wins)."""
        if self.prefix_caching and key not in self.cached and block not in self.key_of:
            self.cached[key], self.key_of[block] = block, key
