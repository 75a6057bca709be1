"""The gloo ranks ``cf.launch`` starts keep freed memory for the next step (glibc's mallopt).

Differential: the same allocation pattern (forty megabytes in 2 MiB blocks, all freed, six
times over) faults its pages in every round under glibc's defaults (``COLFUNC_MALLOC=system``)
and about never after the first rounds under colfunc's setting.
"""

from __future__ import annotations

import resource

import pytest
import torch

import colfunc as cf
from colfunc.sharding import host_malloc

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(host_malloc._glibc() is None, reason="the C library is not glibc"),
]


def _faults_per_round(mesh) -> list[int]:
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(2**19) for _ in range(20)]
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


def test_gloo_ranks_keep_freed_memory_and_system_restores_glibc(monkeypatch) -> None:
    (kept,) = cf.launch(_faults_per_round, mesh={"dp": 1}, backend="gloo", timeout=120)
    monkeypatch.setenv("COLFUNC_MALLOC", "system")
    (system,) = cf.launch(_faults_per_round, mesh={"dp": 1}, backend="gloo", timeout=120)
    pages = 20 * 2**21 // resource.getpagesize()  # what one round touches
    assert all(f > pages // 2 for f in system[2:])  # glibc gave it back and faults it in again
    assert all(f < pages // 20 for f in kept[2:])


def test_a_bad_setting_is_refused_before_any_rank_starts(monkeypatch) -> None:
    monkeypatch.setenv("COLFUNC_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="COLFUNC_MALLOC='jemalloc'; expected one of keep, system"):
        cf.launch(_faults_per_round, mesh={"dp": 1}, backend="gloo", timeout=60)
