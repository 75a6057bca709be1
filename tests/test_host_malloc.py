"""The gloo ranks ``cf.launch`` starts keep freed memory for the next step (glibc's mallopt).

Differential, in a rank under each setting:

- a 20 MiB block is mapped apart by glibc's defaults (``COLFUNC_MALLOC=system``: its mapping
  threshold starts at 128 KiB and only adapts to blocks freed before) and comes from the heap
  under colfunc's setting (32 MiB), as ``mallinfo2`` shows;
- six rounds of 200 MB in 100 kB blocks (from the heap under both), freed last-first as a step's
  activations are: under colfunc's setting the rounds after the first fault about none of their
  pages in. (Under glibc's defaults they fault them all in again whenever the heap's free top
  lies where glibc can trim it, which depends on what else the process has mapped: not checked.)
"""

from __future__ import annotations

import ctypes
import functools
import resource
import subprocess
import sys

import pytest
import torch

import colfunc as cf
from colfunc.sharding import host_malloc

LIBC = host_malloc._glibc()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        LIBC is None or not hasattr(LIBC, "mallinfo2"), reason="not glibc 2.33 or later"
    ),
]

BLOCKS, NUMEL = 2000, 25_000  # 100 kB fp32 blocks
BIG = 5 * 2**20  # a 20 MiB fp32 block


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2, every field a size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


if LIBC is not None and hasattr(LIBC, "mallinfo2"):
    LIBC.mallinfo2.restype = _MallInfo2


def _mapped_bytes() -> int:
    assert LIBC is not None
    return int(LIBC.mallinfo2().hblkhd)  # bytes in blocks mapped apart from the heap


def _probe(mesh, rounds: int = 6) -> tuple[int, list[int]]:
    """(bytes mapped apart for one 20 MiB block, page faults per round of the 100 kB blocks)."""
    before = _mapped_bytes()
    big = torch.ones(BIG)
    mapped = _mapped_bytes() - before
    del big
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(NUMEL) for _ in range(BLOCKS)]
        while blocks:
            blocks.pop()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return mapped, faults


def test_gloo_ranks_keep_freed_memory_and_system_restores_glibc(monkeypatch) -> None:
    ((mapped_kept, kept),) = cf.launch(_probe, mesh={"dp": 1}, backend="gloo", timeout=120)
    monkeypatch.setenv("COLFUNC_MALLOC", "system")
    probe = functools.partial(_probe, rounds=0)  # the rounds are checked under colfunc's only
    ((mapped_system, _),) = cf.launch(probe, mesh={"dp": 1}, backend="gloo", timeout=120)
    assert mapped_system >= BIG * 4 and mapped_kept == 0, (mapped_system, mapped_kept)
    pages = BLOCKS * NUMEL * 4 // resource.getpagesize()  # what one round touches
    assert all(f < pages // 20 for f in kept[1:]), (kept, pages)  # kept and reused


def test_a_bad_setting_is_refused_before_any_rank_starts(monkeypatch) -> None:
    monkeypatch.setenv("COLFUNC_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="COLFUNC_MALLOC='jemalloc'; expected one of keep, system"):
        cf.launch(_probe, mesh={"dp": 1}, backend="gloo", timeout=60)


# a fresh process: the setting is the process's, and this one may hold it already
_STEP_PROBE = f"""
import ctypes
import torch
import colfunc as cf
from colfunc.models import gpt
from colfunc.sharding import host_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                               "fsmblks uordblks fordblks keepcost").split()]

libc = host_malloc._glibc()
libc.mallinfo2.restype = MallInfo2
cfg = gpt.Config.tiny()
step = cf.train_step(gpt.loss(cfg), cf.optim.sgd(0.1))
step.init(gpt.init(cfg, seed=0))
before = libc.mallinfo2().hblkhd
big = torch.ones({BIG})
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_after_init(monkeypatch, setting: str) -> int:
    monkeypatch.setenv("COLFUNC_MALLOC", setting)
    out = subprocess.run(
        [sys.executable, "-c", _STEP_PROBE],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


def test_a_host_step_keeps_freed_memory_from_its_init(monkeypatch) -> None:
    # Step.init of a step with parameters in host memory sets what the gloo ranks set
    kept = _mapped_after_init(monkeypatch, "keep")
    system = _mapped_after_init(monkeypatch, "system")
    assert system >= BIG * 4 and kept == 0, (system, kept)


def test_a_bad_setting_is_refused_by_step_init(monkeypatch) -> None:
    from colfunc.models import gpt

    monkeypatch.setenv("COLFUNC_MALLOC", "tcmalloc")
    step = cf.train_step(gpt.loss(gpt.Config.tiny()), cf.optim.sgd(0.1))
    with pytest.raises(ValueError, match="COLFUNC_MALLOC='tcmalloc'; expected one of keep, system"):
        step.init(gpt.init(gpt.Config.tiny(), seed=0))
