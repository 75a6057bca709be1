"""Expert parallelism: the experts split over an ``ep`` axis that also splits the batch.

- ``comm.all_to_all_v`` (rows in sizes of each rank's choosing) against the plain loop over
  ranks, forward and backward, on drawn meshes and sizes, threads and gloo; the ledger counts the
  rows each rank sends to the others, exactly.
- ``ops.moe_ffn`` with its experts split over the axis equals, on every rank, the same op with
  every expert at hand on that rank's tokens (forward, input gradients), and the experts' weight
  gradients equal the sum of every rank's, dropless and with a capacity (the dropped choices and
  the counts are each rank's own, as without the split); the ledger's ``all_to_all_v`` bytes equal
  the closed form from the routed counts.
- Training steps of tiny Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE under ``shard(expert_axis="ep")``
  equal one device (fp64 AdamW, 1e-9) for ep=2, ep=4, dp2 x ep2, ep2 x tp2, ZeRO 0-3, a 2-stage
  pipeline (with dp and ZeRO-0 or ZeRO-1 too), offload (alone, and with ZeRO 1, 2 and 3: the experts
  homed on the host with the rest), with amp and remat, with frozen experts, on threads and gloo;
  every op placed by its rule. The reference takes the load-balancing term per rank's tokens (and
  microbatch), as data parallelism does.
- Bad input names the value: an expert axis that does not divide the experts, that is not a mesh
  axis, that is the batch axis, a model without experts, and compositions not carried out.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_moe import _batch, _fp64, _hf

import colfunc as cf
from colfunc import hf, models, ops, optim, tree
from colfunc.sharding import ShardedTensor, comm, distribute, launch, recording
from colfunc.sharding.dispatch import strict
from colfunc.sharding.placement import Shard

pytestmark = pytest.mark.timeout(600)


def _loc(t: Any) -> Any:
    return t.to_local() if isinstance(t, ShardedTensor) else t


# --- all_to_all_v ---------------------------------------------------------------------------


def _a2av_main(sizes: list[list[int]], width: int, mesh: cf.Mesh) -> tuple[Any, ...]:
    """Each rank's rows (small integers, distinct per rank) sent in its sizes; its output
    seeded with a cotangent of its own."""
    r = mesh.axis_index("ep")
    send = sizes[r]
    x = torch.arange(sum(send) * width, dtype=torch.float32).reshape(-1, width) + 1000 * r
    x.requires_grad_(True)
    with recording(mesh) as led:
        y = comm.all_to_all_v(x, "ep", send)
    seed = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) + 7 * r
    (y * seed).sum().backward()
    return x.detach(), y.detach(), x.grad, seed, led.as_dict()


def _a2av_case(sizes: list[list[int]], width: int) -> Any:
    return functools.partial(_a2av_main, sizes, width)


def _check_a2av(sizes: list[list[int]], out: list[tuple[Any, ...]], width: int) -> None:
    n = len(sizes)
    xs = [o[0] for o in out]
    for j in range(n):  # member j receives, in sender order, each sender's rows for it
        want = torch.cat([xs[s][sum(sizes[s][:j]) : sum(sizes[s][: j + 1])] for s in range(n)])
        assert torch.equal(out[j][1], want)
    for s in range(n):  # each row's gradient is the seed where it landed
        grads = []
        for j in range(n):
            at = sum(sizes[t][j] for t in range(s))
            grads.append(out[j][3][at : at + sizes[s][j]])
        assert torch.equal(out[s][2], torch.cat(grads))
        sent = sum(c for j, c in enumerate(sizes[s]) if j != s) * width * 4
        assert out[s][4][("all_to_all_v", "ep")] == sent
        assert out[s][4][("all_to_all", "ep")] == (n - 1) * 8  # the counts, exchanged first


@settings(max_examples=12, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), width=st.integers(1, 3))
def test_all_to_all_v_equals_the_loop_over_ranks(data: Any, n: int, width: int) -> None:
    sizes = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for _ in range(n)]
    out = launch(_a2av_case(sizes, width), mesh={"ep": n})
    _check_a2av(sizes, out, width)


def test_all_to_all_v_on_gloo_equals_threads() -> None:
    sizes = [[0, 2, 1], [3, 0, 0], [1, 1, 2]]
    for backend in ("threads", "gloo"):
        _check_a2av(sizes, launch(_a2av_case(sizes, 2), mesh={"ep": 3}, backend=backend), 2)


@pytest.mark.parametrize(
    ("send", "recv", "match"),
    [
        ([1], None, r"send_sizes must hold 2 counts >= 0 .*got \[1\]"),
        ([3, -1], None, r"send_sizes must hold 2 counts >= 0 .*got \[3, -1\]"),
        ([1, 1], None, r"send_sizes \[1, 1\] add up to 2 rows, but x has 3"),
        ([2, 1], [1, 2, 3], r"recv_sizes must hold 2 counts"),
        ("ab", None, r"send_sizes must be a sequence of 2 row counts"),
    ],
)
def test_all_to_all_v_bad_sizes_name_the_value(send: Any, recv: Any, match: str) -> None:
    def main(mesh: cf.Mesh) -> None:
        with pytest.raises((ValueError, TypeError), match=match):
            comm.all_to_all_v(torch.zeros(3, 2), "ep", send, recv)

    launch(main, mesh={"ep": 2})


# --- the experts' op, split over the axis ---------------------------------------------------


def _op_case(n: int, E: int, K: int, N: int, capacity: float | None, seed: int):
    D, Fw = 4, 3
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(E, D, Fw, generator=g, dtype=torch.float64),
         torch.randn(E, D, Fw, generator=g, dtype=torch.float64),
         torch.randn(E, Fw, D, generator=g, dtype=torch.float64)]  # fmt: skip

    def data(r: int) -> tuple[torch.Tensor, ...]:
        gr = torch.Generator().manual_seed(seed * 31 + r)
        x = torch.randn(N, D, generator=gr, dtype=torch.float64)
        # routing skewed towards the first experts, so that the ranks' shares differ
        logits = torch.randn(N, E, generator=gr, dtype=torch.float64) - torch.arange(E) * 0.7
        topi = torch.topk(logits, K, dim=-1).indices
        return x, topi, torch.rand(N, K, generator=gr, dtype=torch.float64)

    def main(mesh: cf.Mesh) -> tuple[Any, ...]:
        x, topi, topw = data(mesh.axis_index("ep"))
        x.requires_grad_(True)
        topw.requires_grad_(True)
        ws = [distribute(w.clone(), mesh, (Shard(0),)).requires_grad_(True) for w in W]
        with recording(mesh) as led:
            y, counts = ops.moe_ffn(x, topi, topw, *ws, capacity)
            dy = torch.randn(
                N, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
            )
            (_loc(y) * dy).sum().backward()
        return (_loc(y).detach(), _loc(counts), _loc(x.grad), _loc(topw.grad),
                [_loc(w.grad) for w in ws], led.as_dict())  # fmt: skip

    return W, data, main


@settings(max_examples=10, deadline=None)
@given(
    n=st.sampled_from([1, 2, 4]), per=st.integers(1, 2), k=st.integers(1, 3),
    tokens=st.integers(1, 9), capacity=st.sampled_from([None, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_split_experts_equal_every_expert_at_hand(n, per, k, tokens, capacity, seed) -> None:
    E = n * per
    K = min(k, E)
    W, data, main = _op_case(n, E, K, tokens, capacity, seed)
    out = launch(main, mesh={"ep": n})
    wgrads = [torch.zeros_like(w) for w in W]
    dy = torch.randn(tokens, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    routed = []
    for r, (y, counts, gx, gtw, _, _) in enumerate(out):
        x, topi, topw = data(r)
        x.requires_grad_(True)
        topw.requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in W]
        want, want_counts = ops.moe_ffn(x, topi, topw, *ws, capacity)
        (want * dy).sum().backward()
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(counts, want_counts)  # each rank's own kept choices
        torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gtw, topw.grad, rtol=1e-12, atol=1e-12)
        for acc, w in zip(wgrads, ws):
            acc += w.grad
        routed.append(want_counts)
    for k_, acc in enumerate(wgrads):  # each rank holds its experts' gradients: all ranks' tokens
        torch.testing.assert_close(torch.cat([o[4][k_] for o in out]), acc, rtol=1e-12, atol=1e-12)
    # the ledger: forward rows out (s) and outputs back (r), backward input and output
    # gradients out (2 s) and input gradients back (r), D = 4 fp64 values a row
    L = E // n
    for me, o in enumerate(out):
        s = sum(int(routed[me][e]) for e in range(E) if e // L != me)
        r = sum(
            int(routed[src][e])
            for src in range(n)
            if src != me
            for e in range(me * L, (me + 1) * L)
        )
        led = o[5]
        assert led.get(("all_to_all_v", "ep"), 0) == (s + r + 2 * s + r) * 4 * 8
        assert led.get(("all_to_all", "ep"), 0) == 2 * (n - 1) * L * 8  # counts, each pass


def test_split_experts_need_an_axis_that_divides_them() -> None:
    W = [torch.zeros(3, 4, 2), torch.zeros(3, 4, 2), torch.zeros(3, 2, 4)]

    def main(mesh: cf.Mesh) -> None:
        ws = [distribute(w, mesh, (Shard(0),)) for w in W]
        with pytest.raises(ValueError, match=r"the 3 experts do not split evenly over \('ep',\)"):
            ops.moe_ffn(
                torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), *ws
            )

    launch(main, mesh={"ep": 2})


# --- training steps ---------------------------------------------------------------------------


def _per_part(loss: Any, parts: int) -> Any:
    """The loss as the mean of the batch's ``parts`` row blocks' (each rank's tokens, with its
    own load-balancing term), as data and expert parallelism over that many ranks compute it."""

    def mean(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        m = batch["input_ids"].shape[0] // parts
        blocks = [{k: v[a * m : (a + 1) * m] for k, v in batch.items()} for a in range(parts)]
        return sum(loss(params, b) for b in blocks) / parts

    return mean


CASES = {  # name -> (family, mesh, how, backend)
    "ep2": ("olmoe", {"ep": 2}, "plain", "threads"),
    "ep4": ("mixtral", {"ep": 4}, "plain", "threads"),
    "dp2_ep2": ("qwen2_moe", {"dp": 2, "ep": 2}, "plain", "threads"),
    "ep2_tp2": ("qwen3_moe", {"ep": 2, "tp": 2}, "plain", "threads"),
    "ep2_amp_remat": ("mixtral", {"ep": 2}, "amp_remat", "threads"),
    "ep2_frozen_experts": ("qwen2_moe", {"ep": 2}, "frozen", "threads"),
    "dp2_ep2_gloo": ("qwen3_moe", {"dp": 2, "ep": 2}, "plain", "gloo"),
    "dp2_ep2_zero0": ("olmoe", {"dp": 2, "ep": 2}, "zero0", "threads"),
    "dp2_ep2_zero1": ("mixtral", {"dp": 2, "ep": 2}, "zero1", "threads"),
    "dp2_ep2_tp2_zero2": ("qwen3_moe", {"dp": 2, "ep": 2, "tp": 2}, "zero2", "threads"),
    "dp2_ep2_zero3": ("qwen2_moe", {"dp": 2, "ep": 2}, "zero3", "threads"),
    "ep2_pp2": ("mixtral", {"pp": 2, "ep": 2}, "pp", "threads"),
    "dp2_ep2_pp2_zero1": ("olmoe", {"dp": 2, "pp": 2, "ep": 2}, "pp_zero1", "threads"),
    "dp2_ep2_pp2_zero0": ("mixtral", {"dp": 2, "pp": 2, "ep": 2}, "pp_zero0", "threads"),
    "ep2_offload": ("mixtral", {"ep": 2}, "offload", "threads"),
    "dp2_ep2_zero1_offload": ("olmoe", {"dp": 2, "ep": 2}, "zero1_offload", "threads"),
    "dp2_ep2_zero2_offload": ("mixtral", {"dp": 2, "ep": 2}, "zero2_offload", "threads"),
    "dp2_ep2_zero3_offload": ("qwen3_moe", {"dp": 2, "ep": 2}, "zero3_offload", "threads"),
    "dp2_ep2_zero3_offload_auto": ("qwen2_moe", {"dp": 2, "ep": 2}, "zero3_auto", "threads"),
}


def _step_main(case: str, cfg: Any, params: Any, mesh: cf.Mesh) -> list[tuple[float, float]]:
    _, mesh_shape, how, _ = CASES[case]
    module = models.of_config(cfg).module
    micro = 2 if how.startswith("pp") else 1  # (each microbatch its own load-balancing term)
    parts = mesh_shape.get("dp", 1) * mesh_shape["ep"] * micro
    batches = [_batch(10 + k, rows=2 * parts, length=8) for k in range(2)]
    opt = optim.adamw(1e-2, weight_decay=0.1)
    trainable = (lambda p: "experts" not in p) if how == "frozen" else None
    ref = cf.train_step(module.loss(cfg), opt, trainable=trainable)
    want = cf.train_step(_per_part(module.loss(cfg), parts), opt, trainable=trainable)
    plan = module.tp_plan if "tp" in mesh_shape else None
    inner = cf.pipeline(ref, 2, microbatches=2) if micro > 1 else ref
    step = cf.shard(inner, mesh, plan=plan, expert_axis="ep")
    if how.startswith("zero") and "_" in how:  # experts homed on the host, fetched per layer
        policy = "host" if how.endswith("offload") else "auto"
        step = cf.offload(cf.zero(step, int(how[4])), policy, "2MiB")
    elif "zero" in how:
        step = cf.zero(step, stage=int(how[-1]))
    if how == "offload":
        step = cf.offload(step, "host", "2MiB")
    if how == "amp_remat":
        step = cf.remat(cf.amp(step, "fp64"), "full")
    with strict():  # (every op placed by its rule: none gathered whole for want of one)
        return cf.testing.assert_equivalent(step, want, params, batches, rtol=1e-9, atol=1e-9)


# (run by default: a case of each mesh, ZeRO stage and offload policy; these repeat one)
SLOW_CASES = {"dp2_ep2_pp2_zero0", "dp2_ep2_zero2_offload"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in sorted(CASES)],
)
def test_expert_parallel_steps_equal_one_device(case: str) -> None:
    name, mesh_shape, _, backend = CASES[case]
    cfg, params, _ = _fp64(name)  # (made once: the rank threads share torch's generator)
    main = functools.partial(_step_main, case, cfg, params)
    for losses in launch(main, mesh=mesh_shape, backend=backend):
        assert len(losses) == 2


def test_lora_adapters_train_under_expert_parallelism() -> None:
    """LoRA adapters on the attention and the shared expert, the experts frozen in their split:
    dp2 x ep2 x tp2 equals one device (no load-balancing term, so the mean over the ranks is the
    whole batch's loss)."""
    cfg, params = hf.from_hf(_hf("qwen2_moe", seed=3))
    assert cfg.router_aux_loss_coef == 0
    params = tree.map(lambda x: x.double(), params)
    module = models.of_config(cfg).module
    batches = [_batch(10 + k, rows=8, length=8) for k in range(2)]
    base = cf.train_step(module.loss(cfg), optim.adamw(1e-2, weight_decay=0.1))
    ref = cf.lora(base, rank=4, targets=("blocks.attn.w*", "blocks.mlp.shared.w*"))

    def main(mesh: cf.Mesh) -> list[tuple[float, float]]:
        step = cf.shard(ref, mesh, plan=module.tp_plan, expert_axis="ep")
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-9)

    for losses in launch(main, mesh={"dp": 2, "ep": 2, "tp": 2}):
        assert len(losses) == 2


