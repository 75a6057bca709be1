"""Mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE as configurations of the shared
decoder (``colfunc.nn.moe``'s sparse MLP, ``colfunc.ops.moe_ffn``'s experts).

For each family, on tiny random ``transformers`` models built here: logits equal
``transformers``' within 1e-5 (fp32), and so does the loss with the load-balancing term when
the config asks for router logits; one AdamW step equals ``transformers`` + ``torch.optim.AdamW``
(fp64; ``transformers`` takes the router's softmax in fp32, so to the precision that allows);
dp2 with ZeRO-3, tp2, a 2-stage pipeline, offload and amp with remat equal one device (fp64
AdamW, 1e-9); the engine's greedy tokens equal ``generate``'s; export then ``from_pretrained``
gives the same logits. The ops: the grouped matmul and the experts' feed-forward (forward and
backward) against loops over experts and tokens, on drawn shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import hf, models, nn, ops, optim, tree
from colfunc.inference import Engine, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

SIZES = dict(
    vocab_size=53, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=24, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=0,
    eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "shared_expert_intermediate_size": 20},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "norm_topk_prob": True, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip


def _hf(name: str, seed: int = 0, **extra: Any) -> Any:
    cls, fields = FAMILIES[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(  # (its loop over experts takes fp64)
        getattr(transformers, cls)(**{**SIZES, **fields, **extra}), experts_implementation="eager"
    )
    with torch.no_grad():  # routers and experts drawn wide (Qwen's routers start at zero)
        for n, p in model.named_parameters():
            if ".gate." in n or "experts" in n or "shared_expert" in n:
                p.normal_(0, 0.3)
    model.generation_config.eos_token_id = None
    return model.eval()


def _fp64(name: str, seed: int = 3, **extra: Any) -> tuple[Any, Any, Any]:
    """(config, fp64 params, module) of a random ``name`` whose loss has the load-balancing term."""
    model = _hf(name, seed, output_router_logits=True, router_aux_loss_coef=0.02, **extra)
    cfg, params = hf.from_hf(model)
    return cfg, tree.map(lambda x: x.double(), params), models.of_config(cfg).module


def _batch(seed: int, rows: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SIZES["vocab_size"], (rows, length), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_loss_with_the_auxiliary_term_equal_transformers(name: str) -> None:
    model = _hf(name, output_router_logits=True, router_aux_loss_coef=0.05)
    cfg, params = hf.from_hf(model)
    assert type(cfg).__module__ == f"colfunc.models.{name}" and cfg.router_aux_loss_coef == 0.05
    module = models.of_config(cfg).module
    batch = _batch(1)
    with torch.no_grad():
        out = model(**batch)
        torch.testing.assert_close(module.apply(params, batch["input_ids"], cfg), out.logits,
                                   rtol=0, atol=1e-5)  # fmt: skip
        loss = module.loss(cfg)(params, batch)
    assert out.aux_loss is not None and float(out.aux_loss) > 1.0  # (E * sum f P >= 1)
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_adamw_step_equals_transformers(name: str) -> None:
    model = _hf(name, seed=2).double().train()
    cfg, params = hf.from_hf(model)
    batch = _batch(2)
    # eps 1e-4: the first update is lr * g / (|g| + eps); transformers' router softmax in fp32
    # leaves its fp64 gradients fp32-accurate, which moves the update by at most lr * d / eps
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    model(**batch).loss.backward()
    opt.step()
    step = cf.train_step(models.of_config(cfg).module.loss(cfg), optim.adamw(**hyper))
    state, _ = step(step.init(params), batch)
    want = dict(tree.flatten_with_paths(hf.from_hf(model)[1])[0])
    got = dict(tree.flatten_with_paths(state.params)[0])
    assert got.keys() == want.keys()
    for path, x in got.items():
        torch.testing.assert_close(x, want[path], rtol=0, atol=1e-5, msg=path)
    moved = max(
        (x - dict(tree.flatten_with_paths(params)[0])[p]).abs().max().item() for p, x in got.items()
    )
    assert moved >= 0.5e-2


def _compose(how: str, step: cf.Step, mesh: cf.Mesh, plan: Any) -> cf.Step:
    if how == "dp2_zero3":
        return cf.zero(cf.shard(step, mesh), stage=3)
    if how == "tp2":
        return cf.shard(step, mesh, plan=plan)
    if how == "pp2":
        return cf.pipeline(step, 2, microbatches=2)
    if how == "offload":  # ZeRO-3's pieces, experts included, homed on the host
        return cf.remat(cf.offload(cf.zero(cf.shard(step, mesh), 3), "host", "2MiB"), "full")
    return cf.remat(cf.amp(cf.zero(cf.shard(step, mesh), 2), "fp64"), "full")


MESHES = {"dp2_zero3": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "offload": {"dp": 2},
          "amp_remat": {"dp": 2}}  # fmt: skip


def _per_half(loss: Any) -> Any:
    """The loss of a batch as the mean of its two halves' (rows split in two): what data
    parallelism over two ranks and a pipeline of two microbatches compute, the load-balancing
    term being taken from each half's own routing (as Megatron and ``transformers`` take it)."""

    def halves(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["input_ids"].shape[0] // 2
        parts = [{k: v[a : a + n] for k, v in batch.items()} for a in (0, n)]
        return (loss(params, parts[0]) + loss(params, parts[1])) / 2

    return halves


@pytest.mark.parametrize("how", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_transforms_equal_one_device(name: str, how: str) -> None:
    cfg, params, module = _fp64(name)
    batches = [_batch(10 + k, rows=4, length=8) for k in range(2)]
    opt = optim.adamw(1e-2, weight_decay=0.1)
    ref = cf.train_step(module.loss(cfg), opt)
    split = _per_half(module.loss(cfg)) if how != "tp2" else module.loss(cfg)
    want = cf.train_step(split, opt)  # (the reference: one device)

    def main(mesh: cf.Mesh):
        step = _compose(how, ref, mesh, module.tp_plan)
        return cf.testing.assert_equivalent(step, want, params, batches, rtol=1e-9, atol=1e-9)

    for losses in cf.launch(main, mesh=MESHES[how]):
        assert len(losses) == len(batches)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_engine_gives_generates_greedy_tokens(name: str) -> None:
    model = _hf(name, seed=7)
    cfg, params = hf.from_hf(model)
    prompts = [[1, 2, 3, 4], [50, 9, 30, 31, 32, 7, 7, 8, 40, 41, 2, 3]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(models.of_config(cfg).module, cfg, params, block_size=4, num_blocks=32)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want
    assert cf.testing.greedy_with_preemption(engine, prompts, greedy) == want

    def main(mesh: cf.Mesh):  # every expert's width split over tp (Megatron's MLP per expert)
        tp = Engine(
            models.of_config(cfg).module, cfg, params, mesh=mesh, block_size=4, num_blocks=32
        )
        return [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)]

    for tokens in cf.launch(main, mesh={"tp": 2}):
        assert tokens == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_loads_back(name: str, tmp_path: Path) -> None:
    model = _hf(name, seed=4)
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "out", cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(model)
    ids = _batch(5)["input_ids"]
    with torch.no_grad():  # (the loaded module fuses each expert's gate and up projections)
        got, want = back(input_ids=ids).logits, model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for again in (hf.from_hf(back)[1], hf.load(f"hf:{tmp_path / 'out'}")[1]):  # bit for bit
        pairs = zip(tree.flatten_with_paths(params)[0], tree.flatten_with_paths(again)[0])
        for (p, x), (_, y) in pairs:
            assert torch.equal(x, y), p


def test_bad_configs_are_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"n_experts_per_tok=5 must be an int in \[1, n_experts=4\]"
    ):
        models.mixtral.Config(n_experts=4, n_experts_per_tok=5)
    with pytest.raises(ValueError, match="n_experts must be an int >= 0"):
        models.decoder.Config(n_experts=-1)
    with pytest.raises(
        ValueError, match=r"capacity_factor must be None \(dropless\) or a number > 0, got -1"
    ):
        models.qwen3_moe.Config(n_experts=4, n_experts_per_tok=2, capacity_factor=-1)
    with pytest.raises(ValueError, match="router_aux_loss_coef must be a number >= 0"):
        models.mixtral.Config(router_aux_loss_coef=-0.1)
    with pytest.raises(ValueError, match="n_experts=4: not a variation this family has"):
        models.llama.Config(n_experts=4)
    with pytest.raises(ValueError, match=r"router_jitter_noise=0\.1 is not supported"):
        hf.from_hf(_hf("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match=r"Qwen2-MoE with no sparse layer .*mlp_only_layers=\[1\]"):
        hf.from_hf(_hf("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[1]))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), e=st.integers(1, 9), k=st.integers(1, 9), seed=st.integers(0, 99))
def test_renormalized_weights_are_the_softmax_of_the_top_k_logits(n, e, k, seed) -> None:
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    x, router = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, 5), (5, e)))
    r = nn.moe.route(x, router, k, norm_topk_prob=True)
    top = torch.topk(x @ router, k, dim=-1)  # (top-k, then the softmax: Switch's order)
    assert torch.equal(r.topi, top.indices)
    torch.testing.assert_close(r.topw, torch.softmax(top.values, -1), rtol=0, atol=1e-12)


# --- the ops -------------------------------------------------------------------------------------


def _loop(x, topi, topw, wg, wu, wd):  # type: ignore[no-untyped-def]
    """Each token's choices one at a time: the definition."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(topi.shape[1]):
            e = int(topi[t, j])
            h = torch.nn.functional.silu(x[t] @ wg[e]) * (x[t] @ wu[e])
            acc = acc + topw[t, j] * (h @ wd[e])
        rows.append(acc)
    return torch.stack(rows)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 12), d=st.integers(1, 6), f=st.integers(1, 5), e=st.integers(1, 5),
    k=st.integers(1, 3), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_moe_ffn_and_its_gradients_equal_the_loop(n, d, f, e, k, seed) -> None:
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, router = rand(n, d), rand(d, e)
    wg, wu, wd = rand(e, d, f), rand(e, d, f), rand(e, f, d)
    r = nn.route(x, router, k, norm_topk_prob=bool(seed % 2))
    got, counts = ops.moe_ffn(x, r.topi, r.topw, wg, wu, wd)
    assert counts.tolist() == torch.bincount(r.topi.reshape(-1), minlength=e).tolist()
    want = _loop(x, r.topi, r.topw, wg, wu, wd)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn(n, d, generator=g, dtype=torch.float64)
    leaves = [x, router, wg, wu, wd]
    first = torch.autograd.grad(got, leaves, dy, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=5), i=st.integers(1, 4),
       o=st.integers(1, 4))  # fmt: skip
def test_grouped_matmul_is_each_experts_block_times_its_weight(counts, i, o) -> None:
    x = torch.randn(sum(counts), i, dtype=torch.float64)
    w = torch.randn(len(counts), i, o, dtype=torch.float64)
    got = ops.grouped_matmul(x, w, counts)
    rows = [
        x[r] @ w[e]
        for e, c in enumerate(counts)
        for r in range(sum(counts[:e]), sum(counts[: e + 1]))
    ]
    want = torch.stack(rows) if rows else torch.zeros(0, o, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="must be >= 0 and sum to"):
        ops.grouped_matmul(x, w, [c + 1 for c in counts])


@settings(max_examples=20, deadline=None)
@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    i=st.sampled_from([4, 16]),
    o=st.sampled_from([3, 8]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    wanted=st.sampled_from(["x", "w", "both"]),
)
def test_grouped_matmul_gradients_are_autograds_through_the_loop(counts, i, o, dtype, wanted):
    """The differentiated op on the CPU (its backward written out: a grouped product with each
    ``w[e].T`` and each block's ``x_e.T @ dy_e``) against autograd through one matmul per
    expert's block: equal in fp64, to fp32's rounding in fp32; experts with no rows get zero."""
    g = torch.Generator().manual_seed(sum(counts) * 7 + i + o)
    x = torch.randn(sum(counts), i, generator=g, dtype=dtype)
    w = torch.randn(len(counts), i, o, generator=g, dtype=dtype)
    dy = torch.randn(sum(counts), o, generator=g, dtype=dtype)

    def grads(fn):  # type: ignore[no-untyped-def]
        xx = x.clone().requires_grad_(wanted in ("x", "both"))
        ww = w.clone().requires_grad_(wanted in ("w", "both"))
        leaves = [t for t in (xx, ww) if t.requires_grad]
        return torch.autograd.grad(fn(xx, ww), leaves, dy, allow_unused=True)

    def loop(a, b):  # type: ignore[no-untyped-def]
        out = [p @ b[e] for e, p in enumerate(a.split(counts)) if counts[e]]
        return torch.cat(out) if out else a @ b[0]

    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for got, want in zip(grads(lambda a, b: ops.grouped_matmul(a, b, counts)), grads(loop)):
        want = torch.zeros_like(got) if want is None else want
        if dtype == torch.float64:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **tol)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 40), e=st.integers(1, 6), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fp32_experts_by_pytorchs_grouped_matmul_equal_the_fp64_loop(n, e, k, seed) -> None:
    """fp32 with widths in multiples of 16 bytes: the CPU path takes PyTorch's grouped matmul
    (forward, and the backward's products and weight gradients); the result and every gradient
    equal the fp64 loop's to fp32 precision."""
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    d, f = 8, 12
    x, router = torch.randn(n, d, generator=g), torch.randn(d, e, generator=g)
    ws = [torch.randn(e, d, f, generator=g), torch.randn(e, d, f, generator=g)]
    ws.append(torch.randn(e, f, d, generator=g))
    leaves32 = [t.clone().requires_grad_() for t in (x, router, *ws)]
    leaves64 = [t.double().requires_grad_() for t in (x, router, *ws)]
    r32 = nn.route(leaves32[0], leaves32[1], k, True)
    got, _ = ops.moe_ffn(leaves32[0], r32.topi, r32.topw, *leaves32[2:])
    r64 = nn.route(leaves64[0], leaves64[1], k, True)
    assert torch.equal(r32.topi, r64.topi) or pytest.skip("a near tie routed differently")
    want = _loop(leaves64[0], r64.topi, r64.topw, *leaves64[2:])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    dy = torch.randn(n, d, generator=g)
    for a, b in zip(
        torch.autograd.grad(got, leaves32, dy), torch.autograd.grad(want, leaves64, dy.double())
    ):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-3)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 16), e=st.integers(1, 5), k=st.integers(1, 3),
    capacity=st.sampled_from([0.25, 0.5, 1.0, 1.5]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_capacity_drops_exactly_the_choices_over_it(n, e, k, capacity, seed) -> None:
    """Each expert runs at most ceil(capacity * N * k / E) choices, every first choice before
    any second, then by token: the output is the loop over the kept choices only, the counts
    are the kept ones, and the gradients are the loop's."""
    import math

    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, router = rand(n, d := 4), rand(d, e)
    wg, wu, wd = rand(e, d, 3), rand(e, d, 3), rand(e, 3, d)
    r = nn.route(x, router, k, norm_topk_prob=True)
    got, counts = ops.moe_ffn(x, r.topi, r.topw, wg, wu, wd, capacity)
    cap, used, keep = math.ceil(capacity * n * k / e), [0] * e, torch.zeros(n, k)
    for j in range(k):  # the priority: choice, then token
        for t in range(n):
            ex = int(r.topi[t, j])
            if used[ex] < cap:
                used[ex] += 1
                keep[t, j] = 1
    assert counts.tolist() == used
    want = _loop(x, r.topi, r.topw * keep, wg, wu, wd)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    leaves = [x, router, wg, wu, wd]
    dy = torch.randn(n, d, generator=g, dtype=torch.float64)
    first = torch.autograd.grad(got, leaves, dy, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"capacity must be None .* got 0"):
        ops.moe_ffn(x, r.topi, r.topw, wg, wu, wd, 0)
