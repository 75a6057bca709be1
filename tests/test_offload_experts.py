"""Offload's experts homed in host memory and fetched when routed to
(:mod:`colfunc.transforms.offload.experts`).

- ``ops.moe.compact``: the mixture of only the routed experts' weights (capacity included)
  equals the mixture of all of them, output and counts, on drawn routings.
- Offloaded training of tiny mixtures (drawn family, experts per token, tokens, policy): each
  step fetches exactly the experts its tokens are routed to (the chunks fetched, against the
  one-device step's ``expert_counts``), and the steps equal one device (fp64 AdamW, 1e-9); with
  data parallelism and ZeRO-1, amp and remat, frozen experts, a capacity factor, and experts'
  chunks homed on the device ("static", "auto" with a margin).
- Under expert parallelism (ep2, ep4, ep2 on gloo, dp2 x ep2 with ZeRO-1, ep2 with amp and
  remat, ep2 with experts' chunks homed on the device) each rank fetches
  exactly its experts that rows arrive for (over the ranks: the one-device step's routed
  experts), and the steps equal one device.
- Where a rank does not hold whole expert weights (tensor parallelism, ZeRO-3), a layer's
  experts come with it (the other tests' offload cases check those compositions equal one
  device); LoRA adapters on the attention leave the experts routed, and equal one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_moe import _batch, _fp64

import colfunc as cf
from colfunc import models, ops, optim
from colfunc.memory.pool import DevicePool
from colfunc.ops import moe
from colfunc.sharding import launch

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 12), e=st.integers(2, 9), k=st.integers(1, 3), seed=st.integers(0, 99),
    capacity=st.sampled_from([None, 0.3, 1.0, 1.7]),
)  # fmt: skip
def test_the_routed_experts_alone_compute_the_mixture(n, e, k, seed, capacity) -> None:
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    topi = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    topw = torch.rand(n, k, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(e, 6, 5, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(e, 5, 6, generator=g, dtype=torch.float64)
    want, counts = ops.moe_ffn(x, topi, topw, wg, wu, wd, capacity)
    used, topi_c, cap = moe.compact(topi, e, float(capacity or 0.0))
    assert used.tolist() == sorted(set(topi.reshape(-1).tolist()))
    got, counts_c = ops.moe_ffn(x, topi_c, topw, wg[used], wu[used], wd[used], cap or None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert counts_c.tolist() == counts[used].tolist() and counts.sum() == counts_c.sum()


def test_routed_stand_ins_come_as_the_three_of_one_layer() -> None:
    x, topi, topw = torch.randn(2, 4), torch.tensor([[0], [1]]), torch.ones(2, 1)
    w = moe.RoutedExperts(object(), 0, (2, 4, 3), torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"come as the three of one layer, got \['RoutedExperts', 'Tensor', 'Tensor'\]"):  # fmt: skip
        ops.moe_ffn(x, topi, topw, w, torch.randn(2, 4, 3), torch.randn(2, 3, 4))


def _fetched_experts(step: cf.Step, params: Any, batch: Any) -> list[set[int]]:
    """The experts of each layer whose chunks one step of ``step`` fetched."""
    state = step.init(params)
    pool: DevicePool = state.extra["offload"].pool
    seen: list[set[int]] = [set() for _ in range(pool.layout.num_layers)]
    fetch = pool._fetch

    def recording(c: int) -> None:  # (this pool's: rank threads have their own)
        chunk = pool.layout.chunks[c]
        if chunk.expert is not None:
            seen[chunk.group - 1].add(chunk.expert)
        fetch(c)

    pool._fetch = recording  # type: ignore[method-assign]
    step(state, batch)
    return seen


FAMILIES = {  # name -> (experts, a config with more of them than tokens choose)
    "mixtral": {"num_local_experts": 8},
    "qwen3_moe": {"num_experts": 8},
    "olmoe": {"num_experts": 8},
}


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(sorted(FAMILIES)), k=st.integers(1, 2), length=st.integers(2, 4),
    policy=st.sampled_from(["host", "auto"]), seed=st.integers(0, 20),
)  # fmt: skip
def test_offload_fetches_the_routed_experts_and_equals_one_device(name, k, length, policy, seed):
    cfg, params, module = _fp64(name, seed, num_experts_per_tok=k, **FAMILIES[name])
    batches = [_batch(seed + j, rows=1, length=length) for j in range(2)]
    ref = cf.train_step(module.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))
    step = cf.offload(ref, policy, "2MiB")
    _, metrics = ref(ref.init(params), batches[0])
    routed = [set(torch.nonzero(c).reshape(-1).tolist()) for c in metrics["expert_counts"]]
    assert _fetched_experts(step, params, batches[0]) == routed
    assert any(len(r) < cfg.n_experts for r in routed)  # (some expert is left on the host)
    cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)


def _steps(how: str, ref: cf.Step, mesh: cf.Mesh | None) -> cf.Step:
    if how == "dp2_zero1":
        assert mesh is not None
        return cf.offload(cf.zero(cf.shard(ref, mesh), 1), "host", "2MiB")
    if how == "amp_remat":
        return cf.remat(cf.offload(cf.amp(ref, "fp64"), "host", "2MiB"), "full")
    if how == "static_homed":  # (some expert chunks homed on the device: their mirrors serve)
        return cf.offload(ref, "static", "2MiB", offload_params=0.3, offload_optim=0.5)
    if how == "auto_margin":
        return cf.offload(ref, "auto", "2MiB", margin=0.6)
    return cf.offload(ref, "host", "2MiB")


CASES = {  # how -> (family, mesh, what else)
    "dp2_zero1": ("qwen2_moe", {"dp": 2}, {}),
    "amp_remat": ("mixtral", None, {}),
    "frozen_experts": ("olmoe", None, {"trainable": lambda p: "experts" not in p}),
    "frozen_rest": ("qwen3_moe", None, {"trainable": lambda p: "experts" in p}),
    "capacity": ("qwen3_moe", None, {"capacity_factor": 0.6}),
    "static_homed": ("mixtral", None, {}),
    "auto_margin": ("olmoe", None, {}),
}


@pytest.mark.parametrize("how", sorted(CASES))
def test_routed_offload_composes_and_equals_one_device(how: str) -> None:
    name, mesh_shape, other = CASES[how]
    extra = {"num_local_experts" if name == "mixtral" else "num_experts": 8}
    cfg, params, module = _fp64(name, 5, **extra)
    if "capacity_factor" in other:
        cfg = dataclasses.replace(cfg, capacity_factor=other["capacity_factor"])
    opt = optim.adamw(1e-2, weight_decay=0.1)
    parts = 2 if mesh_shape else 1
    batches = [_batch(30 + j, rows=2 * parts, length=3) for j in range(2)]
    trainable = other.get("trainable")
    ref = cf.train_step(module.loss(cfg), opt, trainable=trainable)
    if parts > 1:
        from test_expert_parallel import _per_part

        want = cf.train_step(_per_part(module.loss(cfg), parts), opt, trainable=trainable)
    else:
        want = ref

    def main(mesh: cf.Mesh | None = None) -> Any:
        step = _steps(how, ref, mesh)
        state = step.init(params)
        assert state.extra["offload"].routed  # (the experts fetched when routed)
        if how in ("static_homed", "auto_margin"):  # some experts' chunks live on the device
            for b in batches:
                state, _ = step(state, b)
            off = state.extra["offload"]
            assert any(off.layout.chunks[c].expert is not None for c in off.pool.mirrors)
        return cf.testing.assert_equivalent(step, want, params, batches, rtol=1e-9, atol=1e-9)

    results = launch(main, mesh=mesh_shape) if mesh_shape else [main()]
    for losses in results:
        assert len(losses) == 2


EP_CASES = {  # how -> (family, mesh, backend)
    "ep2": ("mixtral", {"ep": 2}, "threads"),
    "ep4": ("olmoe", {"ep": 4}, "threads"),
    "dp2_ep2_zero1": ("qwen2_moe", {"dp": 2, "ep": 2}, "threads"),
    "ep2_gloo": ("qwen3_moe", {"ep": 2}, "gloo"),
    "ep2_amp_remat": ("olmoe", {"ep": 2}, "threads"),
    "ep2_static_homed": ("mixtral", {"ep": 2}, "threads"),
}


def _ep_main(how: str, cfg: Any, params: Any, mesh: cf.Mesh) -> Any:
    from test_expert_parallel import _per_part

    mesh_shape = EP_CASES[how][1]
    parts = mesh_shape.get("dp", 1) * mesh_shape["ep"]
    batches = [_batch(60 + j, rows=parts, length=2) for j in range(2)]
    module = models.of_config(cfg).module
    opt = optim.adamw(1e-2, weight_decay=0.1)
    step = cf.train_step(module.loss(cfg), opt)
    step = cf.shard(cf.amp(step, "fp64") if "amp" in how else step, mesh, expert_axis="ep")
    step = cf.zero(step, 1) if "dp" in mesh_shape else step
    if how.endswith("static_homed"):  # (some expert chunks homed on the device: mirrors serve)
        step = cf.offload(step, "static", "2MiB", offload_params=0.3, offload_optim=0.5)
    else:
        step = cf.offload(step, "host", "2MiB")
    step = cf.remat(step, "full") if "remat" in how else step
    state = step.init(params)
    assert state.extra["offload"].routed
    seen = _fetched_experts(step, params, batches[0])
    if how.endswith("static_homed"):
        for b in batches:
            state, _ = step(state, b)
        off = state.extra["offload"]
        assert any(off.layout.chunks[c].expert is not None for c in off.pool.mirrors)
    first = mesh.axis_index("ep") * (cfg.n_experts // mesh.axis_size("ep"))
    want = cf.train_step(_per_part(module.loss(cfg), parts), opt)
    losses = cf.testing.assert_equivalent(step, want, params, batches, rtol=1e-9, atol=1e-9)
    return [{first + e for e in s} for s in seen], losses


EP_SLOW = {"ep4", "ep2_amp_remat", "ep2_static_homed"}  # (pytest -m slow)


@pytest.mark.parametrize(
    "how",
    [pytest.param(h, marks=pytest.mark.slow) if h in EP_SLOW else h for h in sorted(EP_CASES)],
)
def test_under_expert_parallelism_each_rank_fetches_its_routed_experts(how: str) -> None:
    """Each rank fetches exactly those of its experts that some token of its expert group is
    routed to (over the ranks: the experts the one-device step's tokens are routed to), and
    the steps equal one device."""
    name, mesh_shape, backend = EP_CASES[how]
    cfg, params, module = _fp64(name, 7, num_experts_per_tok=1, **FAMILIES.get(name, {"num_experts": 8}))  # fmt: skip
    parts = mesh_shape.get("dp", 1) * mesh_shape["ep"]
    ref = cf.train_step(module.loss(cfg), optim.adamw(1e-2))
    _, metrics = ref(ref.init(params), _batch(60, rows=parts, length=2))  # (as _ep_main's first)
    routed = [set(torch.nonzero(c).reshape(-1).tolist()) for c in metrics["expert_counts"]]
    assert any(len(r) < cfg.n_experts for r in routed)  # (some expert is left on the host)
    main = functools.partial(_ep_main, how, cfg, params)
    results = launch(main, mesh=mesh_shape, backend=backend)
    fetched = [set().union(*(r[0][i] for r in results)) for i in range(len(routed))]
    if how.endswith("static_homed"):  # (the device-homed experts are served, not fetched)
        assert all(f <= r for f, r in zip(fetched, routed)) and fetched != routed
    else:
        assert fetched == routed
    assert all(len(r[1]) == 2 for r in results)


def test_whole_layers_where_a_rank_holds_no_whole_expert() -> None:
    cfg, params, module = _fp64("mixtral", 1)
    ref = cf.train_step(module.loss(cfg), optim.adamw(1e-2))

    def routed(step: cf.Step) -> list[str]:  # the paths of the leaves fetched when routed to
        off = step.init(params).extra["offload"]
        return sorted(off.paths[k] for k in off.routed)

    experts = [f"blocks.mlp.experts.{w}" for w in ("w_down", "w_gate", "w_up")]
    assert routed(cf.offload(ref, "host", "2MiB")) == experts
    assert routed(cf.offload(ref, "host", "2MiB", experts="layer")) == []
    with pytest.raises(
        ValueError, match=r"experts must be one of \('routed', 'layer'\).*got 'all'"
    ):
        cf.offload(ref, "host", "2MiB", experts="all")
    ep = launch(lambda m: routed(cf.offload(cf.shard(ref, m, expert_axis="ep"), "host", "2MiB")), mesh={"ep": 2})  # fmt: skip
    assert ep == [experts] * 2  # (each rank's experts whole: routed)
    plan = models.mixtral.tp_plan
    ep_tp = launch(lambda m: routed(cf.offload(cf.shard(ref, m, plan=plan, expert_axis="ep"), "host", "2MiB")), mesh={"ep": 2, "tp": 2})  # fmt: skip
    zero3 = launch(lambda m: routed(cf.offload(cf.zero(cf.shard(ref, m), 3), "host", "2MiB")), mesh={"dp": 2})  # fmt: skip
    assert ep_tp == [[]] * 4 and zero3 == [[]] * 2
    lora = cf.lora(ref, rank=2, targets=("blocks.attn.w*",))  # (experts take no adapters)
    adapted = cf.offload(lora, "host", "2MiB")
    assert routed(adapted) == experts
    batches = [_batch(40 + j, rows=1, length=3) for j in range(2)]
    cf.testing.assert_equivalent(adapted, lora, params, batches, rtol=1e-9, atol=1e-9)


def _planned_and_run(cfg: Any, policy: str, experts: str) -> tuple[Any, list[dict[str, float]]]:
    from colfunc import memory

    loss = models.qwen3_moe.loss(cfg)
    step = cf.offload(cf.train_step(loss, optim.adamw(1e-3)), policy, "8MB", experts=experts)
    pred = memory.predict(cfg, step, (4, 16))
    state = step.init(models.qwen3_moe.init(cfg))
    g = torch.Generator().manual_seed(0)
    metrics = []
    for rows, length, every in ((4, 16, True), (4, 16, True), (4, 16, True), (1, 2, False)):
        ids = torch.randint(0, 64, (rows, length), generator=g)
        state, m = step(state, {"input_ids": ids, "labels": ids})
        assert bool((m["expert_counts"] > 0).all()) == every
        metrics.append({k.removeprefix("offload/"): float(v) for k, v in m.items() if "/" in k})
    return pred, metrics


@pytest.mark.parametrize("policy", ["host", "auto"])
def test_the_planner_predicts_every_expert_routed_to(policy: str) -> None:
    """``cf.memory.predict`` runs on the meta device, where nothing is routed: it predicts the
    step that routes to every expert, within 5% of what a run that does measures (as
    ``test_offload`` holds the planner to); a step routing to fewer moves less."""
    cfg = models.qwen3_moe.Config(vocab_size=64, n_layer=3, n_head=4, n_kv_heads=2, d_model=64,
                                  head_dim=16, n_experts=8, n_experts_per_tok=2, d_expert=128,
                                  max_seq_len=32)  # fmt: skip
    pred, got = _planned_and_run(cfg, policy, "routed")
    for key in ("device_peak_bytes", "h2d_bytes", "d2h_bytes"):  # (the third step's)
        assert abs(getattr(pred, key) - got[2][key]) <= 0.05 * got[2][key], key
    assert got[3]["h2d_bytes"] < 0.8 * pred.h2d_bytes  # (2 tokens: 2 to 4 experts a layer)
