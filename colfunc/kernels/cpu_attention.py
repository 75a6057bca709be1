"""The compiled CPU decode attention (``csrc/cpu_attention.cpp``): built at install, or on first
use and cached (see :mod:`colfunc.kernels.cpu_build`)."""

from __future__ import annotations

import functools
from types import ModuleType

from colfunc.kernels import cpu_build

__all__ = ["extension"]


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None (with one warning) where it cannot be built."""
    module = cpu_build.prebuilt("cpu_attention")
    if module is not None:
        return module
    return cpu_build.guarded(
        lambda: cpu_build.build("cpu_attention"),
        "colfunc.ops.paged_attention: cannot build the C++ CPU decode attention",
        "decoding on the CPU runs the PyTorch reference instead",
    )
