"""How many CPU threads each engine step computes with (:class:`StepThreads`).

On the CPU a step of a few tokens (decoding) reads every weight once and is bound by memory,
not arithmetic: a second thread gains it little, and takes the core the HTTP side needs to parse
requests and stream tokens. A step of many tokens (prompts) is bound by arithmetic and gains
from every core, while the HTTP side mostly waits. So ``colfunc serve`` runs decoding steps on
the CPUs less one (vLLM's CPU server also keeps a core for its API process) and steps of more
than :data:`PREFILL_TOKENS` tokens on all of them.
"""

from __future__ import annotations

import dataclasses
import os

import torch

__all__ = ["PREFILL_TOKENS", "StepThreads", "cpus"]

PREFILL_TOKENS = 64  # a step of more tokens than this computes with ``prefill`` threads


def cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class StepThreads:
    """``decode`` threads for a step of at most ``at_tokens`` tokens, ``prefill`` threads for a
    larger one (``torch.set_num_threads``, which is the process's: one engine per process)."""

    decode: int
    prefill: int
    at_tokens: int = PREFILL_TOKENS

    def __post_init__(self) -> None:
        for name in ("decode", "prefill", "at_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepThreads: {name} must be an int >= 1, got {value!r}")

    @classmethod
    def serving(cls, decode: int | None = None, prefill: int | None = None) -> StepThreads:
        """``colfunc serve``'s: decoding on the CPUs less one (at least one), prompts on all."""
        n = cpus()
        return cls(decode or max(1, n - 1), prefill or n)

    def __call__(self, tokens: int) -> None:
        """Set the threads for a step of ``tokens`` tokens."""
        n = self.prefill if tokens > self.at_tokens else self.decode
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
