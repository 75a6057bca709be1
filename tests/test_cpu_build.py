"""The C++ kernels' build cache: keyed by the source's hash and the flags, installed by an atomic
rename, and loaded afterwards without running the compiler."""

from __future__ import annotations

import pytest
import torch.utils.cpp_extension

from colfunc.kernels import cpu_build


def test_the_key_follows_the_source_and_the_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_build.build_directory("cpu_adam")
    assert here.parent == tmp_path and here.name.startswith("colfunc_cpu_adam-")
    assert cpu_build.build_directory("cpu_adam") == here  # the same inputs, the same folder
    changed = tmp_path / "cpu_adam.cpp"
    changed.write_text(cpu_build.source("cpu_adam").read_text() + "\n// another checkout\n")
    real = cpu_build.source
    monkeypatch.setattr(
        cpu_build, "source", lambda name: changed if name == "cpu_adam" else real(name)
    )
    assert cpu_build.build_directory("cpu_adam") != here  # two checkouts never share a build
    monkeypatch.setattr(cpu_build, "source", real)
    monkeypatch.setitem(cpu_build.FLAGS, "cpu_adam", ("-O2", "-fopenmp"))
    assert cpu_build.build_directory("cpu_adam") != here


def test_a_cached_build_loads_without_the_compiler(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    try:
        built = cpu_build.build("cpu_adam")
    except (OSError, RuntimeError) as e:  # no compiler here: nothing to cache
        pytest.skip(f"cannot build the C++ CPU Adam: {e}")
    folder = cpu_build.build_directory("cpu_adam")
    assert (folder / "colfunc_cpu_adam.so").is_file()
    assert not list(tmp_path.glob(".tmp-*"))  # built aside, renamed into place
    flags_before = dict(cpu_build.FLAGS), cpu_build.LDFLAGS

    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler ran for a cached build")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    again = cpu_build.build("cpu_adam")
    assert hasattr(again, "adamw_step") and hasattr(built, "adamw_step")
    assert (dict(cpu_build.FLAGS), cpu_build.LDFLAGS) == flags_before  # (the build took copies)
    assert cpu_build.build_directory("cpu_adam") == folder