def _counts_main(cfg: Any, params: Any, batch: Any, how: str, mesh: cf.Mesh) -> torch.Tensor:
    module = models.of_config(cfg).module
    step = cf.train_step(module.loss(cfg), optim.sgd(0.1))
    if "pp" in mesh.axis_names:  # microbatches, stages on ranks (or interleaved)
        v = {"virtual_stages": 2, "schedule": "interleaved"} if how == "interleaved" else {}
        step = cf.pipeline(step, 2, microbatches=2, **v)
    step = cf.shard(step, mesh, expert_axis="ep" if "ep" in mesh.axis_names else None)
    step = cf.remat(step, "full")  # (a recomputed layer reports nothing twice)
    return step(step.init(params), batch)[1]["expert_counts"]


COUNTS = {  # how -> (family, layers, mesh, backend, dense layers)
    "dp2_ep2": ("qwen3_moe", 2, {"dp": 2, "ep": 2}, "threads", None),
    "pp2": ("mixtral", 4, {"pp": 2}, "threads", None),
    "interleaved": ("olmoe", 4, {"pp": 2}, "threads", None),
    "dense_stage": ("qwen2_moe", 4, {"pp": 2, "ep": 2}, "threads", [0, 1]),
    "dp2_pp2_gloo": ("qwen3_moe", 2, {"dp": 2, "pp": 2}, "gloo", None),
}


