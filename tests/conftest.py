"""Shared test settings: a hypothesis profile sized for a small shared CPU machine."""

from hypothesis import HealthCheck, settings

# Tensor work makes example timings noisy on a loaded machine: no per-example deadline, and few
# examples per property (raise with --hypothesis-profile or a per-test @settings where it pays).
settings.register_profile(
    "colfunc", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("colfunc")
