"""Data, tensor and ZeRO parallelism, in any composition, equal the single-device step.

Each drawn composition (mesh, ZeRO stage, remat policy, order of application) runs 3 training
steps of a tiny model on the threads backend and must give the single-device losses and final
parameters. The runs are in fp64, where rounding noise is negligible, so a tolerance of 1e-9
relative separates "the same maths" from "different maths" sharply even through Adam (which
divides by each gradient's own magnitude and so magnifies fp32 noise in near-zero gradients);
an fp32 run with SGD checks the fp32 path at relative 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import colfunc as cf
from colfunc import models, optim

pytestmark = pytest.mark.timeout(240)

MODELS = {"gpt": models.gpt, "llama": models.llama}


def _problem(name: str, dtype: torch.dtype = torch.float64):
    model = MODELS[name]
    cfg = model.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.to(dtype), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _check(name, composition, opt, dtype, rtol, atol):
    model, cfg, params, batches = _problem(name, dtype)
    ref = cf.train_step(model.loss(cfg), opt)

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=model.tp_plan)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=rtol, atol=atol)

    cf.sharding.reset_fallback_counts()
    cf.launch(main, mesh=composition["mesh"], timeout=120)
    assert cf.sharding.fallback_counts() == {}, "the tensor-parallel hot path fell back"


ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=6)
@given(composition=cf.testing.compositions())
def test_compositions_equal_single_device_fp64(name, composition) -> None:
    _check(name, composition, ADAM_CLIP, torch.float64, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp2_tp2_every_stage_fp32(name, stage) -> None:
    comp = {
        "mesh": {"dp": 2, "tp": 2},
        "zero": stage,
        "remat": "full",
        "order": ("shard", "zero", "remat"),
    }
    _check(name, comp, optim.sgd(0.1, momentum=0.9), torch.float32, rtol=1e-5, atol=1e-6)


def test_zero_on_one_rank_is_bitwise_the_reference() -> None:
    model, cfg, params, batches = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    for stage in (0, 1, 2, 3):

        def main(mesh, stage=stage):
            return cf.testing.assert_equivalent(
                cf.zero(cf.shard(ref, mesh), stage), ref, params, batches
            )

        cf.launch(main, mesh={"dp": 1})


@pytest.mark.parametrize("n", [2, 4])
def test_ledger_matches_zero_theory(n) -> None:
    """Elements sent per rank per step: 2*Psi*(N-1)/N for stages 0-2, 3*Psi*(N-1)/N for stage 3.

    Stage 3 re-gathers the stacked layers for the backward pass but keeps the few parameters
    outside them (embeddings, final norm) gathered through the step, so those cost 2 instead of
    3. Parameters are padded to a multiple of N before being cut. Besides, one scalar all_reduce
    averages the loss, and in stages 1-3 one more adds up the squared gradient norm.
    """
    model, cfg, params, batches = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-3))
    pad = lambda k: -(-k // n) * n  # noqa: E731
    psi = sum(x.numel() for x in cf.tree.tensors(params))
    layers = sum(pad(x[0].numel()) * x.shape[0] for x in cf.tree.tensors(params["blocks"]))
    rest = sum(
        pad(x.numel())
        for p, x in cf.tree.flatten_with_paths(params)[0]
        if not p.startswith("blocks")
    )
    ring = (n - 1) / n
    expected = {  # stacked layers are cut (so padded) layer by layer in every stage
        0: 2 * (psi + 1) * ring,
        1: (2 * (layers + rest) + 2 * 2) * ring,
        2: (2 * (layers + rest) + 2 * 2) * ring,
        3: (3 * layers + 2 * rest + 2 * 2) * ring,
    }
    for stage, want in expected.items():

        def main(mesh, stage=stage):
            step = cf.zero(cf.shard(ref, mesh), stage)
            state = step.init(params)
            with cf.sharding.recording() as led:
                step(state, batches[0])
            return led.bytes(axis="dp") / 4

        got = cf.launch(main, mesh={"dp": n})
        assert all(g == pytest.approx(want, rel=1e-9) for g in got), (stage, got, want)


@pytest.mark.parametrize("stage", [1, 3])
def test_clipping_reuses_the_gradient_norm_of_the_metrics(stage) -> None:
    """Clipping by the global norm sends nothing more: the step's one norm all_reduce serves the
    metrics and the clip alike (and amp's overflow check adds only its flag)."""
    model, cfg, params, batches = _problem("gpt", torch.float32)

    def sent(opt, mesh):
        step = cf.zero(cf.shard(cf.train_step(model.loss(cfg), opt), mesh), stage)
        state = step.init(params)
        with cf.sharding.recording() as led:
            led.reset()
            step(state, batches[0])
        return led.bytes("all_reduce")

    def main(mesh):
        plain, clipped = (
            optim.adamw(1e-3),
            optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3)),
        )
        return sent(plain, mesh), sent(clipped, mesh)

    for plain, clipped in cf.launch(main, mesh={"dp": 2}):
        assert clipped == plain


