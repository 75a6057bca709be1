"""Building the C++ CPU kernels (``csrc/*.cpp``): at install, or on first use and cached.

``COLFUNC_BUILD_EXT=1`` at install compiles each into ``colfunc.kernels._<name>``. Otherwise the
first call compiles it with ``torch.utils.cpp_extension.load`` under ``$TORCH_EXTENSIONS_DIR``
or ``~/.cache/colfunc/extensions``, in a folder keyed by the source's hash, the compiler flags
and the Python and torch versions: two checkouts on one machine share a build when their
sources agree and never rebuild over each other's when they do not. A build is made in a
temporary folder and renamed into place (a library a running process has loaded is never
rewritten), and says so on a terminal's stderr, once (it takes from seconds to a minute and a
half); later processes load the cached library without running the compiler.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "FLAGS",
    "LDFLAGS",
    "build",
    "build_directory",
    "build_key",
    "guarded",
    "prebuilt",
    "source",
]

# per source: compile flags (the attention kernel may fuse multiply-adds; the Adam must not, to
# round as torch does)
FLAGS = {
    "cpu_adam": ("-O3", "-fopenmp", "-ffp-contract=off"),
    "cpu_attention": ("-O3", "-fopenmp"),
}
LDFLAGS = ("-fopenmp",)
# what the build says it is making
TITLES = {"cpu_adam": "CPU Adam", "cpu_attention": "CPU attention"}


def source(name: str) -> Path:
    return Path(__file__).parent / "csrc" / f"{name}.cpp"


def build_key(name: str) -> str:
    """What a build of ``name`` depends on: its source, its flags, Python and torch."""
    digest = hashlib.sha256(source(name).read_bytes())
    digest.update(repr((FLAGS[name], LDFLAGS, sys.version_info[:2], torch.__version__)).encode())
    return digest.hexdigest()[:16]


def build_directory(name: str) -> Path:
    """Where the on-first-use build of ``name`` lives: one folder per :func:`build_key`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "colfunc" / "extensions"
    return base / f"colfunc_{name}-{build_key(name)}"


def _library(directory: Path, name: str) -> Path | None:
    """The built library in ``directory``: ``colfunc_<name>.so``, or ``colfunc_<name>_vN.so``
    where torch's extension loader numbered a second build of the name in one process."""
    found = sorted(directory.glob(f"colfunc_{name}*.so")) if directory.is_dir() else []
    return found[0] if found else None


def _load(library: Path) -> ModuleType:
    """The extension module in ``library`` (a built ``.so``, named after its module), without
    running a compiler."""
    spec = importlib.util.spec_from_file_location(library.stem, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name: str) -> ModuleType:
    """Load the cached build of ``csrc/<name>.cpp``, or compile it (once: in a temporary
    folder, renamed into place); raises where it cannot."""
    final = build_directory(name)
    library = _library(final, name)
    if library is not None:
        return _load(library)
    from torch.utils import cpp_extension

    if sys.stderr.isatty():  # (a person waiting; logs and captured output stay quiet)
        what = TITLES.get(name, name)
        print(f"colfunc: building the {what} kernel (once; up to a minute or two)", file=sys.stderr)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        module: ModuleType = cpp_extension.load(
            name=f"colfunc_{name}",
            sources=[str(source(name))],
            extra_cflags=list(FLAGS[name]),  # (copies: load appends to the lists it is given)
            extra_ldflags=list(LDFLAGS),
            build_directory=str(tmp),
            verbose=False,
        )
        if final.is_dir() and _library(final, name) is None:  # a build folder with no library
            shutil.rmtree(final, ignore_errors=True)  # (a crash, or a hand): replaced
        os.rename(tmp, final)  # atomic: a process sees the whole build or none
    except OSError:
        if _library(final, name) is None:  # (not another process's build winning)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (the library stays mapped where it is loaded)
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
