"""The composed step on real processes over gloo equals the single-device step.

One launch of 4 processes (``dp=2, tp=2``, ZeRO stage 3, full remat) runs 3 steps of the tiny
GPT and checks losses and final parameters on every rank against the reference computed in each
process (fp64, as in the threads tests).
"""

from __future__ import annotations

import pytest
import torch

import colfunc as cf
from colfunc import models, optim

pytestmark = pytest.mark.timeout(240)


def _composed_equals_reference(mesh):
    model = models.gpt
    cfg = model.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.double(), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    ref = cf.train_step(
        model.loss(cfg), optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2))
    )
    step = cf.remat(cf.zero(cf.shard(ref, mesh, plan=model.tp_plan), stage=3), "full")
    losses = cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
    return losses, cf.sharding.fallback_counts(mesh)


def test_dp2_tp2_zero3_remat_on_gloo_processes() -> None:
    results = cf.launch(
        _composed_equals_reference, mesh={"dp": 2, "tp": 2}, backend="gloo", timeout=180
    )
    assert len(results) == 4
    for losses, fallbacks in results:
        assert fallbacks == {}
        assert losses == results[0][0]  # every rank saw the same losses
