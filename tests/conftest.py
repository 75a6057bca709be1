"""Shared test settings: a hypothesis profile sized for a small shared CPU machine."""

import os

from hypothesis import HealthCheck, settings

# Tensor work makes example timings noisy on a loaded machine: no per-example deadline, and few
# examples per property (raise with --hypothesis-profile or a per-test @settings where it pays).
settings.register_profile(
    "colfunc", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
# CI draws the same examples on every run (derandomize), so that a red build is reproducible and
# a green one is not luck; elsewhere every run explores new examples.
settings.register_profile("ci", parent=settings.get_profile("colfunc"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "colfunc")
