"""Frozen parameters: ``cf.train_step(..., trainable=...)`` under every transform.

The single-device step with a trainable subset is checked against plain PyTorch (autograd on the
trainable tensors only, ``torch.optim.AdamW`` over them). Every composition with a drawn subset
equals that step (fp64 AdamW, 1e-9); the frozen leaves come out bit-identical; the ledger shows
no data-parallel reduction bytes for them; the optimizer state holds the trainable leaves only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import models, optim, tree
from colfunc.sharding.ledger import recording

BUDGET = "64MiB"  # (no GPU: the CPU stands for the device)
GROUPS = ["embed.*", "blocks.attn.*", "blocks.mlp.*", "blocks.ln*", "final_norm.*"]


def _problem(name: str = "gpt", seed: int = 0):
    model = getattr(models, name)
    sizes = dict(vocab_size=32, n_layer=2, n_head=2, d_model=8, max_seq_len=8)
    cfg = model.Config(**sizes, n_kv_heads=2) if name == "llama" else model.Config(**sizes)
    params = tree.map(lambda x: x.double(), model.init(cfg, seed=seed))
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _adamw() -> optim.GradientTransformation:
    return optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1)


def test_the_single_device_step_equals_plain_pytorch() -> None:
    model, cfg, params, batches = _problem()
    trainable = ["blocks.attn.*", "final_norm.*"]
    step = cf.train_step(model.loss(cfg), _adamw(), trainable=trainable)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)

    flat = dict(tree.flatten_with_paths(params)[0])
    chosen = [p for p in flat if any(tree.match(t, p) for t in trainable)]
    ref = {p: x.clone().requires_grad_(p in chosen) for p, x in flat.items()}
    opt = torch.optim.AdamW([ref[p] for p in chosen], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    nested = cf.nn.nest(ref)
    for b in batches:
        opt.zero_grad()
        model.loss(cfg)(nested, b).backward()
        assert all(ref[p].grad is None for p in flat if p not in chosen)
        opt.step()
    for p, x in tree.flatten_with_paths(state.params)[0]:
        if p in chosen:
            torch.testing.assert_close(x, ref[p].detach(), rtol=0, atol=1e-12, msg=p)
        else:
            assert torch.equal(x, flat[p]), p
    assert sorted(tree.paths(state.opt_state.exp_avg)) == sorted(chosen)


# (mesh, composition): data, tensor and both; ZeRO 0-3; a pipeline; amp (fp64) and remat on top
CASES = {
    "dp2": ({"dp": 2}, lambda s, m, plan: cf.shard(s, m)),
    "tp2": ({"tp": 2}, lambda s, m, plan: cf.shard(s, m, plan=plan)),
    "dp2xtp2": ({"dp": 2, "tp": 2}, lambda s, m, plan: cf.shard(s, m, plan=plan)),
    "zero0": ({"dp": 2}, lambda s, m, plan: cf.zero(cf.shard(s, m), stage=0)),
    "zero1": ({"dp": 2}, lambda s, m, plan: cf.zero(cf.shard(s, m), stage=1)),
    "zero2": ({"dp": 2}, lambda s, m, plan: cf.zero(cf.shard(s, m), stage=2)),
    "zero3": ({"dp": 2}, lambda s, m, plan: cf.zero(cf.shard(s, m), stage=3)),
    "zero3xtp2": ({"dp": 2, "tp": 2}, lambda s, m, plan: cf.zero(cf.shard(s, m, plan), stage=3)),
    "pp2": ({"pp": 2}, lambda s, m, plan: cf.pipeline(s, 2, microbatches=2)),
    "dp2xpp2": ({"dp": 2, "pp": 2}, lambda s, m, plan: cf.shard(cf.pipeline(s, 2, 2), m)),
    "amp-zero1": (
        {"dp": 2},
        lambda s, m, plan: cf.amp(cf.zero(cf.shard(s, m), 1), "fp64", loss_scale="dynamic"),
    ),
    "remat-tp2": ({"tp": 2}, lambda s, m, plan: cf.remat(cf.shard(s, m, plan=plan), "full")),
    # offload: frozen chunks fetched for both passes, no gradient home, no host update
    "offload-dp2": ({"dp": 2}, lambda s, m, plan: cf.offload(cf.shard(s, m), "host", BUDGET)),
    "offload-zero1": (
        {"dp": 2},
        lambda s, m, plan: cf.offload(cf.zero(cf.shard(s, m), 1), "host", BUDGET),
    ),
    "offload-zero3": (
        {"dp": 2},
        lambda s, m, plan: cf.offload(cf.zero(cf.shard(s, m), 3), "auto", BUDGET),
    ),
    "offload-tp2": ({"tp": 2}, lambda s, m, plan: cf.offload(cf.shard(s, m, plan), "host", BUDGET)),
    "offload-amp-remat": (
        {"dp": 2},
        lambda s, m, plan: cf.remat(
            cf.amp(
                cf.offload(cf.shard(s, m), "static", BUDGET, offload_params=0.5, offload_optim=1.0),
                "fp64",
            ),
            "full",
        ),
    ),
}


@settings(max_examples=16, deadline=None)
@given(
    case=st.sampled_from(sorted(CASES)),
    name=st.sampled_from(["gpt", "llama"]),
    chosen=st.sets(st.sampled_from(GROUPS), min_size=1, max_size=len(GROUPS) - 1),
)
def test_compositions_train_the_subset_and_leave_the_rest(case, name, chosen) -> None:
    model, cfg, params, batches = _problem(name)
    trainable = sorted(chosen)
    ref = cf.train_step(model.loss(cfg), _adamw(), trainable=trainable)
    mesh_shape, compose = CASES[case]

    def main(mesh: cf.Mesh):
        step = compose(ref, mesh, model.tp_plan)
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)
        state = step.init(params)
        for b in batches:
            state, _ = step(state, b)
        return cf.full_state(state)

    flat0 = dict(tree.flatten_with_paths(params)[0])
    for final in cf.launch(main, mesh=mesh_shape):
        for p, x in tree.flatten_with_paths(final.params)[0]:
            if not any(tree.match(t, p) for t in trainable):
                assert torch.equal(x, flat0[p]), p  # frozen: bit-identical
        held = set(tree.paths(final.opt_state.exp_avg))
        assert held == {p for p in flat0 if any(tree.match(t, p) for t in trainable)}


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "offload"])
@pytest.mark.parametrize("stage", [None, 0, 1, 2, 3])
def test_no_reduction_bytes_and_no_optimizer_state_for_frozen_leaves(stage, offload) -> None:
    """Freeze the embedding and the MLPs (most of the model): the data-parallel reduction sends
    no more than the trainable gradients' bytes (plus padding and the loss), the optimizer
    state is the trainable leaves' moments alone, and under offload the host gradient rows are
    the trainable leaves' (this rank's chunks of them under ZeRO-3)."""
    model, cfg, params, batches = _problem("gpt")
    trainable = ["blocks.attn.*", "blocks.ln*", "final_norm.*"]
    flat = dict(tree.flatten_with_paths(params)[0])
    train_bytes = sum(
        x.numel() * x.element_size()
        for p, x in flat.items()
        if any(tree.match(t, p) for t in trainable)
    )
    frozen_bytes = sum(x.numel() * x.element_size() for x in flat.values()) - train_bytes
    assert frozen_bytes > 2 * train_bytes

    def main(mesh: cf.Mesh):
        ref = cf.train_step(model.loss(cfg), _adamw(), trainable=trainable)
        step = cf.shard(ref, mesh)
        if stage is not None:
            step = cf.zero(step, stage=stage)
        if offload:
            step = cf.offload(step, "host", BUDGET)
        state = step.init(params)
        state, _ = step(state, batches[0])  # (the first step settles the buffers)
        mesh.ledger.reset()
        with recording(mesh):
            state, _ = step(state, batches[1])
        reduced = mesh.ledger.bytes("all_reduce", "dp") + mesh.ledger.bytes("reduce_scatter", "dp")
        host = state.extra["offload"].grads if offload else []
        host_bytes = sum(g.numel() * g.element_size() for g in host if g is not None)
        return reduced, cf.memory.report(state).optimizer, host_bytes

    for reduced, opt_bytes, host_bytes in cf.launch(main, mesh={"dp": 2}):
        if offload:
            assert host_bytes == train_bytes // (2 if stage == 3 else 1), (host_bytes, train_bytes)
        # dp=2: an all_reduce sends its tensor's bytes, a reduce-scatter half of them; padding
        # to the ranks and the loss's slot add at most a few elements per leaf
        assert reduced <= train_bytes + 64 * len(flat), (reduced, train_bytes)
        moments = 2 * train_bytes // (1 if stage in (None, 0) else 2)
        assert moments <= opt_bytes <= moments + 64 * len(flat), (opt_bytes, moments)


def test_bad_trainable_is_named() -> None:
    model, cfg, params, _ = _problem()
    with pytest.raises(ValueError, match=r"trainable='nothing\.\*' selects none of the floating"):
        cf.train_step(model.loss(cfg), _adamw(), trainable="nothing.*").init(params)
    with pytest.raises(TypeError, match="trainable must be a path pattern"):
        cf.train_step(model.loss(cfg), _adamw(), trainable={"embed": True})
    with pytest.raises(TypeError, match="trainable must be a path pattern"):
        cf.train_step(model.loss(cfg), _adamw(), trainable=[])
