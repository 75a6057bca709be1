"""colfunc.optim against torch.optim: same parameters after several steps, and pure updates."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import colfunc as cf
from colfunc import optim, tree

STEPS = 5
ATOL = 1e-6

shapes = st.lists(st.lists(st.integers(1, 4), max_size=3), min_size=1, max_size=4)


def make_params(shape_list: list[list[int]], seed: int, scale: float = 0.5) -> dict:
    """A small nested tree: the first leaf at ``a``, the rest in a list under ``blocks.layers``."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) * scale for s in shape_list]
    return {"a": ts[0], "blocks": {"layers": ts[1:]}}


def make_grads(params: dict, steps: int, seed: int, scale: float = 1.0) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 1)
    return [
        tree.map(lambda p: torch.randn(p.shape, generator=g) * scale, params) for _ in range(steps)
    ]


def run_ours(opt: optim.GradientTransformation, params: dict, grads_seq: list[dict]) -> dict:
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_torch(make_opt, params: dict, grads_seq: list[dict], clip: float | None = None) -> dict:
    """``torch.optim`` over the same leaves (in tree order), one ``step()`` per gradient."""
    treedef = tree.structure(params)
    ps = [torch.nn.Parameter(p.clone()) for p in tree.leaves(params)]
    opt = make_opt(ps)
    for grads in grads_seq:
        for p, g in zip(ps, treedef.flatten_up_to(grads)):
            p.grad = g.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
    return tree.unflatten(treedef, [p.detach() for p in ps])


def max_diff(a, b) -> float:
    """The largest elementwise difference of two same-shaped trees (other leaves equal)."""
    assert tree.structure(a) == tree.structure(b)
    others = [
        (x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)) if not isinstance(x, torch.Tensor)
    ]
    assert all(x == y for x, y in others)
    diffs = [(x - y).abs().max().item() for x, y in zip(tree.tensors(a), tree.tensors(b))]
    return max(diffs, default=0.0)


# ---------------------------------------------------------------------------------------------
# equal to torch.optim


@given(
    shape_list=shapes,
    seed=st.integers(0, 2**16),
    lr=st.floats(1e-3, 0.05),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    dampening=st.sampled_from([0.0, 0.3]),
    weight_decay=st.sampled_from([0.0, 0.05]),
    nesterov=st.booleans(),
)
def test_sgd_matches_torch(shape_list, seed, lr, momentum, dampening, weight_decay, nesterov):
    if nesterov and (momentum == 0 or dampening != 0):
        nesterov = False
    kw = dict(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    params = make_params(shape_list, seed)
    grads_seq = make_grads(params, STEPS, seed)
    ours = run_ours(optim.sgd(**kw), params, grads_seq)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, **kw), params, grads_seq)
    assert max_diff(ours, ref) <= ATOL
    assert max_diff(ours, params) > 0  # the reference moved, so agreement means something


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=0.1),
        dict(lr=0.1, momentum=0.9),
        dict(lr=0.1, momentum=0.9, nesterov=True),
        dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1),
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
)
def test_sgd_variants_match_torch(kw):
    params = make_params([[3, 2], [4], []], seed=0)
    grads_seq = make_grads(params, STEPS, seed=0)
    ours = run_ours(optim.sgd(**kw), params, grads_seq)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, **kw), params, grads_seq)
    assert max_diff(ours, ref) <= ATOL