@pytest.mark.parametrize(
    "how",
    [pytest.param(h, marks=pytest.mark.slow) if h == "interleaved" else h for h in sorted(COUNTS)],
)
def test_the_steps_metrics_count_each_experts_tokens_per_layer(how: str) -> None:
    """``metrics["expert_counts"]`` ``[sparse layers, experts]``: every rank's tokens' choices
    summed over the data-parallel and expert ranks, and under a pipeline over the microbatches,
    every stage's on every rank (a stage may have no sparse layer): the one-device step's
    counts, exactly."""
    name, layers, mesh, backend, dense = COUNTS[how]
    extra = {"mlp_only_layers": dense} if dense else {}
    cfg, params, module = _fp64(name, num_hidden_layers=layers, **extra)
    batch = _batch(5, rows=8, length=6)
    step = cf.train_step(module.loss(cfg), optim.sgd(0.1))
    want = step(step.init(params), batch)[1]["expert_counts"]
    sparse = layers - len(dense or [])
    assert want.shape == (sparse, cfg.n_experts)
    assert want.sum(1).tolist() == [8 * 6 * cfg.n_experts_per_tok] * sparse
    main = functools.partial(_counts_main, cfg, params, batch, how)
    for got in launch(main, mesh=mesh, backend=backend):
        assert torch.equal(got, want)


