"""Rectified flow (Liu et al. 2022; Esser et al. 2024), as Open-Sora 1.2+ trains and samples it.

A clean sample ``x0`` and Gaussian noise are joined by the straight line
``x_t = (1 - t) x0 + t noise`` (``t`` in [0, 1]; :func:`interpolate`), whose velocity
``dx_t/dt = noise - x0`` (:func:`velocity`) the model learns to predict with a mean squared error
(:func:`flow_loss`). Training times are logit-normal (``sigmoid`` of a standard normal) and then
shifted towards the noisy end for larger videos (:func:`timestep_shift`, :func:`shift_ratio`), as
more pixels keep more of the signal at a given noise level. Sampling integrates the velocity
from ``t = 1`` (noise) to ``t = 0`` with Euler steps on the same shifted timesteps, with
classifier-free guidance between the conditional and the unconditional velocity
(:func:`euler_sample`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "euler_sample",
    "flow_loss",
    "interpolate",
    "sample_timesteps",
    "shift_ratio",
    "timestep_shift",
    "velocity",
]


def _broadcast(t_B: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t_B.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t noise``, ``t [B]`` broadcast over each sample."""
    t = _broadcast(t_B, x0)
    return (1 - t) * x0 + t * noise


def velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The target ``noise - x0``: the velocity of :func:`interpolate` in ``t``."""
    return noise - x0


def flow_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the predicted velocity, over every element, in fp32 at least (fp64
    stays fp64)."""
    dtype = torch.promote_types(predicted.dtype, torch.float32)
    return (predicted.to(dtype) - target.to(dtype)).pow(2).mean()


def shift_ratio(
    frames: int, height: int, width: int, *, base_resolution: int = 256, base_frames: int = 1
) -> float:
    """Open-Sora 1.2's resolution- and length-aware shift: ``sqrt(H W / base_resolution) *
    sqrt(F / base_frames)``."""
    return math.sqrt(height * width / base_resolution) * math.sqrt(frames / base_frames)


def timestep_shift(t: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ratio t / (1 + (ratio - 1) t)``: times moved towards 1 (noise) for ``ratio > 1``, the
    ends 0 and 1 kept."""
    if not ratio > 0:
        raise ValueError(f"timestep_shift: ratio must be > 0, got {ratio!r}")
    return ratio * t / (1 + (ratio - 1) * t)


def sample_timesteps(generator: torch.Generator, n: int, ratio: float = 1.0) -> torch.Tensor:
    """``n`` logit-normal training times (``sigmoid(N(0, 1))``), shifted by ``ratio``."""
    u = torch.randn(n, generator=generator)
    return timestep_shift(torch.sigmoid(u), ratio)


def euler_sample(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    cond: torch.Tensor,
    *,
    steps: int = 30,
    ratio: float = 1.0,
    guidance: float = 1.0,
    null_cond: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t, cond)`` from ``t = 1`` (``noise``) to ``t = 0`` in ``steps``
    Euler steps on the shifted timesteps; returns the sample.

    With ``guidance != 1`` the velocity is ``v(x, null) + guidance * (v(x, cond) - v(x, null))``
    (classifier-free guidance; ``null_cond`` is the empty condition, e.g. all zeros).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"euler_sample: steps must be an int >= 1, got {steps!r}")
    if guidance != 1.0 and null_cond is None:
        raise ValueError("euler_sample: classifier-free guidance needs null_cond")
    ts = timestep_shift(torch.linspace(1.0, 0.0, steps + 1), ratio)
    x = noise
    B = noise.shape[0]
    for i in range(steps):
        t = ts[i].expand(B).to(noise.device)
        if guidance == 1.0:
            v = velocity_fn(x, t, cond)
        else:
            assert null_cond is not None
            both = velocity_fn(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, null_cond]))
            v_cond, v_null = both.chunk(2)
            v = v_null + guidance * (v_cond - v_null)
        x = x + (ts[i + 1] - ts[i]).to(x.dtype) * v
    return x
