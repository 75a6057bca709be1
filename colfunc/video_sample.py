"""Sampling a trained DiT's clips, and writing them as an animated GIF (``colfunc sample``).

:func:`sample` integrates the rectified flow from noise with Euler steps and classifier-free
guidance (:func:`colfunc.diffusion.euler_sample`) for each caption; :func:`write_gif` lays the
clips out side by side, enlarged, one GIF frame per video frame, with Pillow.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from colfunc import diffusion, tree
from colfunc.data import video

__all__ = ["sample", "write_gif"]


@torch.no_grad()
def sample(
    cfg: Any,
    params: Any,
    prompts: Sequence[str],
    *,
    seed: int = 0,
    steps: int = 30,
    guidance: float = 4.0,
) -> torch.Tensor:
    """One clip ``[C, F, H, W]`` per prompt (stacked: ``[n, C, F, H, W]``, values in [-1, 1]),
    a pure function of ``seed``. ``cfg`` is the DiT's :class:`~colfunc.models.dit.Config`."""
    from colfunc.models import dit

    if not prompts:
        raise ValueError("sample: give at least one prompt, e.g. 'red square moving right'")
    cond = torch.stack([video.encode(p, cfg.cond_len) for p in prompts])
    dtype = next(iter(tree.tensors(params))).dtype
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(prompts), *cfg.video_shape), generator=g).to(dtype)
    ratio = diffusion.shift_ratio(cfg.frames, cfg.size, cfg.size, base_resolution=cfg.size**2)

    def v(x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return dit.apply(params, x, t.to(dtype), c, cfg)

    out = diffusion.euler_sample(
        v,
        noise,
        cond,
        steps=steps,
        ratio=ratio,
        guidance=guidance,
        null_cond=torch.zeros_like(cond),
    )
    return out.clamp(-1, 1)


def write_gif(
    clips: torch.Tensor,
    path: str | Path,
    *,
    labels: Sequence[str] | None = None,
    scale: int = 4,
    columns: int = 8,
    ms_per_frame: int = 200,
) -> Path:
    """Write ``clips [n, 3, F, H, W]`` (values in [-1, 1]) as one looping GIF: a grid of
    ``columns`` clips per row, each pixel ``scale`` x ``scale``. ``labels`` (one per clip) go to
    the GIF's comment, in grid order."""
    from PIL import Image

    if clips.dim() != 5 or clips.shape[1] != 3:
        raise ValueError(f"write_gif: clips must be [n, 3, F, H, W], got {tuple(clips.shape)}")
    n, _, frames, H, W = clips.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    pad = 2
    pixels = ((clips.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    images = []
    for f in range(frames):
        canvas = torch.full(
            (rows * (H + pad) + pad, cols * (W + pad) + pad, 3), 40, dtype=torch.uint8
        )
        for i in range(n):
            r, c = divmod(i, cols)
            y, x = pad + r * (H + pad), pad + c * (W + pad)
            canvas[y : y + H, x : x + W] = pixels[i, :, f].permute(1, 2, 0)
        img = Image.fromarray(canvas.numpy(), "RGB")
        images.append(img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST))
    path = Path(path)
    comment = "; ".join(labels) if labels else ""
    images[0].save(
        path,
        save_all=True,
        append_images=images[1:],
        duration=ms_per_frame,
        loop=0,
        comment=comment.encode(),
    )
    return path