@given(
    shape_list=shapes,
    seed=st.integers(0, 2**16),
    lr=st.floats(1e-4, 0.05),
    beta1=st.sampled_from([0.0, 0.8, 0.9]),
    beta2=st.sampled_from([0.9, 0.99, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
    amsgrad=st.booleans(),
    decoupled=st.booleans(),
)
def test_adam_and_adamw_match_torch(
    shape_list, seed, lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled
):
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    ours_opt, torch_cls = (
        (optim.adamw, torch.optim.AdamW) if decoupled else (optim.adam, torch.optim.Adam)
    )
    params = make_params(shape_list, seed)
    grads_seq = make_grads(params, STEPS, seed)
    ours = run_ours(ours_opt(**kw), params, grads_seq)
    ref = run_torch(lambda ps: torch_cls(ps, foreach=True, **kw), params, grads_seq)
    assert max_diff(ours, ref) <= ATOL
    assert max_diff(ours, params) > 1e-5


def test_adamw_defaults_match_torch():
    params = make_params([[5, 3], [3]], seed=1)
    grads_seq = make_grads(params, STEPS, seed=1)
    ours = run_ours(optim.adamw(), params, grads_seq)
    ref = run_torch(lambda ps: torch.optim.AdamW(ps), params, grads_seq)
    assert max_diff(ours, ref) <= ATOL


def _reference_warmup_cosine(t: int, peak: float, warmup: int, total: int, final: float) -> float:
    # written from the definition (Hugging Face's cosine-with-warmup, plus a floor at `final`)
    if t < warmup:
        return peak * t / max(1, warmup)
    if t >= total:
        return final
    progress = (t - warmup) / max(1, total - warmup)
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_adamw_with_warmup_cosine_matches_torch_lambda_lr():
    peak, warmup, total, final = 1e-2, 2, 5, 1e-3
    sched = optim.warmup_cosine(peak, warmup_steps=warmup, total_steps=total, final_lr=final)
    opt = optim.adamw(sched, weight_decay=0.1)
    params = make_params([[4, 3], [3]], seed=2)
    grads_seq = make_grads(params, total + 2, seed=2)

    treedef = tree.structure(params)
    ps = [torch.nn.Parameter(p.clone()) for p in tree.leaves(params)]
    torch_opt = torch.optim.AdamW(ps, lr=peak, weight_decay=0.1)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(
        torch_opt, lambda t: _reference_warmup_cosine(t, peak, warmup, total, final) / peak
    )
    state = opt.init(params)
    for grads in grads_seq:
        assert opt.lr(state) == pytest.approx(lambda_lr.get_last_lr()[0], rel=1e-12, abs=1e-15)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for p, g in zip(ps, treedef.flatten_up_to(grads)):
            p.grad = g.clone()
        torch_opt.step()
        lambda_lr.step()
        assert max_diff(params, tree.unflatten(treedef, [p.detach() for p in ps])) <= ATOL


@given(
    shape_list=shapes,
    seed=st.integers(0, 2**16),
    max_norm=st.floats(0.01, 5.0),
    grad_scale=st.sampled_from([0.01, 1.0, 10.0]),
)
def test_clip_by_global_norm_matches_torch(shape_list, seed, max_norm, grad_scale):
    params = make_params(shape_list, seed)
    (grads,) = make_grads(params, 1, seed, scale=grad_scale)
    clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, (), params)
    ps = [torch.nn.Parameter(p.clone()) for p in tree.leaves(params)]
    for p, g in zip(ps, tree.leaves(grads)):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    assert torch.equal(optim.global_norm(grads), total)
    for ours, p in zip(tree.leaves(clipped), ps):
        assert torch.equal(ours, p.grad)
    ours_norm = optim.global_norm(clipped).item()
    assert ours_norm <= max_norm * (1 + 1e-5)
    if total.item() <= max_norm:  # below the threshold the gradients pass unchanged
        assert all(torch.equal(a, b) for a, b in zip(tree.leaves(clipped), tree.leaves(grads)))


@given(shape_list=shapes, seed=st.integers(0, 2**16), max_norm=st.floats(0.1, 3.0))
def test_chain_clip_adamw_matches_clip_then_torch_adamw(shape_list, seed, max_norm):
    params = make_params(shape_list, seed)
    grads_seq = make_grads(params, STEPS, seed, scale=2.0)
    opt = optim.chain(optim.clip_by_global_norm(max_norm), optim.adamw(0.01))
    ours = run_ours(opt, params, grads_seq)
    ref = run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.01), params, grads_seq, clip=max_norm)
    assert max_diff(ours, ref) <= ATOL
    assert opt.lr(opt.init(params)) == 0.01


