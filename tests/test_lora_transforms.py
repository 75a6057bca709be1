"""``cf.lora`` under every transform equals the single-device LoRA step.

The single-device LoRA step itself equals peft (tests/test_lora.py); here each composition drawn
(data and tensor parallel, ZeRO 0-3, a pipeline, offload at a device budget of a tenth of the base,
amp and remat; lora applied before or after them) gives the same losses, adapters and optimizer
states (fp64 AdamW, 1e-9), leaves the base bit-identical, and keeps optimizer state for the
adapters only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import adapters, models, optim, tree
from colfunc.sharding.ledger import recording

TARGETS = {
    "attn": ["blocks.attn.w*"],
    "mlp": ["blocks.mlp.w*"],
    "all": ["blocks.attn.w*", "blocks.mlp.w*"],
    "qv+head": ["blocks.attn.wq", "blocks.attn.wv", "head.weight"],
}


def _problem(name: str, d_model: int = 8):
    model = getattr(models, name)
    sizes = dict(vocab_size=32, n_layer=2, n_head=2, d_model=d_model, max_seq_len=8)
    cfg = model.Config(**sizes, n_kv_heads=2) if name == "llama" else model.Config(**sizes)
    params = tree.map(lambda x: x.double(), model.init(cfg, seed=0))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _with_random_b(step: cf.Step, params):
    """The parameters with adapters whose b is not zero (so the base's path through them is
    exercised from the first step)."""
    state = step.init(params)
    g = torch.Generator().manual_seed(3)
    return tree.map_with_path(
        lambda p, x: (
            torch.randn(x.shape, generator=g, dtype=x.dtype) * 0.3
            if adapters.is_adapter(p) and p.endswith(".b")
            else x
        ),
        cf.full_state(state).params,
    )


def _base_bytes(params) -> int:
    return sum(x.numel() * x.element_size() for x in tree.leaves(params))


# (mesh, composition given the step, mesh, plan and the offload budget)
CASES = {
    "dp2xtp2-zero3": (
        {"dp": 2, "tp": 2},
        lambda s, m, plan, budget: cf.zero(cf.shard(s, m, plan=plan), stage=3),
    ),
    "dp2-zero1": ({"dp": 2}, lambda s, m, plan, budget: cf.zero(cf.shard(s, m), stage=1)),
    "dp2-zero2": ({"dp": 2}, lambda s, m, plan, budget: cf.zero(cf.shard(s, m), stage=2)),
    "tp2": ({"tp": 2}, lambda s, m, plan, budget: cf.shard(s, m, plan=plan)),
    "pp2": ({"pp": 2}, lambda s, m, plan, budget: cf.pipeline(s, 2, microbatches=2)),
    "dp2xpp2": ({"dp": 2, "pp": 2}, lambda s, m, plan, budget: cf.shard(cf.pipeline(s, 2, 2), m)),
    "offload-zero3": (
        {"dp": 2},
        lambda s, m, plan, budget: cf.offload(cf.zero(cf.shard(s, m), 3), "host", budget),
    ),
    "offload-tp2": (
        {"tp": 2},
        lambda s, m, plan, budget: cf.offload(cf.shard(s, m, plan), "host", budget),
    ),
    "amp-remat-zero2": (
        {"dp": 2},
        lambda s, m, plan, budget: cf.remat(cf.amp(cf.zero(cf.shard(s, m), 2), "fp64"), "full"),
    ),
}


@settings(max_examples=14, deadline=None)
@given(
    case=st.sampled_from(sorted(CASES)),
    name=st.sampled_from(["gpt", "llama"]),
    targets=st.sampled_from(sorted(TARGETS)),
    first=st.booleans(),
    rslora=st.booleans(),
    dora=st.booleans(),
)
def test_compositions_equal_one_device(case, name, targets, first, rslora, dora) -> None:
    model, cfg, params, batches = _problem(name)
    chosen = TARGETS[targets]
    if name == "gpt" and "head.weight" in chosen:
        chosen = [t for t in chosen if t != "head.weight"]  # (GPT ties its head to the embedding)
    opt = optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    kw = dict(rank=2, alpha=4.0, targets=chosen, rslora=rslora, dora=dora)
    ref = cf.lora(cf.train_step(model.loss(cfg), opt), **kw)
    start = _with_random_b(ref, params)
    mesh_shape, compose = CASES[case]
    budget = "64MiB"  # (no GPU: the CPU stands for the device; "host" puts the base there)

    def main(mesh: cf.Mesh):
        plain = cf.train_step(model.loss(cfg), opt)
        if first:  # lora, then the transforms
            step = compose(cf.lora(plain, **kw), mesh, model.tp_plan, budget)
        else:  # the transforms, then lora
            step = cf.lora(compose(plain, mesh, model.tp_plan, budget), **kw)
        cf.testing.assert_equivalent(step, ref, start, batches, rtol=1e-9, atol=1e-9)
        state = step.init(start)
        for b in batches:
            state, _ = step(state, b)
        return cf.full_state(state)

    flat0 = dict(tree.flatten_with_paths(start)[0])
    for final in cf.launch(main, mesh=mesh_shape):
        for p, x in tree.flatten_with_paths(final.params)[0]:
            if not adapters.is_adapter(p):
                assert torch.equal(x, flat0[p]), p  # the base: bit-identical
        held = set(tree.paths(final.opt_state.exp_avg))
        assert held == {p for p in flat0 if adapters.is_adapter(p)}


@pytest.mark.parametrize("stage", [None, 1, 3])
def test_optimizer_bytes_and_reduction_bytes_are_the_adapters(stage) -> None:
    """dp=2: the memory report's optimizer bytes are the adapters' two moments (halved by ZeRO
    1-3), and the data-parallel reduction moves the adapters' gradients only."""
    model, cfg, params, batches = _problem("llama", d_model=64)
    opt = optim.adamw(1e-2)
    kw = dict(rank=2, alpha=4.0, targets=["blocks.attn.w*", "blocks.mlp.w*"])
    ref = cf.lora(cf.train_step(model.loss(cfg), opt), **kw)
    start = _with_random_b(ref, params)
    flat = dict(tree.flatten_with_paths(start)[0])
    ad_bytes = sum(x.numel() * x.element_size() for p, x in flat.items() if adapters.is_adapter(p))
    assert 10 * ad_bytes < _base_bytes(params)

    def main(mesh: cf.Mesh):
        step = cf.shard(ref, mesh)
        if stage is not None:
            step = cf.zero(step, stage=stage)
        state = step.init(start)
        state, _ = step(state, batches[0])
        mesh.ledger.reset()
        with recording(mesh):
            state, _ = step(state, batches[1])
        reduced = mesh.ledger.bytes("all_reduce", "dp") + mesh.ledger.bytes("reduce_scatter", "dp")
        return reduced, cf.memory.report(state).optimizer

    for reduced, opt_bytes in cf.launch(main, mesh={"dp": 2}):
        assert reduced <= ad_bytes + 64 * len(flat), (reduced, ad_bytes)
        moments = 2 * ad_bytes // (1 if stage is None else 2)
        assert moments <= opt_bytes <= moments + 64 * len(flat), (opt_bytes, moments)


