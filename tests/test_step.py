"""cf.train_step against a hand-written torch training loop, and its purity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import colfunc as cf
from colfunc import optim, tree

# Legend: B batch, I input width, H hidden width, L layers.


def pre(params, batch):
    return batch["x_BI"] @ params["embed_IH"]


def block(lp, h_BH):
    return torch.tanh(h_BH @ lp["w_HH"] + lp["b_H"])


def post(params, h_BH, batch):
    return ((h_BH @ params["head_H1"] - batch["y_B1"]) ** 2).mean()


LOSS = cf.layered(pre, block, post, name="toy_mlp")


def make(layers: int, width: int, batch: int, seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    params = {
        "embed_IH": torch.randn(3, width, generator=g) / 3**0.5,
        "blocks": {
            "w_HH": torch.randn(layers, width, width, generator=g) / width**0.5,
            "b_H": torch.randn(layers, width, generator=g) * 0.1,
        },
        "head_H1": torch.randn(width, 1, generator=g),
    }
    batches = [
        {"x_BI": torch.randn(batch, 3, generator=g), "y_B1": torch.randn(batch, 1, generator=g)}
        for _ in range(steps)
    ]
    return params, batches


def torch_loop(params, batches, lr, weight_decay, max_norm=None):
    """Plain PyTorch: nn.Parameters, a loop over layers, backward, clip_grad_norm_, AdamW."""
    names = tree.paths(params)
    ps = {n: torch.nn.Parameter(x.clone()) for n, x in tree.select(params, "*").items()}
    opt = torch.optim.AdamW(ps.values(), lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        h = batch["x_BI"] @ ps["embed_IH"]
        for i in range(ps["blocks.w_HH"].shape[0]):
            h = torch.tanh(h @ ps["blocks.w_HH"][i] + ps["blocks.b_H"][i])
        loss = ((h @ ps["head_H1"] - batch["y_B1"]) ** 2).mean()
        loss.backward()
        clip = max_norm if max_norm is not None else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_([ps[n] for n in names], clip))
        losses.append(loss.detach())
        opt.step()
    final = tree.unflatten(tree.structure(params), [ps[n].detach() for n in names])
    return final, losses, norms


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(tree.tensors(a), tree.tensors(b)))


@given(
    layers=st.integers(1, 3),
    width=st.integers(1, 4),
    batch=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    clip=st.booleans(),
)
def test_train_step_equals_torch_loop(layers, width, batch, seed, clip):
    params, batches = make(layers, width, batch, seed, steps=3)
    max_norm = 0.5 if clip else None
    adamw = optim.adamw(1e-2, weight_decay=0.1)
    opt = optim.chain(optim.clip_by_global_norm(max_norm), adamw) if clip else adamw
    step = cf.train_step(LOSS, opt)
    state = step.init(params)
    ref_params, ref_losses, ref_norms = torch_loop(params, batches, 1e-2, 0.1, max_norm)
    for i, b in enumerate(batches):
        state, metrics = step(state, b)
        # The first step sees identical parameters and agrees bit for bit; after it the two
        # trajectories differ by rounding (an ulp or so), which the loss surface may amplify.
        tol = dict(rtol=0.0, atol=0.0) if i == 0 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(metrics["loss"], ref_losses[i], **tol)
        torch.testing.assert_close(metrics["grad_norm"], ref_norms[i], **tol)
        assert metrics["lr"] == 1e-2
    assert state.step == 3
    assert max_diff(state.params, ref_params) <= 1e-6
    assert max_diff(state.params, params) > 1e-4


def test_train_step_reports_the_scheduled_lr():
    params, batches = make(2, 3, 2, seed=0, steps=4)
    sched = optim.warmup_cosine(0.1, warmup_steps=2, total_steps=4)
    step = cf.train_step(LOSS, optim.adamw(sched))
    state = step.init(params)
    lrs = []
    for b in batches:
        state, metrics = step(state, b)
        lrs.append(metrics["lr"])
    assert lrs == [sched(t) for t in range(4)] == pytest.approx([0.0, 0.05, 0.1, 0.05])


def _snapshot(t):
    return [(x, x.clone(), x._version) for x in tree.tensors(t)]


def test_step_never_mutates_its_inputs():
    params, batches = make(2, 3, 2, seed=1, steps=2)
    step = cf.train_step(LOSS, optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)))
    state = step.init(params)
    state, _ = step(state, batches[0])  # a state with non-zero moments
    before_state, before_batch = _snapshot(state), _snapshot(batches[1])
    new_state, _ = step(state, batches[1])
    for x, clone, version in before_state + before_batch:
        assert torch.equal(x, clone) and x._version == version
    assert state.step == 1 and new_state.step == 2
    assert max_diff(new_state.params, state.params) > 0
    # the same state and batch again give the same result: the step has no hidden state
    again, _ = step(state, batches[1])
    assert max_diff(again, new_state) == 0


def test_bad_inputs():
    params, batches = make(1, 2, 1, seed=2, steps=1)
    step = cf.train_step(LOSS, optim.adamw())
    with pytest.raises(TypeError, match="TrainState"):
        step(params, batches[0])
    with pytest.raises(TypeError, match="GradientTransformation"):
        cf.train_step(LOSS, torch.optim.AdamW)
    with pytest.raises(TypeError, match="loss_fn"):
        cf.train_step("loss", optim.adamw())
    per_example = cf.train_step(lambda p, b: (b["x_BI"] @ p["embed_IH"]).sum(1), optim.sgd(0.1))
    with pytest.raises(ValueError, match="scalar"):
        per_example(per_example.init(params), batches[0])
    with pytest.raises(ValueError, match="no tensor leaves"):
        step.init({"blocks": {}})
