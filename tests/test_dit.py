"""The spatial-temporal DiT, rectified flow and the moving-shapes set.

Each block's forward and gradients equal a plain PyTorch reference written here (fp64); training
steps under dp, tp, ZeRO-3, remat and a pipeline schedule equal one device's (fp64 Adam, 1e-9);
the rectified-flow pieces equal their formulas; ``colfunc train`` on the video config trains,
writes ``samples.gif`` and ``colfunc sample`` draws more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import diffusion, optim
from colfunc.cli import main
from colfunc.data import video
from colfunc.models import dit

pytestmark = pytest.mark.timeout(300)

SMALL = dit.Config(frames=3, size=8, patch=2, n_layer=2, n_head=2, d_model=16, d_freq=8)


def _params(cfg: dit.Config, seed: int = 1) -> Any:
    # nonzero modulation and output weights, so that every path carries a gradient
    p = dit.init(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    p["blocks"]["ada"]["weight"] = (
        torch.randn(p["blocks"]["ada"]["weight"].shape, generator=g) * 0.1
    )
    p["final"]["out"]["weight"] = torch.randn(p["final"]["out"]["weight"].shape, generator=g) * 0.1
    return cf.tree.map(lambda x: x.double(), p)


# --- the plain reference ------------------------------------------------------------------------


def _ref_mha(x: torch.Tensor, ctx: torch.Tensor, p: dict, heads: int, rope: bool) -> torch.Tensor:
    B, T, D = x.shape
    E = D // heads

    def proj(t: torch.Tensor, w: str, b: str) -> torch.Tensor:
        return (t @ p[w] + p[b]).view(t.shape[0], t.shape[1], heads, E).transpose(1, 2)

    q, k, v = proj(x, "wq", "bq"), proj(ctx, "wk", "bk"), proj(ctx, "wv", "bv")
    if rope:  # rotate-half rotary positions over the sequence (the frames)
        n = q.shape[2]
        inv = 1.0 / (10000.0 ** (torch.arange(0, E, 2, dtype=torch.float64) / E))
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rot(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t[..., : E // 2], t[..., E // 2 :]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k = rot(q), rot(k)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), dim=-1)
    y = (w @ v).transpose(1, 2).reshape(B, T, D)
    return y @ p["wo"] + p["bo"]


def _ref_block(layer: dict, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor, cfg: dit.Config):
    B, N, D = x.shape
    Fr, S = cfg.frames, cfg.tokens_per_frame
    m = (F.silu(c) @ layer["ada"]["weight"] + layer["ada"]["bias"]).chunk(9, -1)
    ln = lambda t: F.layer_norm(t, (D,), eps=cfg.norm_eps)  # noqa: E731
    mod = lambda t, i: ln(t) * (1 + m[3 * i + 1][:, None]) + m[3 * i][:, None]  # noqa: E731
    h = mod(x, 0).reshape(B * Fr, S, D)
    x = x + m[2][:, None] * _ref_mha(h, h, layer["s_attn"], cfg.n_head, False).reshape(B, N, D)
    h = mod(x, 1).reshape(B, Fr, S, D).permute(0, 2, 1, 3).reshape(B * S, Fr, D)
    h = _ref_mha(h, h, layer["t_attn"], cfg.n_head, True)
    x = x + m[5][:, None] * h.reshape(B, S, Fr, D).permute(0, 2, 1, 3).reshape(B, N, D)
    x = x + _ref_mha(x, y, layer["x_attn"], cfg.n_head, False)
    mlp = layer["mlp"]
    h = F.gelu(mod(x, 2) @ mlp["w_in"] + mlp["b_in"], approximate="tanh")
    return x + m[8][:, None] * (h @ mlp["w_out"] + mlp["b_out"])


def test_each_block_matches_the_plain_reference_forward_and_gradients() -> None:
    cfg = SMALL
    params = _params(cfg)
    g = torch.Generator().manual_seed(0)
    B, N, D = 2, cfg.frames * cfg.tokens_per_frame, cfg.d_model
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    c = torch.randn(B, D, generator=g, dtype=torch.float64)
    y = torch.randn(B, cfg.cond_len, D, generator=g, dtype=torch.float64)
    for i in range(cfg.n_layer):
        layer = cf.tree.map(lambda t, i=i: t[i].clone().requires_grad_(), params["blocks"])
        ins = [t.clone().requires_grad_() for t in (x, c, y)]
        got = dit._block(layer, {"x": ins[0], "c": ins[1], "y": ins[2]}, cfg)["x"]
        ref_layer = cf.tree.map(lambda t: t.detach().clone().requires_grad_(), layer)
        ref_ins = [t.detach().clone().requires_grad_() for t in ins]
        want = _ref_block(ref_layer, *ref_ins, cfg)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        w = torch.randn(got.shape, generator=g, dtype=torch.float64)
        leaves = [*cf.tree.leaves(layer), *ins]
        ref_leaves = [*cf.tree.leaves(ref_layer), *ref_ins]
        grads = torch.autograd.grad((got * w).sum(), leaves)
        ref_grads = torch.autograd.grad((want * w).sum(), ref_leaves)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@settings(max_examples=10)
@given(
    frames=st.integers(1, 4),
    size=st.sampled_from([4, 6, 8]),
    patch=st.sampled_from([1, 2]),
    channels=st.integers(1, 3),
)
def test_patchify_round_trips_and_cuts_patches(
    frames: int, size: int, patch: int, channels: int
) -> None:
    if size % patch:
        return
    cfg = dit.Config(channels=channels, frames=frames, size=size, patch=patch, d_model=8, n_head=2)
    x = torch.randn(2, channels, frames, size, size)
    tokens = dit.patchify(x, cfg)
    assert tokens.shape == (2, frames * (size // patch) ** 2, channels * patch * patch)
    torch.testing.assert_close(dit.unpatchify(tokens, cfg), x, rtol=0, atol=0)
    # token 0 is frame 0's top-left patch, channel-major within the patch
    torch.testing.assert_close(tokens[0, 0], x[0, :, 0, :patch, :patch].reshape(-1))


# --- rectified flow ---------------------------------------------------------------------------


def test_rectified_flow_pieces_equal_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    t = torch.tensor([0.0, 0.25, 1.0])
    xt = diffusion.interpolate(x0, noise, t)
    for i, ti in enumerate(t.tolist()):
        torch.testing.assert_close(xt[i], (1 - ti) * x0[i] + ti * noise[i])
    torch.testing.assert_close(diffusion.velocity(x0, noise), noise - x0)
    # the velocity is d x_t / d t
    d = (diffusion.interpolate(x0, noise, t + 1e-3) - xt) / 1e-3
    torch.testing.assert_close(d, noise - x0, rtol=1e-3, atol=1e-3)
    pred = torch.randn(3, 2, 4, generator=g)
    assert float(diffusion.flow_loss(pred, noise - x0)) == pytest.approx(
        float(((pred - (noise - x0)) ** 2).mean())
    )
    # the shift: ratio t / (1 + (ratio - 1) t), ends fixed, Open-Sora's ratio
    ts = torch.linspace(0, 1, 11)
    r = 2.5
    torch.testing.assert_close(diffusion.timestep_shift(ts, r), r * ts / (1 + (r - 1) * ts))
    assert diffusion.timestep_shift(torch.tensor([0.0, 1.0]), r).tolist() == [0.0, 1.0]
    assert diffusion.shift_ratio(16, 256, 256, base_resolution=512 * 512) == pytest.approx(
        math.sqrt(256 * 256 / (512 * 512)) * 4
    )
    with pytest.raises(ValueError, match="ratio must be > 0"):
        diffusion.timestep_shift(ts, 0.0)


def test_logit_normal_times_and_the_sampler() -> None:
    g = torch.Generator().manual_seed(0)
    t = diffusion.sample_timesteps(g, 20000, ratio=1.0)
    u = torch.logit(t)  # sigmoid of a standard normal: its logit is N(0, 1)
    assert abs(float(u.mean())) < 0.03 and abs(float(u.std()) - 1) < 0.03
    shifted = diffusion.sample_timesteps(torch.Generator().manual_seed(0), 20000, ratio=3.0)
    torch.testing.assert_close(shifted, diffusion.timestep_shift(t, 3.0))
    # Euler on a constant velocity field is exact: x0 = noise - v
    noise = torch.randn(4, 3, generator=g)
    v = torch.randn(4, 3, generator=g)
    out = diffusion.euler_sample(lambda x, t, c: v, noise, torch.zeros(4), steps=7, ratio=2.0)
    torch.testing.assert_close(out, noise - v)
    # guidance: v_null + w (v_cond - v_null)
    field = lambda x, t, c: c[:, None].to(x.dtype).expand_as(x)  # noqa: E731
    out = diffusion.euler_sample(
        field, noise, torch.ones(4), steps=1, guidance=3.0, null_cond=torch.zeros(4)
    )
    torch.testing.assert_close(out, noise - 3.0)
    with pytest.raises(ValueError, match="needs null_cond"):
        diffusion.euler_sample(field, noise, torch.ones(4), guidance=2.0)


# --- the data ---------------------------------------------------------------------------------


def test_clips_move_as_their_captions_say_and_batches_are_deterministic() -> None:
    cfg = dit.Config.tiny()
    a = video.training_batch(cfg, 32, seed=3, step=5, cond_drop=0.0)
    b = video.training_batch(cfg, 32, seed=3, step=5, cond_drop=0.0)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert not torch.equal(a["video"], video.training_batch(cfg, 32, seed=3, step=6)["video"])
    for clip_, ids in zip(a["video"], a["cond"]):
        words = [video.WORDS[i] for i in ids]
        assert video.direction_of(clip_) == words[2]
        assert clip_.min() >= -1 and clip_.max() <= 1
    dropped = video.training_batch(cfg, 200, seed=0, step=0)["cond"]
    share = float((dropped == 0).all(dim=1).float().mean())
    assert 0.03 < share < 0.2  # one condition in ten dropped
    assert video.encode("the blue circle moving up").tolist() == [3, 5, 8]
    with pytest.raises(ValueError, match="unknown word 'purple'"):
        video.encode("purple square moving left")


# --- training under the transforms ------------------------------------------------------------


def _dit_problem() -> tuple[Any, list[Any]]:
    params = cf.tree.map(lambda x: x.double(), dit.init(SMALL, seed=2))
    wide = lambda x: x.double() if x.is_floating_point() else x  # noqa: E731
    batches = [cf.tree.map(wide, _small_batch(i)) for i in range(2)]
    return params, batches


def _small_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    B = 4
    return {
        "video": torch.rand((B, *SMALL.video_shape), generator=g) * 2 - 1,
        "noise": torch.randn((B, *SMALL.video_shape), generator=g),
        "t": torch.rand(B, generator=g),
        "cond": torch.randint(0, SMALL.vocab_size, (B, SMALL.cond_len), generator=g),
    }


ADAM = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))


@pytest.mark.parametrize(
    "mesh,composition",
    [
        ({"dp": 2}, {"order": ("shard",)}),
        ({"tp": 2}, {"order": ("shard",)}),
        (
            {"dp": 2, "tp": 2},
            {"zero": 3, "prefetch": 1, "remat": "full", "order": ("zero", "shard", "remat")},
        ),
        ({"pp": 2}, {"pipeline": {"schedule": "1f1b", "microbatches": 2}, "order": ("shard",)}),
        ({"dp": 2}, {"zero": 2, "remat": "save_matmuls", "order": ("remat", "zero", "shard")}),
    ],
)
def test_training_steps_under_transforms_equal_one_device(mesh: dict, composition: dict) -> None:
    params, batches = _dit_problem()
    ref = cf.train_step(dit.loss(SMALL), ADAM)

    def run(m: Any) -> Any:
        step = cf.testing.compose(ref, m, {"mesh": mesh, **composition}, plan=dit.tp_plan)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(run, mesh=mesh, timeout=200)


def test_bad_batches_are_named() -> None:
    params = dit.init(SMALL)
    good = _small_batch(0)
    loss = dit.loss(SMALL)
    with pytest.raises(ValueError, match=r"\[B, C, F, H, W\] = \[B, 3, 3, 8, 8\]"):
        loss(params, {**good, "video": good["video"][:, :, :2], "noise": good["noise"][:, :, :2]})
    with pytest.raises(ValueError, match="cond must be a LongTensor"):
        loss(params, {**good, "cond": good["cond"].float()})
    with pytest.raises(ValueError, match="word id outside"):
        loss(params, {**good, "cond": good["cond"] + SMALL.vocab_size})
    with pytest.raises(ValueError, match="batch has no 'noise'"):
        loss(params, {k: v for k, v in good.items() if k != "noise"})
    with pytest.raises(ValueError, match="patch=3 must divide size=8"):
        dit.Config(size=8, patch=3)


# --- the command line -------------------------------------------------------------------------


def test_colfunc_train_writes_samples_gif_and_colfunc_sample_draws_more(tmp_path: Path) -> None:
    from PIL import Image

    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "dit_video_tiny.py"
    args = ["train", str(config), "--name", "v", "--no-progress", "--set", "train.steps=6"]
    args += ["--set", f"train.out_dir={tmp_path!s}", "--set", "train.eval_every=3"]
    assert main(args) == 0
    run = tmp_path / "v"
    assert (run / "loss.png").is_file()
    gif = Image.open(run / "samples.gif")
    assert gif.n_frames == dit.Config.tiny().frames and gif.is_animated
    more = ["--num", "2", "--steps", "3", "--out", str(tmp_path / "more.gif")]
    assert main(["sample", "--run", str(run), "--prompt", "green circle moving down", *more]) == 0
    assert Image.open(tmp_path / "more.gif").n_frames == dit.Config.tiny().frames


def test_colfunc_sample_refuses_bad_prompts_and_language_runs(tmp_path: Path, capsys: Any) -> None:
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "dit_video_tiny.py"
    args = ["train", str(config), "--name", "v", "--no-progress", "--set", "train.steps=1"]
    assert (
        main([*args, "--set", f"train.out_dir={tmp_path!s}", "--set", "train.sample_tokens=0"]) == 0
    )
    capsys.readouterr()
    assert main(["sample", "--run", str(tmp_path / "v"), "--prompt", "pink blob moving left"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown word 'pink'" in err[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_trained_tiny_dit_follows_its_condition(tmp_path: Path) -> None:
    """Trained by the example config (about 7 minutes on 2 cores), at least 80% of the clips
    sampled for each caption move in the asked direction; an untrained model about 25%."""
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "dit_video_tiny.py"
    args = ["train", str(config), "--name", "v", "--no-progress"]
    assert main([*args, "--set", f"train.out_dir={tmp_path!s}"]) == 0
    from colfunc import train, video_sample

    state, cfg = train.load_run(tmp_path / "v")
    prompts = video.captions() * 4
    for params, least, most in ((state.params, 0.8, 1.0), (dit.init(cfg.model), 0.0, 0.5)):
        clips = video_sample.sample(cfg.model, params, prompts, seed=1)
        hits = [video.direction_of(c) == p.rsplit(" ", 1)[1] for c, p in zip(clips, prompts)]
        assert least <= sum(hits) / len(hits) <= most
