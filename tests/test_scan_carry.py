"""Scans over pytree carries and per-layer xs/ys, under every transform.

A conditioned toy model carries ``(h, c)``: each block modulates the hidden state ``h`` by the
per-example vector ``c`` (adaLN style: a shift and a scale computed from ``c``), and updates
``c`` too, so ``c`` gets gradients through every layer and crosses pipeline stages with them.
Every composition drawn equals the single-device step (fp64 Adam 1e-9, fp32 SGD 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import nn, optim, random
from colfunc.core import P

pytestmark = pytest.mark.timeout(300)

# Legend: L layers, B batch, T sequence, D width, V vocabulary, K conditioning classes.
L, D, V, K, T = 4, 16, 32, 5, 8

TOY_PLAN = {
    "blocks.w_in": P(None, None, "tp"),
    "blocks.w_out": P(None, "tp", None),
}


def toy_init(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    shapes = {
        "embed": (V, D),
        "cond": (K, D),
        "blocks.w_mod": (L, D, 2 * D),
        "blocks.w_c": (L, D, D),
        "blocks.w_in": (L, D, 2 * D),
        "blocks.w_out": (L, 2 * D, D),
        "head": (D, V),
    }
    return nn.nest({p: random.normal(seed, p, s, 0.3).to(dtype) for p, s in shapes.items()})


def _pre(params: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    h_BTD = nn.embedding(batch["input_ids"], params["embed"])
    c_BD = nn.embedding(batch["input_ids"][:, 0] % K, params["cond"])
    return h_BTD, c_BD


def _block(layer: Any, carry: tuple[torch.Tensor, torch.Tensor]) -> Any:
    h_BTD, c_BD = carry
    mod_BD2 = c_BD @ layer["w_mod"]
    shift_BD, scale_BD = mod_BD2.chunk(2, dim=-1)
    norm_BTD = h_BTD * torch.rsqrt(h_BTD.square().mean(-1, keepdim=True) + 1e-6)
    x_BTD = norm_BTD * (1 + scale_BD[:, None]) + shift_BD[:, None]
    h_BTD = h_BTD + torch.tanh(x_BTD @ layer["w_in"]) @ layer["w_out"]
    c_BD = c_BD + torch.tanh(c_BD @ layer["w_c"])
    return h_BTD, c_BD


def _post(params: Any, carry: Any, batch: Any) -> torch.Tensor:
    h_BTD, c_BD = carry
    logits_BSV = (h_BTD[:, :-1] + c_BD[:, None]) @ params["head"]
    return nn.next_token_loss(logits_BSV, batch["labels"])


TOY_LOSS = cf.layered(_pre, _block, _post, name="toy", sequence_dims={"0": 1})


def _batches(n: int, rows: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (rows, T), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _loop_loss(params: Any, batch: Any) -> torch.Tensor:
    """The same model as a plain Python loop over the layers: the oracle for the scan."""
    carry = _pre(params, batch)
    for i in range(L):
        carry = _block({k: v[i] for k, v in params["blocks"].items()}, carry)
    return _post(params, carry, batch)


ADAM = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
SGD = optim.sgd(0.1)


def test_the_conditioning_vector_gets_gradients_and_the_scan_is_the_loop() -> None:
    params = toy_init()
    batch = _batches(1)[0]
    leaves = cf.tree.map(lambda x: x.detach().requires_grad_(), params)
    TOY_LOSS(leaves, batch).backward()
    grads_scan = cf.tree.map(lambda x: x.grad, leaves)
    leaves = cf.tree.map(lambda x: x.detach().requires_grad_(), params)
    _loop_loss(leaves, batch).backward()
    grads_loop = cf.tree.map(lambda x: x.grad, leaves)
    cf.testing.assert_trees_close(grads_scan, grads_loop, what="grads")
    assert grads_scan["cond"].abs().sum() > 0  # c carries gradients back through every layer
    assert grads_scan["blocks"]["w_c"].abs().amin(dim=(1, 2)).min() > 0


@settings(max_examples=8)
@given(composition=cf.testing.compositions())
def test_toy_compositions_equal_single_device_fp64(composition) -> None:
    params, batches = toy_init(), _batches(2)
    ref = cf.train_step(TOY_LOSS, ADAM)

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=TOY_PLAN)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh=composition["mesh"], timeout=120)


@settings(max_examples=4)
@given(
    composition=cf.testing.compositions(
        cf.testing.meshes(sizes=(2,), max_ranks=4), stages=(0, 1, 2, 3), amp_dtypes=("fp32",)
    )
)
def test_toy_compositions_equal_single_device_fp32_sgd(composition) -> None:
    params, batches = toy_init(dtype=torch.float32), _batches(2)
    ref = cf.train_step(TOY_LOSS, SGD)

    def main(mesh):
        step = cf.testing.compose(ref, mesh, composition, plan=TOY_PLAN)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-5, atol=1e-6)

    cf.launch(main, mesh=composition["mesh"], timeout=120)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_toy_under_every_pipeline_schedule(schedule: str) -> None:
    params, batches = toy_init(), _batches(2)
    ref = cf.train_step(TOY_LOSS, ADAM)
    virtual = 2 if schedule == "interleaved" else 1

    def main(mesh):
        step = cf.pipeline(ref, 2, 4, schedule, virtual_stages=virtual)
        step = cf.zero(cf.shard(step, mesh, plan=TOY_PLAN), stage=1)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": 2, "pp": 2, "tp": 2}, timeout=180)


def _toy_on_gloo(mesh):
    params, batches = toy_init(), _batches(2)
    ref = cf.train_step(TOY_LOSS, ADAM)
    piped = cf.remat(cf.pipeline(ref, 2, 4, "1f1b"))
    sharded = cf.zero(cf.shard(ref, mesh, plan=None, batch_axis="pp"), stage=3, axis="pp")
    return [
        cf.testing.assert_equivalent(s, ref, params, batches, rtol=1e-9, atol=1e-12)
        for s in (piped, sharded)
    ]


def test_toy_on_gloo_processes() -> None:
    results = cf.launch(_toy_on_gloo, mesh={"pp": 2}, backend="gloo", timeout=180)
    assert results[0] == results[1]


# --- xs / ys ---------------------------------------------------------------------------------


def _buffer_block(layer: Any, h: torch.Tensor, buf: torch.Tensor) -> Any:
    """Reads this layer's buffer into the hidden state and writes a new one (a KV cache's shape
    of work): ``ys[i]`` depends on the layer, the carry and ``xs[i]``."""
    h = torch.tanh(h @ layer["w"] + buf.mean(0))
    return h, 0.5 * buf + h.sum(0, keepdim=True)


def _xs_loss(scan: bool) -> Any:
    """A loss over ``{"blocks": {"w"}, "h0", "xs"}``: the scan (or the loop) with per-layer
    buffers, reading the final carry and every layer's new buffer, so the parameters' updates
    carry the gradients of the layers, the initial carry and the xs."""

    def loss(params: Any, batch: Any) -> torch.Tensor:
        h, xs = params["h0"] * batch["gain"], params["xs"]
        if scan:
            h, ys = cf.scan_layers(_buffer_block, h, params["blocks"], xs=xs)
        else:
            rows = []
            for i in range(xs.shape[0]):
                h, y = _buffer_block({k: v[i] for k, v in params["blocks"].items()}, h, xs[i])
                rows.append(y)
            ys = torch.stack(rows)
        return h.square().sum() + (ys * ys.cos()).sum()

    return loss


def _xs_problem(layers: int, width: int, rows: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    params = {
        "blocks": {"w": torch.randn(layers, width, width, generator=g, dtype=torch.float64)},
        "h0": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "xs": torch.randn(layers, 2, width, generator=g, dtype=torch.float64),
    }
    gains = [torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)]
    return params, [{"gain": x} for x in gains]


@settings(max_examples=10, deadline=None)
@given(
    layers=st.integers(1, 5),
    width=st.integers(1, 6),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    policy=st.sampled_from(["none", "full", "save_matmuls"]),
)
def test_scan_with_xs_equals_a_python_loop(layers, width, rows, seed, policy) -> None:
    params, batches = _xs_problem(layers, width, rows, seed)
    h, ys = cf.scan_layers(_buffer_block, params["h0"], params["blocks"], xs=params["xs"])
    h_loop, rows_loop = params["h0"], []
    for i in range(layers):
        h_loop, y = _buffer_block({"w": params["blocks"]["w"][i]}, h_loop, params["xs"][i])
        rows_loop.append(y)
    assert torch.equal(h, h_loop) and torch.equal(ys, torch.stack(rows_loop))
    # forward and backward, bitwise: the updates of layers, initial carry and xs all agree
    ref = cf.train_step(_xs_loss(scan=False), SGD)
    step = cf.remat(cf.train_step(_xs_loss(scan=True), SGD), policy)
    cf.testing.assert_equivalent(step, ref, params, batches)


def test_scan_with_xs_under_zero3_equals_the_loop() -> None:
    """ZeRO-3 gathers each layer inside the scan; the ys and every gradient match the loop."""
    params, batches = _xs_problem(3, 4, 2, 0)
    ref = cf.train_step(_xs_loss(scan=False), SGD)

    def main(mesh):
        for prefetch in (0, 1):
            for policy in ("none", "full"):
                step = cf.train_step(_xs_loss(scan=True), SGD)
                step = cf.remat(cf.zero(cf.shard(step, mesh), stage=3, prefetch=prefetch), policy)
                cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-12, atol=1e-12)

    cf.launch(main, mesh={"dp": 2})


def test_scan_xs_errors_name_the_leaf() -> None:
    blocks = {"w": torch.zeros(3, 2, 2)}
    with pytest.raises(ValueError, match=r"xs\.kv must be a tensor stacked on a leading layer"):
        cf.scan_layers(
            lambda lp, h, x: (h, x), torch.zeros(1, 2), blocks, xs={"kv": torch.zeros(2)}
        )
    with pytest.raises(ValueError, match="every layer's y must have one structure"):
        cf.scan_layers(
            lambda lp, h, x: (h, {"a": x} if x.sum() > 0 else {"b": x}),
            torch.zeros(1, 2),
            blocks,
            xs=torch.tensor([[1.0], [-1.0], [1.0]]),
        )


# --- a layered loss with per-layer xs and ys, under pipeline -----------------------------------


def _gated_xs(params: Any, batch: Any) -> Any:
    """Per-layer gates made from a parameter outside the blocks, so the xs carry gradients back
    to it from every stage (the same for every microbatch: a pipeline's loss is the mean of its
    microbatches' losses, which is the batch's loss only for per-example terms)."""
    return {"gate": torch.tanh(params["gates"])}


def _gated_block(layer: Any, carry: Any, x: Any) -> Any:
    h_BTD, c_BD = _block(layer, carry)
    h_BTD = h_BTD * (1 + 0.1 * torch.tanh(x["gate"]))
    return (h_BTD, c_BD), h_BTD.square().mean()  # y: this layer's auxiliary loss


def _gated_post(params: Any, carry: Any, batch: Any, ys: torch.Tensor) -> torch.Tensor:
    return _post(params, carry, batch) + 0.01 * ys.sum()


GATED = cf.layered(
    _pre, _gated_block, _gated_post, name="gated", sequence_dims={"0": 1}, xs=_gated_xs
)


def _gated_params() -> Any:
    g = torch.Generator().manual_seed(5)
    return {**toy_init(), "gates": torch.randn(L, D, generator=g, dtype=torch.float64)}


def test_layered_xs_is_the_loop() -> None:
    params, (batch,) = _gated_params(), _batches(1)
    carry, aux = _pre(params, batch), []
    xs = _gated_xs(params, batch)
    for i in range(L):
        layer = {k: v[i] for k, v in params["blocks"].items()}
        carry, y = _gated_block(layer, carry, {"gate": xs["gate"][i]})
        aux.append(y)
    want = _gated_post(params, carry, batch, torch.stack(aux))
    assert torch.equal(GATED(params, batch), want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_per_layer_xs_and_ys_cross_pipeline_stages(schedule: str) -> None:
    """Each stage takes its layers' rows of xs; the ys so far travel with the carry (and their
    gradients back) to the last stage, whose post reads them all."""
    params, batches = _gated_params(), _batches(2)
    ref = cf.train_step(GATED, ADAM)
    virtual = 2 if schedule == "interleaved" else 1

    def main(mesh):
        step = cf.pipeline(ref, 2, 4, schedule, virtual_stages=virtual)
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"pp": 2}, timeout=180)


def test_per_layer_xs_under_pipeline_with_remat_and_zero() -> None:
    params, batches = _gated_params(), _batches(2)
    ref = cf.train_step(GATED, ADAM)

    def main(mesh):
        step = cf.remat(cf.zero(cf.shard(cf.pipeline(ref, 2, 4, "1f1b"), mesh), stage=3))
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh={"dp": 2, "pp": 2}, timeout=180)
