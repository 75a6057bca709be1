"""Iteration-level scheduling (Orca, Yu et al. 2022; vLLM): which tokens each step computes.

Every step first gives each running sequence, oldest first, the tokens it still lacks (one when
decoding, the rest of its prompt, in chunks, when prefilling), then admits waiting sequences,
first come first served, into what is left of ``max_num_batched_tokens`` and ``max_num_seqs``.
A waiting sequence starts from the longest prefix of full blocks found in the prefix cache. When
a running sequence needs a block and none is free, the newest running sequence is preempted: its
blocks are released and it waits again, at the front, to be recomputed from its tokens (prompt
and output so far), which gives the same keys and values.

Under a sliding window (every layer attending to each token's last ``window`` tokens), a
sequence's blocks that fall wholly before the window of its next token are given back as it
advances: a sequence holds at most ``window / block_size + 2`` blocks. A given-back block keeps
its place in the block table as :data:`DROPPED`, which the attention reads past.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from colfunc.inference.kv_cache import BlockAllocator, block_hash
from colfunc.inference.sampling import SamplingParams

__all__ = ["DROPPED", "Scheduled", "Scheduler", "Sequence"]

DROPPED = -1  # a block table's entry for a block given back (before a sliding window)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being generated: its tokens, its blocks and how far they are computed."""

    request_id: str
    index: int  # which of the request's n completions
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # of its full blocks, in order
    computed: int = 0  # tokens whose keys and values are in its blocks
    drafts: int = 0  # speculative tokens at the end of its output, while a step is scheduled
    draft_computed: int = 0  # tokens whose keys and values a draft model holds in its blocks
    # with a KVCacheSpec.regime: whether its cache is computed in the long regime (in the short
    # one it is computed again when the sequence grows past it)
    long_regime: bool = False
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    text: str = ""
    detokenized: Any = None  # how far its text is decoded (colfunc.inference.tokenizers)
    guide: Any = None  # its grammar's matcher, for a structured output (colfunc.inference.grammar)
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass
class Scheduled:
    """One step's work: ``(sequence, new tokens)`` in batch order, and block copies to make
    first (``(source, destination)``, copy on write)."""

    items: list[tuple[Sequence, int]]
    copies: list[tuple[int, int]]


class Scheduler:
    """The waiting and running queues over one :class:`BlockAllocator`."""

    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        window: int | None = None,
        regime: int | None = None,
    ) -> None:
        self.allocator = allocator
        self.window = window
        self.regime = regime  # (see KVCacheSpec.regime)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    # --- blocks -------------------------------------------------------------------------------
    def _room(self, seq: Sequence, n: int) -> int:
        """Blocks ``seq`` needs from the allocator to compute ``n`` more tokens."""
        size = self.allocator.block_size
        need = -(-(seq.computed + n) // size) - len(seq.blocks)
        writes_shared = (
            seq.computed % size != 0 and self.allocator.refs[seq.blocks[seq.computed // size]] > 1
        )
        return max(need, 0) + int(writes_shared)

    def _grow(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        size, a = self.allocator.block_size, self.allocator
        if seq.computed % size != 0:
            j = seq.computed // size
            if a.refs[seq.blocks[j]] > 1:  # copy on write
                new = a.allocate()
                copies.append((seq.blocks[j], new))
                a.release(seq.blocks[j])
                seq.blocks[j] = new
        while len(seq.blocks) * size < seq.computed + n:
            seq.blocks.append(a.allocate())

    def _slide(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks that lie wholly before the window of its next token (the
        first it computes next sees the keys from ``computed - window + 1`` on)."""
        if self.window is None:
            return
        dead = max(0, seq.computed - self.window + 1) // self.allocator.block_size
        # the given-back blocks are always a prefix: only the newly dead ones are visited
        j = min(dead, len(seq.blocks)) - 1
        while j >= 0 and seq.blocks[j] != DROPPED:
            self.allocator.release(seq.blocks[j])
            seq.blocks[j] = DROPPED
            j -= 1

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks, last first (so that a prefix outlives its tails)."""
        for block in reversed(seq.blocks):
            if block != DROPPED:
                self.allocator.release(block)
        seq.blocks, seq.computed, seq.draft_computed = [], 0, 0

    def _keys(self, seq: Sequence, upto: int) -> None:
        """Extend ``seq.keys`` to its first ``upto`` full blocks."""
        size, tokens = self.allocator.block_size, seq.tokens
        while len(seq.keys) < upto:
            j = len(seq.keys)
            # (a request with an adapter has keys and values of its own: its chain starts apart)
            salt = None if seq.params.lora is None else b"lora:" + seq.params.lora.encode()
            parent = seq.keys[-1] if seq.keys else salt
            seq.keys.append(block_hash(parent, tokens[j * size : (j + 1) * size]))

    def _cached_prefix(self, seq: Sequence) -> None:
        # the last token is always computed, so that its logits exist; a prompt whose tokens'
        # logprobs are asked for is computed whole
        if seq.params.prompt_logprobs is not None:
            return
        # (of the tokens known: a step's drafts, taken back or not, are no prefix to look up)
        full = (seq.num_tokens - seq.drafts - 1) // self.allocator.block_size
        self._keys(seq, full)
        for key in seq.keys[:full]:
            block = self.allocator.lookup(key)
            if block is None:
                break
            seq.blocks.append(block)
        seq.computed = len(seq.blocks) * self.allocator.block_size

    def register_full(self, seq: Sequence) -> None:
        """Key every block of ``seq`` that its computed tokens have filled."""
        full = seq.computed // self.allocator.block_size
        self._keys(seq, full)
        for j in range(full):
            if seq.blocks[j] != DROPPED:
                self.allocator.register(seq.blocks[j], seq.keys[j])
        self._slide(seq)

    # --- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def _crosses(self, seq: Sequence) -> bool:
        """Whether ``seq`` has grown past the regime its cached tokens were computed in."""
        if self.regime is None or seq.computed == 0:
            return False
        return not seq.long_regime and seq.num_tokens > self.regime

    def _mark(self, seq: Sequence) -> None:
        if self.regime is not None and seq.computed == 0:
            seq.long_regime = seq.num_tokens > self.regime

    def schedule(self) -> Scheduled:
        budget = self.max_num_batched_tokens
        items: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        k = 0
        while k < len(self.running) and budget > 0:
            seq = self.running[k]
            if self._crosses(seq):  # its cache, computed short, computed again
                self.preempt(seq)
                continue
            n = min(seq.num_tokens - seq.computed, budget)
            while self._room(seq, n) > self.allocator.free_count():
                self.preempt(self.running[-1])  # the newest
                if seq not in self.running:
                    break
            if seq not in self.running:
                break  # it was the newest: everything after it is gone too
            self._mark(seq)
            self._grow(seq, n, copies)
            items.append((seq, n))
            budget -= n
            k += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.blocks:
                self._cached_prefix(seq)
            n = min(seq.num_tokens - seq.computed, budget)
            if self._room(seq, n) > self.allocator.free_count():
                self.release(seq)  # give back the cached prefix until it fits
                break
            self.waiting.popleft()
            self._mark(seq)
            self._grow(seq, n, copies)
            self.running.append(seq)
            items.append((seq, n))
            budget -= n
        return Scheduled(items, copies)