def test_offload_auto_at_a_tenth_of_the_base_streams_it_and_equals_one_device() -> None:
    """A deep model under ``offload("auto")`` with a device budget of a tenth of the base's
    bytes (ZeRO-3 over dp=2 below it, remat above): the frozen base streams from host memory layer by layer,
    the device peak stays inside the budget, and the steps equal the single-device LoRA step."""
    cfg = models.llama.Config(
        vocab_size=32, n_layer=48, n_head=4, n_kv_heads=4, d_model=64, max_seq_len=8
    )
    params = tree.map(lambda x: x.double(), models.llama.init(cfg, seed=0))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    opt = optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    kw = dict(rank=2, alpha=4.0, targets=["blocks.attn.w*", "blocks.mlp.w*"])
    ref = cf.lora(cf.train_step(models.llama.loss(cfg), opt), **kw)
    start = _with_random_b(ref, params)
    budget = _base_bytes(params) // 10

    def main(mesh: cf.Mesh):
        # (remat: a tiny model's activations outweigh its layers' weights)
        step = cf.remat(cf.offload(cf.zero(cf.shard(ref, mesh), 3), "auto", budget), "full")
        cf.testing.assert_equivalent(step, ref, start, batches, rtol=1e-9, atol=1e-9)
        state = step.init(start)
        peaks = []
        for b in batches:
            state, metrics = step(state, b)
            peaks.append(metrics["offload/device_peak_bytes"])
        return peaks, cf.full_state(state)

    flat0 = dict(tree.flatten_with_paths(start)[0])
    for peaks, final in cf.launch(main, mesh={"dp": 2}):
        assert 0 < max(peaks) <= budget, (peaks, budget)
        for p, x in tree.flatten_with_paths(final.params)[0]:
            if not adapters.is_adapter(p):
                assert torch.equal(x, flat0[p]), p


