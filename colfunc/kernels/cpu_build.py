"""Building the C++ CPU kernels (``csrc/*.cpp``): at install, or on first use and cached.

``COLFUNC_BUILD_EXT=1`` at install compiles each into ``colfunc.kernels._<name>``. Otherwise the
first call compiles it with ``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/colfunc/extensions`` (a few seconds: the sources include only pybind11), keyed by
Python and torch versions; later processes load the cached build.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["FLAGS", "build", "build_directory", "guarded", "prebuilt", "source"]

# per source: compile flags (the attention kernel may fuse multiply-adds; the Adam must not, to
# round as torch does)
FLAGS = {
    "cpu_adam": ["-O3", "-fopenmp", "-ffp-contract=off"],
    "cpu_attention": ["-O3", "-fopenmp"],
}


def source(name: str) -> Path:
    return Path(__file__).parent / "csrc" / f"{name}.cpp"


def build_directory(name: str) -> Path:
    """Where the on-first-use build of ``name`` lives; one per Python and torch version."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "colfunc" / "extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return base / tag / f"colfunc_{name}"


def build(name: str) -> ModuleType:
    """Compile ``csrc/<name>.cpp`` (or load its cached build); raises where it cannot."""
    from torch.utils import cpp_extension

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name=f"colfunc_{name}",
        sources=[str(source(name))],
        extra_cflags=FLAGS[name],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )
    return module


def prebuilt(name: str) -> ModuleType | None:
    """The module compiled at install, if it was."""
    try:
        return importlib.import_module(f"colfunc.kernels._{name}")
    except ImportError:
        return None


def guarded(make: Callable[[], ModuleType], cannot: str, instead: str) -> ModuleType | None:
    """``make()``, or None with one warning ``"{cannot} ({reason}); {instead}"`` where the
    module cannot be built (no compiler, no OpenMP, a failed compile)."""
    try:
        return make()
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"{cannot} ({reason}); {instead}", stacklevel=4)
        return None
