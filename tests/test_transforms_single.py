"""remat, amp, memory accounting and the equivalence checker on one device.

Remat recomputes the same ops on the same inputs, so it must be bitwise equal to the plain step;
amp changes the arithmetic, so it is held to a stated tolerance against the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

import colfunc as cf
from colfunc import models, optim

MODELS = {"gpt": models.gpt, "llama": models.llama}


def _batches(cfg, n: int, B: int = 2, T: int = 24, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _setup(name: str, n_layer: int = 2):
    model = MODELS[name]
    cfg = model.Config(vocab_size=61, n_layer=n_layer, n_head=4, d_model=32, max_seq_len=32)
    return model, cfg, model.init(cfg, seed=1)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("policy", ["full", "save_matmuls", "none", {"mm", "addmm"}])
def test_remat_is_bitwise_equal_to_the_reference(name, policy) -> None:
    model, cfg, params = _setup(name)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    cf.testing.assert_equivalent(cf.remat(ref, policy), ref, params, _batches(cfg, 3))


def test_remat_full_cuts_peak_activation_bytes_to_a_third() -> None:
    cfg = models.gpt.Config(n_layer=8)  # the 8-layer tiny GPT
    params = models.gpt.init(cfg)
    batch = _batches(cfg, 1, B=8, T=128)[0]
    ref = cf.train_step(models.gpt.loss(cfg), optim.adamw(1e-3))
    peaks = {}
    for policy in ("none", "full"):
        step = cf.remat(ref, policy)
        with cf.memory.track(params) as t:
            loss, grads = step.forward_backward(params, batch, {})
        # the gradients are allocated whatever the policy: what is left is activations
        peaks[policy] = t.peak - cf.tree.size_bytes(grads)
        del loss, grads
    assert peaks["full"] <= peaks["none"] / 3, peaks


def test_track_counts_live_bytes_and_frees() -> None:
    with cf.memory.track() as t:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # +4000
        del a
        c = b + 1  # +4000 while b is alive: peak 8000 after a is freed
        del b, c
    assert t.peak == 8000
    assert t.live == 0
    assert t.allocated == 12000


def test_report_counts_adamw_states() -> None:
    model, cfg, params = _setup("gpt")
    state = cf.train_step(model.loss(cfg), optim.adamw(1e-3)).init(params)
    r = cf.memory.report(state)
    n = sum(x.numel() for x in cf.tree.tensors(params))
    assert (r.params, r.grads, r.optimizer) == (4 * n, 4 * n, 8 * n)  # fp32: p, g, m and v


@pytest.mark.parametrize("name", sorted(MODELS))
def test_amp_bf16_tracks_the_fp32_reference(name) -> None:
    model, cfg, params = _setup(name)
    lr, steps = 1e-3, 3
    ref = cf.train_step(model.loss(cfg), optim.adamw(lr))
    mixed = cf.amp(ref, torch.bfloat16)
    s_ref, s_mix = ref.init(params), mixed.init(params)
    for batch in _batches(cfg, steps):
        s_ref, m_ref = ref(s_ref, batch)
        s_mix, m_mix = mixed(s_mix, batch)
        # bf16 keeps 8 bits of mantissa: losses agree to about 1%
        assert float(m_mix["loss"]) == pytest.approx(float(m_ref["loss"]), rel=1e-2)
    mix, ref_, init = (cf.tree.tensors(t) for t in (s_mix.params, s_ref.params, params))
    for a, e in zip(mix, ref_):
        assert a.dtype == torch.float32  # masters stay fp32
        # an Adam update is at most about lr per element and step, so two trajectories cannot
        # drift further apart than that
        assert (a - e).abs().max() <= 2 * steps * lr
    # and the total updates point the same way
    d_mix = torch.cat([(a - p).flatten() for a, p in zip(mix, init)])
    d_ref = torch.cat([(e - p).flatten() for e, p in zip(ref_, init)])
    assert torch.nn.functional.cosine_similarity(d_mix, d_ref, dim=0) >= 0.95


def test_amp_fp32_without_scaling_is_the_reference() -> None:
    model, cfg, params = _setup("gpt")
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    cf.testing.assert_equivalent(cf.amp(ref, torch.float32), ref, params, _batches(cfg, 2))


def _poisoned_loss(model, cfg):
    base = model.loss(cfg)

    def loss_fn(params, batch):
        value = base(params, batch)
        return value * batch["poison"] if "poison" in batch else value

    return loss_fn


def test_amp_dynamic_scale_skips_overflow_and_grows() -> None:
    model, cfg, params = _setup("gpt")
    step = cf.amp(
        cf.train_step(_poisoned_loss(model, cfg), optim.adamw(1e-2)),
        torch.float16,
        "dynamic",
        growth_interval=2,
    )
    state = step.init(params)
    assert state.extra["loss_scale"] == 2.0**16
    good, bad = _batches(cfg, 2)
    bad = {**bad, "poison": torch.tensor(float("inf"))}

    after, metrics = step(state, bad)
    assert metrics["skipped"] and after.extra["loss_scale"] == 2.0**15
    assert float(metrics["grad_norm"]) == float("inf")
    cf.testing.assert_trees_close(after.params, state.params)  # bitwise unchanged
    cf.testing.assert_trees_close(after.opt_state, state.opt_state)
    assert after.step == 1

    s1, m1 = step(after, good)
    s2, m2 = step(s1, good)
    assert not m1["skipped"] and not m2["skipped"]
    assert s1.extra["loss_scale"] == 2.0**15 and s2.extra["loss_scale"] == 2.0**16  # grew
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(cf.tree.tensors(s2.params), cf.tree.tensors(after.params))
    )
    assert moved > 0


def test_assert_equivalent_detects_a_difference() -> None:
    model, cfg, params = _setup("gpt")
    a = cf.train_step(model.loss(cfg), optim.adamw(1e-2))
    b = cf.train_step(model.loss(cfg), optim.adamw(1.1e-2))
    with pytest.raises(AssertionError, match="params"):
        cf.testing.assert_equivalent(a, b, params, _batches(cfg, 1))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: cf.remat(s, "most"), "unknown policy 'most'"),
        (lambda s: cf.amp(s, "fp8"), "unknown dtype 'fp8'"),
        (lambda s: cf.amp(s, torch.float16, "auto"), "loss_scale"),
        (lambda s: cf.amp(s, torch.float16, -1.0), "loss_scale"),
    ],
)
def test_bad_options_are_named(call, match) -> None:
    model, cfg, _ = _setup("gpt")
    with pytest.raises(ValueError, match=match):
        call(cf.train_step(model.loss(cfg), optim.adamw(1e-2)))
