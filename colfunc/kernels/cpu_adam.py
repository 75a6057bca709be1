"""The compiled CPU Adam (``csrc/cpu_adam.cpp``): built at install, or on first use and cached
(see :mod:`colfunc.kernels.cpu_build`)."""

from __future__ import annotations

import functools
from types import ModuleType

from colfunc.kernels import cpu_build

__all__ = ["SOURCE", "extension"]

SOURCE = cpu_build.source("cpu_adam")


def _build() -> ModuleType:
    return cpu_build.build("cpu_adam")


def _prebuilt() -> ModuleType | None:
    return cpu_build.prebuilt("cpu_adam")


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None (with one warning) where it cannot be built."""
    module = _prebuilt()
    if module is not None:
        return module
    return cpu_build.guarded(
        _build,
        "colfunc.ops.cpu_adamw_: cannot build the C++ CPU Adam",
        "using torch's fused CPU AdamW instead",
    )
