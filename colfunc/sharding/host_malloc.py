"""The host allocator of colfunc's CPU steps and ranks: freed memory kept for the next step.

glibc's malloc gives freed memory back to the system once the free top of its heap passes a
trim threshold that starts at 128 KiB and grows only with the largest block ever freed from a
mapping, and it maps every block past a matching threshold afresh. A training step frees most
of what it allocates (the activations, during the backward pass) and allocates it again in the
next forward pass, so on a CPU rank each step can fault in megabytes of fresh pages one by one:
a gloo rank of data-parallel training on ``gpt.Config.tiny`` faulted about 2,400 pages a step,
and a one-process step of a 4-layer OLMoE-shaped mixture (width 256, 64 experts; its stacked
expert gradients are fresh 32 MiB blocks) about 60,000, a fifth of its time.

:func:`keep_freed_memory` fixes both thresholds (``mallopt``), as a launcher that preloads
jemalloc or tcmalloc does for its ranks: blocks up to 32 MiB (glibc's largest mapping threshold)
come from the heap, and up to 1 GiB of freed heap stays with the process. ``colfunc.launch``
applies it in every gloo rank it starts, and ``Step.init`` in any process whose step keeps
parameters in host memory (once: the setting is the process's); ``COLFUNC_MALLOC=system``
leaves glibc's defaults. It does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "wanted"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit machines)
TRIM_THRESHOLD = 2**30
CHOICES = ("keep", "system")


def wanted() -> bool:
    """Whether ``COLFUNC_MALLOC`` asks for :func:`keep_freed_memory` (``keep``, the default)."""
    value = os.environ.get("COLFUNC_MALLOC", "keep")
    if value not in CHOICES:
        raise ValueError(f"COLFUNC_MALLOC={value!r}; expected one of {', '.join(CHOICES)}")
    return value == "keep"


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_kept: bool | None = None  # what keep_freed_memory returned in this process


def keep_freed_memory() -> bool:
    """Fix glibc's trim and mapping thresholds for this process (see the module docstring);
    True if they were set, False where the C library is not glibc or refused them. Set once:
    later calls return the first answer."""
    global _kept
    if _kept is None:
        libc = _glibc()
        _kept = (
            libc is not None
            and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        )
    return _kept