def test_bf16_params_keep_fp32_state_and_update_as_fp32():
    params32 = make_params([[4, 3], [3]], seed=3)
    (grads32,) = make_grads(params32, 1, seed=3)
    params16 = tree.map(lambda x: x.bfloat16(), params32)
    grads16 = tree.map(lambda x: x.bfloat16(), grads32)
    # the same computation on the bf16 values widened to fp32 is the reference
    widened_p = tree.map(lambda x: x.float(), params16)
    widened_g = tree.map(lambda x: x.float(), grads16)
    for opt in (optim.adamw(0.01), optim.sgd(0.1, momentum=0.9), optim.adam(0.01, amsgrad=True)):
        state = opt.init(params16)
        assert {x.dtype for x in tree.tensors(state)} == {torch.float32}
        updates, new_state = opt.update(grads16, state, params16)
        ref_updates, ref_state = opt.update(widened_g, opt.init(widened_p), widened_p)
        assert max_diff(updates, ref_updates) == 0
        assert max_diff(new_state, ref_state) == 0
        new_params = optim.apply_updates(params16, updates)
        assert {x.dtype for x in tree.leaves(new_params)} == {torch.bfloat16}


def test_fp64_params_keep_fp64_state_and_match_torch():
    params = tree.map(lambda x: x.double(), make_params([[4, 3], [3]], seed=6))
    grads_seq = make_grads(params, STEPS, seed=6)
    grads_seq = [tree.map(lambda x: x.double(), g) for g in grads_seq]
    opt = optim.adamw(0.01, amsgrad=True)
    assert {x.dtype for x in tree.tensors(opt.init(params))} == {torch.float64}
    ours = run_ours(opt, params, grads_seq)
    ref = run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True), params, grads_seq)
    assert max_diff(ours, ref) <= 1e-14


def test_integer_leaves_are_left_alone():
    params = {"w": torch.tensor([1.0, -2.0]), "pos": torch.tensor([1000, 2000])}
    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(0.1, weight_decay=0.5))
    step = cf.train_step(lambda p, b: (p["w"] * p["pos"]).sum() / 1000, opt)
    state, metrics = step(step.init(params), None)
    assert state.params["pos"] is params["pos"]
    assert torch.equal(metrics["grad_norm"], torch.tensor([1.0, 2.0]).norm())
    assert not torch.equal(state.params["w"], params["w"])


# ---------------------------------------------------------------------------------------------
# purity: nothing passed in is written, and what comes out shares no memory with it

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_nesterov_wd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9),
    "adamw": lambda: optim.adamw(0.01),
    "adamw_amsgrad": lambda: optim.adamw(optim.warmup_cosine(0.01, 1, 4), amsgrad=True),
    "adam_wd": lambda: optim.adam(0.01, weight_decay=0.1),
    "clip": lambda: optim.clip_by_global_norm(0.1),
    "accumulate": lambda: optim.accumulate(optim.adamw(0.01), 2),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.1, momentum=0.9)),
}


def _snapshot(t):
    return [(x.clone(), x._version) for x in tree.tensors(t)]


def _unchanged(t, snap) -> bool:
    now = tree.tensors(t)
    return len(now) == len(snap) and all(
        torch.equal(x, c) and x._version == v for x, (c, v) in zip(now, snap)
    )


def _storages(t) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in tree.tensors(t)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_is_pure(name):
    opt = OPTIMIZERS[name]()
    params = make_params([[3, 2], [2], []], seed=4)
    grads_seq = make_grads(params, 3, seed=4)
    state = opt.init(params)
    for grads in grads_seq:
        before = [_snapshot(params), _snapshot(grads), _snapshot(state)]
        updates, new_state = opt.update(grads, state, params)
        assert _unchanged(params, before[0])
        assert _unchanged(grads, before[1])
        assert _unchanged(state, before[2])
        # Outputs are new tensors; only a state entry that did not change may be passed through
        # as the very same tensor (accumulate keeps the inner state between real updates).
        inputs = _storages(params) | _storages(grads) | _storages(state)
        passed = {id(x) for x in tree.tensors(state)}
        fresh = [x for x in tree.tensors((updates, new_state)) if id(x) not in passed]
        assert not _storages(fresh) & inputs
        # the same inputs give the same outputs: no hidden state
        again, again_state = opt.update(grads, state, params)
        assert max_diff(updates, again) == 0 and max_diff(new_state, again_state) == 0
        params, state = optim.apply_updates(params, updates), new_state


