"""The compiled CPU Adam (``csrc/cpu_adam.cpp``): built at install, or on first use and cached.

``COLFUNC_BUILD_EXT=1`` at install compiles it into ``colfunc.kernels._cpu_adam``. Otherwise the
first call compiles it with ``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/colfunc/extensions`` (a few seconds: the source includes only pybind11), keyed by
Python and torch versions; later processes load the cached build.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["SOURCE", "build_directory", "extension"]

SOURCE = Path(__file__).parent / "csrc" / "cpu_adam.cpp"


def build_directory() -> Path:
    """Where the on-first-use build lives; one per Python and torch version."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "colfunc" / "extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return base / tag / "colfunc_cpu_adam"


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name="colfunc_cpu_adam",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )
    return module


def _prebuilt() -> ModuleType | None:
    try:
        return importlib.import_module("colfunc.kernels._cpu_adam")
    except ImportError:
        return None


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None (with one warning) where it cannot be built."""
    module = _prebuilt()
    if module is not None:
        return module
    try:
        return _build()
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"colfunc.ops.cpu_adamw_: cannot build the C++ CPU Adam ({reason}); "
            "using torch's fused CPU AdamW instead",
            stacklevel=3,
        )
        return None