def test_memory_report_follows_the_zero_formulas() -> None:
    """fp32 Adam: 4 bytes of parameter, 4 of gradient and 8 of state per element (K = 8).

    The paper's stage 1 keeps the whole gradient; a functional step reduce-scatters the gradients
    as soon as the backward pass returns them, so from stage 1 on the held gradient is one chunk
    (stage 1 needs the stage-2 memory for gradients).
    """
    model, cfg, params, batches = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-3))
    psi = sum(x.numel() for x in cf.tree.tensors(params))
    n = 4
    formula = {
        0: 4 * psi + 4 * psi + 8 * psi,
        1: 4 * psi + 4 * psi / n + 8 * psi / n,
        2: 4 * psi + 4 * psi / n + 8 * psi / n,
        3: (4 + 4 + 8) * psi / n,
    }
    for stage, want in formula.items():

        def main(mesh, stage=stage):
            step = cf.zero(cf.shard(ref, mesh), stage)
            state = step.init(params)
            _, grads = step.forward_backward(state.params, batches[0], state.extra)
            return cf.memory.report(state, step.sync(grads)).total

        for got in cf.launch(main, mesh={"dp": n}):
            assert got == pytest.approx(want, rel=0.05), (stage, got, want)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda s, m: cf.shard(s, m, plan={"blocks.nope": cf.P(None, "tp")}),
            "matches no parameter",
        ),
        (lambda s, m: cf.shard(s, m, plan={"blocks.attn.wq": cf.P(None, None, "ep")}), "lacks"),
        (lambda s, m: cf.zero(cf.shard(s, m), stage=4), "stage must be"),
        (lambda s, m: cf.zero(cf.shard(s, m), axis="pp"), "not an axis"),
        (lambda s, m: cf.remat(s, "sometimes"), "unknown policy"),
    ],
)
def test_bad_compositions_are_named(build, match) -> None:
    model, cfg, params, _ = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.sgd(0.1))

    def main(mesh):
        build(ref, mesh).init(params)

    with pytest.raises(cf.sharding.RankFailedError, match=match):
        cf.launch(main, mesh={"dp": 1, "tp": 2})


def test_indivisible_batch_and_heads_are_named() -> None:
    model, cfg, params, batches = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.sgd(0.1))
    odd = {k: v[:3] for k, v in batches[0].items()}

    def uneven_batch(mesh):
        step = cf.shard(ref, mesh)
        step(step.init(params), odd)

    with pytest.raises(cf.sharding.RankFailedError, match="not divisible by the 'dp' axis size 2"):
        cf.launch(uneven_batch, mesh={"dp": 2})

    cfg3 = models.gpt.Config(vocab_size=64, n_layer=1, n_head=3, d_model=24, max_seq_len=32)

    def uneven_heads(mesh):
        cf.shard(
            cf.train_step(models.gpt.loss(cfg3), optim.sgd(0.1)), mesh, models.gpt.tp_plan
        ).init(models.gpt.init(cfg3))

    with pytest.raises(cf.sharding.RankFailedError, match="not divisible"):
        cf.launch(uneven_heads, mesh={"tp": 2})


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("outer", [False, True])
def test_amp_bf16_in_a_composition_tracks_the_fp32_reference(name, outer) -> None:
    """bf16 changes the arithmetic: the stated tolerance is that of the single-device amp test.

    Losses within 1% relative at every step; after 3 Adam steps no parameter further than
    2 * steps * lr from the fp32 reference (an Adam update moves an element by about lr at most),
    and the total updates pointing the same way (cosine similarity >= 0.95).
    """
    model, cfg, params, batches = _problem(name, torch.float32)
    lr = 1e-3
    ref = cf.train_step(model.loss(cfg), optim.adamw(lr))
    ref_state, ref_losses = ref.init(params), []
    for b in batches:
        ref_state, m = ref(ref_state, b)
        ref_losses.append(float(m["loss"]))

    def main(mesh):
        if outer:
            step = cf.amp(cf.zero(cf.shard(ref, mesh, model.tp_plan), 2), torch.bfloat16, "dynamic")
        else:
            step = cf.zero(cf.shard(cf.amp(ref, torch.bfloat16), mesh, model.tp_plan), 2)
        state, losses = step.init(params), []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return losses, cf.full_state(state).params

    for losses, final in cf.launch(main, mesh={"dp": 2, "tp": 2}, timeout=120):
        assert losses == pytest.approx(ref_losses, rel=1e-2)
        got, want, init = (cf.tree.tensors(t) for t in (final, ref_state.params, params))
        for a, e in zip(got, want):
            assert a.dtype == torch.float32
            assert (a - e).abs().max() <= 2 * len(batches) * lr
        d_got = torch.cat([(a - p).flatten() for a, p in zip(got, init)])
        d_want = torch.cat([(e - p).flatten() for e, p in zip(want, init)])
        assert torch.nn.functional.cosine_similarity(d_got, d_want, dim=0) >= 0.95


def test_amp_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    """Ranks that hold different gradients (pipeline stages, ZeRO chunks, tensor shards) must
    agree on skipping: an inf in rank 0's gradients alone halves the scale everywhere."""
    model, cfg, params, _ = _problem("gpt", torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.adamw(1e-3))

    def main(mesh):
        step = cf.amp(ref, torch.float16, "dynamic")
        state = step.init(params)
        grads = cf.tree.map(torch.ones_like, params)
        if mesh.rank == 0:
            grads["final_norm"]["weight"] = torch.full_like(
                grads["final_norm"]["weight"], float("inf")
            )
        new, info = step.update(grads, state)
        unchanged = all(
            torch.equal(a, b)
            for a, b in zip(cf.tree.tensors(new.params), cf.tree.tensors(state.params))
        )
        return info["skipped"], new.extra["loss_scale"], unchanged

    assert cf.launch(main, mesh={"pp": 2}) == [(True, 2.0**15, True)] * 2
