"""Shared test settings: a hypothesis profile sized for a small shared CPU machine, and under CI
a hypothesis seed derived from the commit."""

import os
import subprocess
from pathlib import Path

from hypothesis import HealthCheck, settings

# Tensor work makes example timings noisy on a loaded machine: no per-example deadline, and few
# examples per property (raise with --hypothesis-profile or a per-test @settings where it pays).
settings.register_profile(
    "colfunc", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
# CI draws from a seed fixed by the commit (see pytest_configure) and keeps no example database:
# each run is reproducible with the printed seed, and successive commits explore new examples.
settings.register_profile("ci", parent=settings.get_profile("colfunc"), database=None)
settings.load_profile("ci" if os.environ.get("CI") else "colfunc")


def _commit_seed() -> int | None:
    """The first 32 bits of this checkout's commit, if it is a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        return int(sha[:8], 16)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


_SEED: int | None = None


def pytest_configure(config):  # type: ignore[no-untyped-def]
    global _SEED
    if not os.environ.get("CI") or config.getoption("hypothesis_seed", None) is not None:
        return
    _SEED = _commit_seed()
    if _SEED is not None:
        from hypothesis import core

        core.global_force_seed = _SEED  # what --hypothesis-seed sets


def _say_seed(config) -> None:  # type: ignore[no-untyped-def]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _SEED is not None and reporter is not None:
        reporter.write_line(
            f"hypothesis seed {_SEED} from the commit (reproduce: pytest --hypothesis-seed={_SEED})"
        )


def pytest_sessionstart(session):  # type: ignore[no-untyped-def]
    _say_seed(session.config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    _say_seed(config)