def test_microbatches_alone_count_as_one_device() -> None:
    cfg, params, module = _fp64("mixtral")
    batch = _batch(6, rows=4, length=5)
    step = cf.train_step(module.loss(cfg), optim.sgd(0.1))
    want = step(step.init(params), batch)[1]["expert_counts"]
    micro = cf.pipeline(step, 1, microbatches=4)  # (one stage, no mesh)
    assert torch.equal(micro(micro.init(params), batch)[1]["expert_counts"], want)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_expert_axes_are_refused_by_name() -> None:
    cfg, params, module = _fp64("mixtral")  # 4 experts
    step = cf.train_step(module.loss(cfg), optim.sgd(0.1))
    small = models.llama.Config(vocab_size=32, n_layer=1, n_head=2, n_kv_heads=2, d_model=48)
    dense = cf.train_step(models.llama.loss(small), optim.sgd(0.1))

    def main(mesh: cf.Mesh) -> None:
        with pytest.raises(ValueError, match=r"the 4 experts of blocks\.mlp\.experts\.w_gate do not split evenly over expert_axis 'ep' of size 3"):  # fmt: skip
            cf.shard(step, mesh, expert_axis="ep").init(params)
        with pytest.raises(ValueError, match=r"expert_axis 'ex' is not a mesh axis"):
            cf.shard(step, mesh, expert_axis="ex")
        with pytest.raises(ValueError, match=r"expert_axis 'ep' is also the batch axis"):
            cf.shard(step, mesh, batch_axis="ep", expert_axis="ep")
        with pytest.raises(ValueError, match=r"has no experts .*drop expert_axis"):
            cf.shard(dense, mesh, expert_axis="ep")
        with pytest.raises(ValueError, match=r"zero: axis 'ep' is the expert axis"):
            cf.zero(cf.shard(step, mesh, expert_axis="ep"), stage=1, axis="ep")

    launch(main, mesh={"ep": 3})