def test_counters_are_python_ints():
    params = make_params([[2]], seed=5)
    (grads,) = make_grads(params, 1, seed=5)
    for opt in (optim.adamw(), optim.sgd(0.1, momentum=0.5), optim.accumulate(optim.sgd(0.1), 3)):
        _, state = opt.update(grads, opt.init(params), params)
        counters = [x for x in tree.leaves(state) if not isinstance(x, torch.Tensor)]
        assert counters and all(type(c) is int for c in counters)
        assert 1 in counters


# ---------------------------------------------------------------------------------------------
# accumulation


def _linear_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return ((pred - batch["y"]) ** 2).mean()


INNER = {
    "adamw": lambda: optim.adamw(0.02, weight_decay=0.1),
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "adamw_cosine": lambda: optim.adamw(optim.warmup_cosine(0.05, 1, 3)),
}


@given(
    k=st.integers(1, 4),
    micro=st.integers(1, 3),
    dims=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    inner=st.sampled_from(sorted(INNER)),
    seed=st.integers(0, 2**16),
)
def test_accumulate_equals_one_step_on_the_whole_batch(k, micro, dims, inner, seed):
    d_in, d_out = dims
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(d_in, d_out, generator=g), "b": torch.randn(d_out, generator=g)}
    cycles = 2
    batches = [
        {
            "x": torch.randn(k * micro, d_in, generator=g),
            "y": torch.randn(k * micro, d_out, generator=g),
        }
        for _ in range(cycles)
    ]
    plain = cf.train_step(_linear_loss, INNER[inner]())
    accum = cf.train_step(_linear_loss, optim.accumulate(INNER[inner](), k))
    s_plain, s_accum = plain.init(params), accum.init(params)
    for batch in batches:
        s_plain, m_plain = plain(s_plain, batch)
        for i in range(k):
            micro_batch = tree.map(lambda x, i=i: x[i * micro : (i + 1) * micro], batch)
            before = s_accum.params
            assert s_accum.opt_state.micro_step == i
            s_accum, m_accum = accum(s_accum, micro_batch)
            assert m_accum["lr"] == m_plain["lr"]  # the inner lr, which only moves per cycle
            if i < k - 1:  # no update until the k-th micro-batch
                assert max_diff(s_accum.params, before) == 0
        assert max_diff(s_accum.params, s_plain.params) <= ATOL
    assert max_diff(s_accum.params, params) > 0


# ---------------------------------------------------------------------------------------------
# learning rates that change with the update count


@given(
    peak=st.floats(1e-5, 1.0),
    warmup=st.integers(0, 20),
    extra=st.integers(0, 30),
    final_frac=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_warmup_cosine_matches_reference(peak, warmup, extra, final_frac):
    total = max(1, warmup + extra)
    final = peak * final_frac
    sched = optim.warmup_cosine(peak, warmup, total, final_lr=final)
    values = [sched(t) for t in range(total + 5)]
    for t, v in enumerate(values):
        assert v == pytest.approx(
            _reference_warmup_cosine(t, peak, warmup, total, final), rel=1e-12, abs=1e-15
        )
    warming, after = values[:warmup], values[warmup:]
    assert warming == sorted(warming) and warming[:1] in ([], [0.0])  # rising from 0
    if warmup < total:  # then from the peak down to final_lr (no decay phase when equal)
        assert after[0] == peak and after == sorted(after, reverse=True)
    assert values[total:] == [final] * 5


def test_warmup_cosine_decay_matches_torch_cosine_annealing():
    peak, warmup, total, final = 0.1, 3, 23, 0.01
    sched = optim.warmup_cosine(peak, warmup, total, final_lr=final)
    p = torch.nn.Parameter(torch.zeros(1))
    torch_opt = torch.optim.SGD([p], lr=peak)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch_opt, T_max=total - warmup, eta_min=final
    )
    for t in range(warmup, total + 1):
        assert sched(t) == pytest.approx(cosine.get_last_lr()[0], rel=1e-6)
        torch_opt.step()
        cosine.step()


