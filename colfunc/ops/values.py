"""The values the op layer's ops take, one per family of backends.

Every backend of an op (the PyTorch reference, the Triton kernel, the C++ CPU kernel, the
sharding rule's local computation) takes the same value instead of repeating a long signature:

- :class:`AdamWHyper`: one AdamW update's step count and hyperparameters, checked when built;
- :class:`PagedBatch`: a packed batch of sequences over a paged KV cache (their block tables,
  cached and new token counts, and the new tokens' positions).

This module imports nothing of colfunc, so that the kernels beneath the op layer can take it.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["NF4", "NF4_BLOCK", "AdamWHyper", "PagedBatch"]

# The NF4 data type: Dettmers et al. 2023, appendix E (bitsandbytes' ``create_normal_map``): the
# 16 values a 4-bit NormalFloat code stands for, times its block's absmax
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_BLOCK = 64  # values per absmax


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamWHyper:
    """One AdamW update (``torch.optim.AdamW`` semantics): ``step`` is its 1-based count (for the
    bias corrections), ``0 <= beta < 1``, and ``lr``, ``eps``, ``weight_decay`` are >= 0."""

    step: int
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        s = self.step
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(
                f"AdamWHyper: step={s!r}; expected an int >= 1 (the update's 1-based count)"
            )
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamWHyper: {name}={beta}; expected 0 <= {name} < 1")
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"AdamWHyper: {name}={value}; expected a value >= 0")


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """A packed batch of sequences for one step over a paged KV cache.

    Sequence ``s`` brings ``query_lens[s]`` new tokens (packed in order, ``N`` in all) after
    ``context_lens[s]`` tokens already cached in the blocks its row of ``block_tables`` lists;
    ``positions[N]`` are the new tokens' positions in their sequences (what a model's position
    embedding reads; the attention ops do not). A decode step is ``query_lens[s] == 1``.
    """

    block_tables: torch.Tensor  # [S, M] int32
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    positions: torch.Tensor | None = None  # [N] long
    # each sequence's whole length as known at this step (prompt and tokens so far), for a
    # model whose computation depends on it (LongRoPE); None: context + query
    seq_lens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "context_lens", tuple(int(n) for n in self.context_lens))
        object.__setattr__(self, "query_lens", tuple(int(n) for n in self.query_lens))
        if self.seq_lens is None:
            ends = (c + q for c, q in zip(self.context_lens, self.query_lens, strict=False))
            object.__setattr__(self, "seq_lens", tuple(ends))
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens or ()))
        if len(self.context_lens) != len(self.query_lens):
            raise ValueError(
                f"PagedBatch: context_lens {list(self.context_lens)} and query_lens "
                f"{list(self.query_lens)} differ in length"
            )
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != len(self.query_lens):
            raise ValueError(
                f"PagedBatch: block_tables must be [sequences, blocks] with a row per sequence "
                f"({len(self.query_lens)}), got {tuple(self.block_tables.shape)}"
            )

    def token_positions(self) -> torch.Tensor:
        """``positions``, which a model's ``paged_forward`` reads (a ValueError where the batch
        was built without them)."""
        if self.positions is None:
            raise ValueError(
                "PagedBatch: this batch has no positions; a model's paged_forward needs the new "
                "tokens' positions (PagedBatch(..., positions=))"
            )
        return self.positions