# --- the config file's parallel section --------------------------------------------------------

CONFIG = """
from colfunc import models
from colfunc.config import DataConfig, OptimConfig, TrainConfig

model = models.mixtral.Config(vocab_size=256, n_layer=2, n_head=4, n_kv_heads=2, d_model=32,
    max_seq_len=32, n_experts=4, n_experts_per_tok=2, d_expert=16, router_aux_loss_coef=0.02)
optim = OptimConfig(lr=1e-2, warmup_steps=2)
data = DataConfig(corpus={corpus!r}, batch_size=8, seq_len=32)
train = TrainConfig(steps=4, log_every=2, eval_every=2, eval_batches=1, sample_tokens=5, out_dir={out!r})
parallel = {parallel}
"""


def test_colfunc_train_with_expert_ranks_reproduces_the_data_parallel_run(tmp_path) -> None:
    """``parallel = dict(expert=2)`` splits the batch as ``data=2`` does (each rank's tokens its
    own load-balancing term), so the two runs' losses agree (fp32, in another order), and
    ``data=2, expert=2, tensor=2`` agrees with ``data=4``; the run's checkpoint, its experts
    saved from two ranks, generates."""
    import json

    from colfunc.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"m{i}.py").write_text(f"def f{i}(a, b):\n    return a * b - {i}\n" * 8)
    losses = {}
    sections = {
        "dp": {"data": 2},
        "ep": {"expert": 2},
        "dp4": {"data": 4},
        "dp_ep_tp": {"data": 2, "expert": 2, "tensor": 2},
    }
    for name, section in sections.items():
        path = tmp_path / f"{name}.py"
        path.write_text(
            CONFIG.format(corpus=str(corpus), out=str(tmp_path / "runs"), parallel=section)
        )
        assert main(["train", str(path), "--name", name, "--no-progress", "--threads", "1"]) == 0
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)]
    assert len(losses["dp"]) >= 2
    assert losses["ep"] == pytest.approx(losses["dp"], rel=1e-4)
    assert losses["dp_ep_tp"] == pytest.approx(losses["dp4"], rel=1e-4)
    # each logged step's expert counts: every rank's tokens' two choices, per layer
    lines = (tmp_path / "runs" / "ep" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(x) for x in lines if "loss" in json.loads(x)]
    assert all([sum(layer) for layer in r["expert_counts"]] == [8 * 32 * 2] * 2 for r in logged)
    assert all(r["expert_imbalance"] >= 1.0 for r in logged)
    run = str(tmp_path / "runs" / "ep")
    assert main(["generate", "--run", run, "--max-new-tokens", "4"]) == 0


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"expert": 0}, r"expert must be an int >= 1, got 0"),
        ({"expert": 2, "sequence": {"mode": "ring", "size": 2}}, r"not with sequence"),
    ],
)  # fmt: skip
def test_bad_expert_sections_are_named(section: dict[str, Any], match: str) -> None:
    from colfunc import parallel

    with pytest.raises(ValueError, match=match):
        parallel.parse(section)