WEIGHTS = ["blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", "blocks.attn.wo"]
WEIGHTS += ["blocks.mlp.w_gate", "blocks.mlp.w_up", "blocks.mlp.w_down"]


def _tp_bytes(cfg, params, batch, make) -> int:
    """The bytes a tp=2 rank sends in one step (the second, after init's)."""

    def main(mesh: cf.Mesh) -> int:
        step = make(mesh)
        state, _ = step(step.init(params), batch)
        mesh.ledger.reset()
        with recording(mesh):
            step(state, batch)
        return mesh.ledger.bytes()

    return max(cf.launch(main, mesh={"tp": 2}))


@settings(max_examples=5, deadline=None)
@given(
    chosen=st.lists(st.sampled_from(WEIGHTS), min_size=1, max_size=7, unique=True),
    rank=st.sampled_from([2, 4, 8]),
)
def test_tensor_parallel_adapters_add_only_their_rank_r_sums(chosen, rank) -> None:
    """tp=2: a LoRA step moves no more than the frozen base's own step (gradients through every
    layer, none for the weights) plus, per adapted weight and layer, one all-reduce of
    ``[tokens, rank]``: the sum over ranks an adapter's replicated factor needs (column-parallel
    W: ``dY b.T`` for a's gradient; row-parallel W: ``x a`` in the forward pass). Nothing of the
    activations' size is reduced again: the input gradients of weights that read the same input
    stay partial until their one reduction, as the base's do."""
    cfg = models.llama.Config(
        vocab_size=32, n_layer=2, n_head=2, n_kv_heads=2, d_model=64, max_seq_len=16
    )
    params = tree.map(lambda x: x.double(), models.llama.init(cfg, seed=0))
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    opt = optim.adamw(1e-2)
    loss, plan = models.llama.loss(cfg), models.llama.tp_plan
    frozen = _tp_bytes(  # (the embedding trains, so every layer's backward pass runs)
        cfg,
        params,
        batch,
        lambda m: cf.shard(cf.train_step(loss, opt, trainable="embed.*"), m, plan),
    )
    kw = dict(rank=rank, alpha=2.0 * rank, targets=chosen)
    lora = _tp_bytes(
        cfg, params, batch, lambda m: cf.lora(cf.shard(cf.train_step(loss, opt), m, plan), **kw)
    )
    tokens = ids.numel()
    sums = len(chosen) * cfg.n_layer * tokens * rank * 8  # all_reduce at n=2: 2 * (1/2) * bytes
    assert lora <= frozen + sums, (lora, frozen, sums)