def test_linear_warmup_and_constant():
    sched = optim.linear_warmup(0.2, warmup_steps=4, init_lr=0.1)
    assert [sched(t) for t in range(6)] == pytest.approx([0.1, 0.125, 0.15, 0.175, 0.2, 0.2])
    assert optim.linear_warmup(0.3, 0)(0) == 0.3
    assert [optim.constant(0.5)(t) for t in (0, 7)] == [0.5, 0.5]
    # learning rates are values: equal, printable and picklable (configs and checkpoints keep them)
    cos = optim.warmup_cosine(1e-3, 10, 100)
    assert pickle.loads(pickle.dumps(cos)) == cos == optim.warmup_cosine(1e-3, 10, 100)
    assert "warmup_steps=10" in repr(cos)


def test_learning_rate_drives_sgd_lr():
    sched = optim.linear_warmup(0.4, warmup_steps=2)
    opt = optim.sgd(sched)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    lrs = []
    for _ in range(4):
        lrs.append(opt.lr(state))
        updates, state = opt.update({"w": torch.ones(2)}, state, params)
        assert torch.allclose(updates["w"], torch.full((2,), -lrs[-1]))
    assert lrs == [0.0, 0.2, 0.4, 0.4]


# ---------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize(
    ("make", "error", "names"),
    [
        (lambda: optim.sgd(-0.1), ValueError, ["lr", "-0.1"]),
        (lambda: optim.sgd(float("nan")), ValueError, ["lr"]),
        (lambda: optim.sgd("0.1"), TypeError, ["lr"]),
        (lambda: optim.sgd(0.1, momentum=-1), ValueError, ["momentum"]),
        (lambda: optim.sgd(0.1, weight_decay=-1), ValueError, ["weight_decay"]),
        (lambda: optim.sgd(0.1, nesterov=True), ValueError, ["nesterov", "momentum"]),
        (
            lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            ["dampening"],
        ),
        (lambda: optim.adamw(-1e-3), ValueError, ["lr"]),
        (lambda: optim.adamw(betas=(1.0, 0.999)), ValueError, ["betas[0]", "1.0"]),
        (lambda: optim.adamw(betas=(0.9, -0.1)), ValueError, ["betas[1]"]),
        (lambda: optim.adam(betas=(0.9,)), ValueError, ["betas"]),
        (lambda: optim.adamw(eps=-1e-8), ValueError, ["eps"]),
        (lambda: optim.adam(weight_decay=-0.1), ValueError, ["weight_decay"]),
        (lambda: optim.clip_by_global_norm(-1.0), ValueError, ["max_norm"]),
        (lambda: optim.accumulate(optim.sgd(0.1), 0), ValueError, ["k", "0"]),
        (lambda: optim.accumulate(optim.sgd(0.1), 2.0), TypeError, ["k"]),
        (lambda: optim.accumulate(torch.optim.SGD, 2), TypeError, ["GradientTransformation"]),
        (lambda: optim.chain(optim.sgd(0.1), "adamw"), TypeError, ["argument 1"]),
        (lambda: optim.warmup_cosine(1e-3, 10, 5), ValueError, ["warmup_steps", "total_steps"]),
        (lambda: optim.warmup_cosine(-1e-3, 1, 5), ValueError, ["peak_lr"]),
        (lambda: optim.warmup_cosine(1e-3, 0, 0), ValueError, ["total_steps"]),
        (lambda: optim.warmup_cosine(1e-3, 1.5, 5), TypeError, ["warmup_steps"]),
        (lambda: optim.warmup_cosine(1e-3, 1, 5, final_lr=-1.0), ValueError, ["final_lr"]),
        (lambda: optim.linear_warmup(1e-3, -1), ValueError, ["warmup_steps"]),
        (lambda: optim.constant(-1.0), ValueError, ["value"]),
        (lambda: optim.warmup_cosine(1e-3, 1, 5)(-1), ValueError, ["count"]),
    ],
)
def test_bad_arguments_name_the_argument(make, error, names):
    with pytest.raises(error) as info:
        make()
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_fused_apply_equals_update_then_apply(dtype):
    """The one-pass ``apply`` path gives the two-step path's parameters and states."""
    g = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn(7, 5, generator=g, dtype=dtype),
        "b": torch.randn(3, generator=g, dtype=dtype),
    }
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
    s_fast = s_slow = opt.init(params)
    p_fast = p_slow = params
    before = {k: v.clone() for k, v in params.items()}
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g, dtype=dtype) for k, v in params.items()}
        assert opt.apply is not None
        out = opt.apply(grads, s_fast, p_fast)
        assert out is not None
        p_fast, s_fast = out
        updates, s_slow = opt.update(grads, s_slow, p_slow)
        p_slow = optim.apply_updates(p_slow, updates)
    for k in params:
        torch.testing.assert_close(p_fast[k], p_slow[k], rtol=1e-6, atol=1e-7)
        assert torch.equal(params[k], before[k])  # nothing passed in was modified
    for a, b in zip(cf.tree.tensors(s_fast), cf.tree.tensors(s_slow)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_apply_declines_mixed_dtypes():
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    opt = optim.adamw(1e-2)
    state = opt.init(params)  # fp32 moments for bf16 parameters: not the fused kernel's case
    assert opt.apply is not None
    assert opt.apply({"w": torch.ones(3, dtype=torch.bfloat16)}, state, params) is None


# ---------------------------------------------------------------------------------------------
# gradients that tile a flat buffer (data parallelism's): normed over the buffer's runs


def _flat_grads(n_layers: int, row_shapes: list[list[int]], plain: list[int], seed: int):
    """A buffer laid out as data parallelism lays out its gradients: plain leaves first, then
    each layer's rows of every stacked leaf side by side; the leaves as views into it."""
    rows = [math.prod(s) for s in row_shapes]
    base, row = sum(plain), sum(rows)
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(base + n_layers * row, generator=g)
    leaves, at = {}, 0
    for k, n in enumerate(plain):
        leaves[f"p{k}"] = buffer[at : at + n]
        at += n
    at = base
    for k, shape in enumerate(row_shapes):
        inner = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
        leaves[f"s{k}"] = buffer.as_strided((n_layers, *shape), (row, *inner), at)
        at += rows[k]
    return leaves, buffer


@given(
    n_layers=st.integers(2, 5),
    row_shapes=st.lists(
        st.lists(st.integers(1, 300), min_size=1, max_size=2), min_size=1, max_size=4
    ),
    plain=st.lists(st.integers(1, 3000), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_global_norm_of_a_flat_buffer_matches_fp64(n_layers, row_shapes, plain, seed):
    grads, buffer = _flat_grads(n_layers, row_shapes, plain, seed)
    runs = optim.base.flat_runs(tree.tensors(grads))
    assert runs is not None and sum(r.numel() for r in runs) == buffer.numel()
    ref = torch.linalg.vector_norm(buffer.double())
    got = optim.global_norm(grads)
    assert got.dtype == torch.float32
    # the per-tensor way, each strided leaf copied contiguous, agrees to rounding
    each = optim.global_norm(tree.map(lambda t: t.contiguous(), grads))
    torch.testing.assert_close(got, each, rtol=1e-5, atol=0)
    if all(t.is_contiguous() for t in tree.tensors(grads)):
        # no strided leaf (one stacked leaf, whose rows are adjacent): torch's per-tensor
        # reduction, bit for bit, as accurate as one fp32 reduction per tensor is
        assert torch.equal(got, each)
        assert abs(got.double() - ref) <= 1e-5 * ref
    else:  # normed over the buffer's runs, in short blocks
        assert abs(got.double() - ref) <= 1e-6 * ref


def test_flat_norm_is_more_accurate_than_one_reduction_over_a_long_run():
    # fp32 CPU reductions accumulate in fp32 lanes: one norm over 2M elements is off by about
    # 3e-5; the blocked norm over the same buffer is not
    grads, buffer = _flat_grads(4, [[512, 512], [512, 512]], [], 0)  # two leaves: strided
    ref = torch.linalg.vector_norm(buffer.double())
    assert abs(optim.global_norm(grads).double() - ref) <= 1e-7 * ref
    assert abs(torch.linalg.vector_norm(buffer).double() - ref) > 1e-6 * ref


def test_flat_runs_refuses_what_is_not_a_tiling():
    buffer = torch.arange(100.0)
    a, b = buffer[0:10], buffer[5:20]  # overlapping
    assert optim.base.flat_runs([a, b]) is None
    assert optim.base.flat_runs([buffer[:10], buffer[:10].double()]) is None  # two dtypes
    assert optim.base.flat_runs([buffer[::2]]) is None  # every other element: not a block
    assert optim.base.flat_runs([buffer.view(2, 5, 10)[:, :, ::2]]) is None  # rows with holes
    # a block read in another order of its dims (a column-major weight) covers its memory once:
    # a norm reads it as one run
    (run,) = optim.base.flat_runs([buffer.view(10, 10).t()])
    assert (run.storage_offset(), run.numel()) == (0, 100)
    (run,) = optim.base.flat_runs([buffer.view(4, 5, 5).transpose(1, 2)])  # rows transposed
    assert (run.storage_offset(), run.numel()) == (0, 100)
    assert optim.base.flat_runs([]) is None
    # a gap between two tensors makes two runs, each exactly what the tensors cover
    runs = optim.base.flat_runs([buffer[20:30], buffer[0:10]])
    assert runs is not None
    assert [(r.storage_offset(), r.numel()) for r in runs] == [(0, 10), (20, 10)]
    # plain separate tensors keep the per-tensor reduction: bit for bit clip_grad_norm_'s
    ts = [torch.randn(300, 7), torch.randn(5)]
    ps = [torch.nn.Parameter(t.clone()) for t in ts]
    for p, t in zip(ps, ts):
        p.grad = t.clone()
    assert torch.equal(optim.global_norm(ts), torch.nn.utils.clip_grad_norm_(ps, 1e9))


def test_flat_runs_of_one_geometry_on_other_buffers_view_those_buffers():
    # where the runs lie is worked out once per geometry; each call still cuts them from the
    # tensors it is given, so a second buffer laid out alike is normed from its own memory
    first, buffer = _flat_grads(3, [[4, 5], [6]], [7], 0)
    second, other = _flat_grads(3, [[4, 5], [6]], [7], 1)
    for grads, own in ((first, buffer), (second, other), (first, buffer)):
        runs = optim.base.flat_runs(tree.tensors(grads))
        assert runs is not None
        assert {r.untyped_storage().data_ptr() for r in runs} == {own.untyped_storage().data_ptr()}
        assert torch.equal(torch.cat(runs), own)
        ref = torch.linalg.vector_norm(own.double())
        assert abs(optim.global_norm(grads).double() - ref) <= 1e-6 * ref


def test_donated_fused_apply_over_strided_gradients_equals_the_plain_update():
    """With ``donate``, the fused AdamW keeps the rows it cuts from stacked parameters and
    moments for the next update; those rows must follow whatever state is passed in: the
    one it returned (the same tensors), or another one (a fresh state, a clone)."""
    g = torch.Generator().manual_seed(5)
    n_layers, shapes = 3, [[4, 5], [6]]
    opt = optim.adamw(1e-2, weight_decay=0.1)

    def fresh() -> dict:
        return {
            "p0": torch.randn(7, generator=g, dtype=torch.float64),
            "s0": torch.randn(n_layers, 4, 5, generator=g, dtype=torch.float64),
            "s1": torch.randn(n_layers, 6, generator=g, dtype=torch.float64),
        }

    params = fresh()
    slow_p, slow_s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    fast_p, fast_s = params, opt.init(params)
    for step in range(6):
        if step == 3:  # a state made elsewhere: other tensors, the same values
            fast_p = {k: v.clone() for k, v in fast_p.items()}
            fast_s = fast_s._replace(
                exp_avg=cf.tree.map(torch.clone, fast_s.exp_avg),
                exp_avg_sq=cf.tree.map(torch.clone, fast_s.exp_avg_sq),
            )
        grads, buffer = _flat_grads(n_layers, shapes, [7], step)
        buffer64 = buffer.double()
        # the gradients as fp64 views into one flat buffer, stacked leaves strided
        as64 = {}
        for k, v in grads.items():
            as64[k] = buffer64.as_strided(v.shape, v.stride(), v.storage_offset())
        assert not as64["s0"].is_contiguous()
        out = opt.apply(as64, fast_s, fast_p, donate=True)
        assert out is not None
        fast_p, fast_s = out
        updates, slow_s = opt.update({k: v.contiguous() for k, v in as64.items()}, slow_s, slow_p)
        slow_p = optim.apply_updates(slow_p, updates)
        for k in slow_p:
            torch.testing.assert_close(fast_p[k], slow_p[k], rtol=1e-12, atol=1e-14)


def _in_order(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x`` (its values, its shape) stored with its dims in memory in ``order``, outermost
    first: ``[1, 0]`` is a matrix stored column-major."""
    inverse = [order.index(d) for d in range(x.dim())]
    return x.permute(order).contiguous().permute(inverse)


@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
    orders=st.tuples(st.randoms(use_true_random=False), st.booleans(), st.booleans()),
    donate=st.booleans(),
)
def test_fused_adamw_follows_any_memory_order_of_params_moments_and_grads(
    shape, seed, orders, donate
):
    """The fused AdamW reads raw memory: a parameter stored in another order (a transposed
    view), with moments and gradients in the same or yet another order, gets torch.optim's
    update all the same (fp64)."""
    rng, moments_alike, grads_alike = orders
    perm = lambda: rng.sample(range(len(shape)), len(shape))  # noqa: E731
    p_order = perm()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = optim.adamw(**kw)
    params = {"w": _in_order(w, p_order)}
    state = opt.init(params)
    if not moments_alike:  # moments made elsewhere (a checkpoint), in their own order
        state = state._replace(
            exp_avg={"w": _in_order(state.exp_avg["w"], perm())},
            exp_avg_sq={"w": _in_order(state.exp_avg_sq["w"], perm())},
        )
    ref = w.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], **kw)
    for _ in range(STEPS):
        grad = torch.randn(shape, generator=g, dtype=torch.float64)
        assert opt.apply is not None
        given_grad = _in_order(grad, p_order if grads_alike else perm())
        out = opt.apply({"w": given_grad}, state, params, donate=donate)
        if out is None:  # declined: the unfused update, as the step does then
            updates, state = opt.update({"w": given_grad}, state, params)
            params = optim.apply_updates(params, updates)
        else:
            params, state = out
        ref.grad = grad
        torch_opt.step()
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-12, atol=1e-14)
    moments = torch_opt.state[ref]
    torch.testing.assert_close(state.exp_avg["w"], moments["exp_avg"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state.exp_avg_sq["w"], moments["exp_avg_sq"], rtol=1e-12, atol=0)


@given(
    layers=st.integers(1, 3),
    rows=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    gap=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_fused_adamw_on_column_major_layers_with_bucket_view_gradients(layers, rows, gap, seed):
    """Data parallelism's column-major weights (``shard``'s matmul order): the parameter and
    moments ``[L, in, out]`` column-major per layer, the gradient a view into a flat buffer
    whose layer rows lie ``in * out + gap`` elements apart, each column-major as well. The
    fused update (donated, row by row) equals torch.optim.AdamW's (fp64)."""
    shape = (layers, *rows)
    n = rows[0] * rows[1]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = optim.adamw(**kw)
    params = {"w": _in_order(w, [0, 2, 1])}
    state = opt.init(params)
    assert state.exp_avg["w"].stride() == params["w"].stride()  # moments follow the order
    ref = w.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], **kw)
    buffer = torch.full((gap + layers * (n + gap),), float("nan"), dtype=torch.float64)
    view = buffer.as_strided(shape, (n + gap, 1, rows[0]), gap)  # rows column-major, apart
    for _ in range(STEPS):
        grad = torch.randn(shape, generator=g, dtype=torch.float64)
        view.copy_(grad)
        assert opt.apply is not None
        out = opt.apply({"w": view}, state, params, donate=True)
        assert out is not None  # the fused path
        params, state = out
        ref.grad = grad
        torch_opt.step()
    assert params["w"].stride() == _in_order(w, [0, 2, 1]).stride()
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-12, atol=1e-14)
    moments = torch_opt.state[ref]
    torch.testing.assert_close(state.exp_avg["w"], moments["exp_avg"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state.exp_avg_sq["w"], moments["exp_avg_sq"], rtol=1e-12, atol=0)
