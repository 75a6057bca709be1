"""A synthetic video set every machine can make: coloured shapes moving over a few frames.

Each clip shows one shape (a square or a circle) in one colour (red, green or blue) moving two
pixels per frame in one direction (left, right, up or down) along a path centred in the frame
(give or take a pixel and a half) over a black background, values in [-1, 1]
(``[C, F, H, W]``). Its caption names the three, e.g. ``"red square moving right"``; the model sees
the caption as the ids of its three words (:func:`encode`, 0 meaning none, for classifier-free
guidance). Everything is a pure function of ``(seed, step)``, so a run's batches are the same on
every machine and under every parallel layout.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from colfunc import diffusion

__all__ = [
    "COLORS",
    "DIRECTIONS",
    "SHAPES",
    "WORDS",
    "captions",
    "clip",
    "direction_of",
    "encode",
    "training_batch",
    "validation_batches",
]

COLORS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0)}
SHAPES = ("square", "circle")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (row, col) / frame
WORDS = ("<none>", *COLORS, *SHAPES, *DIRECTIONS)  # id 0: no condition
_FILLER = {"moving", "a", "the"}
HALF = 2.0  # the shape's half side (square) or radius (circle), pixels
SPEED = 2  # pixels per frame
JITTER = 1.5  # pixels either way of the centred path where a clip starts


def captions() -> list[str]:
    """Every caption of the set, ``"<colour> <shape> moving <direction>"`` (24 of them)."""
    return [f"{c} {s} moving {d}" for c, s, d in itertools.product(COLORS, SHAPES, DIRECTIONS)]


def encode(caption: str, cond_len: int = 3) -> torch.Tensor:
    """The word ids ``[cond_len]`` of a caption (its colour, shape and direction, in any order
    and with ``moving`` or articles between); ValueError naming an unknown word."""
    if not isinstance(caption, str):
        raise TypeError(f"a caption is a str, got {type(caption).__name__}")
    words = [w for w in caption.lower().split() if w not in _FILLER]
    unknown = [w for w in words if w not in WORDS[1:]]
    if unknown:
        raise ValueError(
            f"caption {caption!r}: unknown word {unknown[0]!r}; captions name a colour "
            f"({', '.join(COLORS)}), a shape ({', '.join(SHAPES)}) and a direction "
            f"({', '.join(DIRECTIONS)}), e.g. 'red square moving right'"
        )
    if len(words) > cond_len:
        raise ValueError(f"caption {caption!r} has {len(words)} words; the model takes {cond_len}")
    ids = [WORDS.index(w) for w in words] + [0] * (cond_len - len(words))
    return torch.tensor(ids, dtype=torch.long)


def clip(
    color: str, shape: str, direction: str, start: tuple[float, float], frames: int, size: int
) -> torch.Tensor:
    """One clip ``[3, F, H, W]``: the shape centred at ``start`` (row, column) in the first
    frame, moving :data:`SPEED` pixels per frame towards ``direction``."""
    dr, dc = DIRECTIONS[direction]
    rows = torch.arange(size).float()[:, None]
    cols = torch.arange(size).float()[None, :]
    out = torch.full((3, frames, size, size), -1.0)
    rgb = torch.tensor(COLORS[color])[:, None, None]
    for f in range(frames):
        r, c = start[0] + SPEED * dr * f, start[1] + SPEED * dc * f
        if shape == "square":
            inside = ((rows - r).abs() <= HALF) & ((cols - c).abs() <= HALF)
        else:
            inside = (rows - r) ** 2 + (cols - c) ** 2 <= HALF**2
        out[:, f] = torch.where(inside, rgb, out[:, f])
    return out


def _random_clip(g: torch.Generator, frames: int, size: int) -> tuple[torch.Tensor, str]:
    color = list(COLORS)[int(torch.randint(len(COLORS), (1,), generator=g))]
    shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
    direction = list(DIRECTIONS)[int(torch.randint(len(DIRECTIONS), (1,), generator=g))]
    travel = SPEED * (frames - 1)
    dr, dc = DIRECTIONS[direction]

    def start(d: int) -> float:
        # the path is centred in the frame, give or take JITTER pixels
        centre = (size - 1) / 2 - d * travel / 2
        return centre + (2 * float(torch.rand(1, generator=g)) - 1) * JITTER

    return clip(color, shape, direction, (start(dr), start(dc)), frames, size), (
        f"{color} {shape} moving {direction}"
    )


def _generator(seed: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + salt)


def training_batch(
    cfg: Any, batch_size: int, seed: int, step: int, cond_drop: float = 0.1
) -> dict[str, torch.Tensor]:
    """The batch of training step ``step``: ``{"video" [B, C, F, H, W], "noise", "t" [B],
    "cond" [B, L]}``; a fraction ``cond_drop`` of the conditions is dropped (all ids 0) so the
    model also learns the unconditional velocity. ``cfg`` is a :class:`colfunc.models.dit.Config`."""
    if cfg.channels != 3:
        raise ValueError(f"the moving-shapes set is RGB (channels=3), the model has {cfg.channels}")
    g = _generator(seed, step, 0)
    clips, conds = [], []
    for _ in range(batch_size):
        video, caption = _random_clip(g, cfg.frames, cfg.size)
        clips.append(video)
        conds.append(encode(caption, cfg.cond_len))
    video = torch.stack(clips)
    cond = torch.stack(conds)
    drop = torch.rand(batch_size, generator=g) < cond_drop
    cond = torch.where(drop[:, None], torch.zeros_like(cond), cond)
    ratio = diffusion.shift_ratio(
        cfg.frames, cfg.size, cfg.size, base_resolution=cfg.size * cfg.size
    )
    t = diffusion.sample_timesteps(g, batch_size, ratio)
    noise = torch.randn(video.shape, generator=g)
    return {"video": video, "noise": noise, "t": t, "cond": cond}


def validation_batches(cfg: Any, batch_size: int, seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` fixed batches drawn apart from the training ones, no condition dropped."""
    return [training_batch(cfg, batch_size, seed + 7919, -(i + 1), cond_drop=0.0) for i in range(n)]


def direction_of(video_CFHW: torch.Tensor) -> str | None:
    """The direction the bright shape's centre of mass moves from the first frame to the last
    (the larger of the row and column displacements), or None when a frame shows nothing."""
    brightness = (video_CFHW.max(dim=0).values + 1) / 2  # [F, H, W], 0 black .. 1 full colour
    mass = (brightness > 0.5).float()
    total = mass.sum(dim=(1, 2))
    if bool((total == 0).any()):
        return None
    size = video_CFHW.shape[-1]
    idx = torch.arange(size, dtype=torch.float32)
    row = (mass.sum(dim=2) * idx).sum(dim=1) / total
    col = (mass.sum(dim=1) * idx).sum(dim=1) / total
    d_row, d_col = float(row[-1] - row[0]), float(col[-1] - col[0])
    if abs(d_col) >= abs(d_row):
        return "right" if d_col > 0 else "left"
    return "down" if d_row > 0 else "up"
