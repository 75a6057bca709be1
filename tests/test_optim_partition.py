"""optim.multi_transform, optim.masked and optim.set_to_zero against torch.optim's parameter
groups, in fp64 (equal to 1e-12 after several AdamW steps), and their refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import optim, tree
from colfunc.transforms.local import local_piece


def _params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "embed": {"tokens": r(7, 4)},
        "blocks": {"attn": {"wq": r(2, 4, 4), "bq": r(2, 4)}, "ln": {"weight": r(2, 4)}},
        "head": {"weight": r(4, 7)},
    }


def _grads(params: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def _run(opt: optim.GradientTransformation, params: dict, steps: int) -> tuple[dict, object]:
    state = opt.init(params)
    for s in range(steps):
        updates, state = opt.update(_grads(params, s), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _torch_groups(params: dict, groups: dict[str, dict], label_of, steps: int) -> dict:
    """torch.optim.AdamW over parameter groups: ``groups[label]`` are its options; a label
    absent from ``groups`` is frozen (in no group)."""
    ref = {p: x.clone().requires_grad_() for p, x in tree.flatten_with_paths(params)[0]}
    param_groups = [
        {"params": [ref[p] for p in ref if label_of(p) == label], **options}
        for label, options in groups.items()
    ]
    opt = torch.optim.AdamW([g for g in param_groups if g["params"]])
    for s in range(steps):
        grads = dict(tree.flatten_with_paths(_grads(params, s))[0])
        for p, x in ref.items():
            x.grad = grads[p].clone()
        opt.step()
    return {p: x.detach() for p, x in ref.items()}


LABELS = ["fast", "slow", "frozen"]


@settings(max_examples=10, deadline=None)
@given(
    # (at least one leaf trained: torch.optim refuses an empty parameter list)
    assignment=st.lists(st.sampled_from(LABELS), min_size=5, max_size=5).filter(
        lambda a: set(a) != {"frozen"}
    ),
    steps=st.integers(1, 4),
)
def test_multi_transform_equals_torch_parameter_groups(assignment, steps) -> None:
    params = _params()
    paths = tree.paths(params)
    label_of = dict(zip(paths, assignment)).__getitem__
    opt = optim.multi_transform(
        {
            "fast": optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1),
            "slow": optim.adamw(1e-3, weight_decay=0.0),
            "frozen": optim.set_to_zero(),
        },
        label_of,
    )
    got, state = _run(opt, params, steps)
    want = _torch_groups(
        params,
        {
            "fast": {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.1},
            "slow": {"lr": 1e-3, "weight_decay": 0.0},
        },
        label_of,
        steps,
    )
    for p, x in tree.flatten_with_paths(got)[0]:
        torch.testing.assert_close(x, want[p], rtol=0, atol=1e-12, msg=p)
        if label_of(p) == "frozen":
            assert torch.equal(x, dict(tree.flatten_with_paths(params)[0])[p]), p
    # state only for the leaves each optimizer updates; none for the frozen ones
    assert set(state) == set(assignment) - (set() if "frozen" in assignment else {"frozen"})
    held = {
        p for label in ("fast", "slow") if label in state for p in tree.paths(state[label].exp_avg)
    }
    assert held == {p for p in paths if label_of(p) != "frozen"}
    if "frozen" in state:
        assert state["frozen"] == ()


def test_multi_transform_takes_a_pattern_table_and_a_label_tree() -> None:
    params = _params(1)
    table = {"blocks.*": "slow", "*": "fast"}
    tree_labels = tree.map_with_path(
        lambda p, _: "slow" if p.startswith("blocks") else "fast", params
    )
    opts = {"fast": optim.adamw(1e-2), "slow": optim.sgd(0.1)}
    a, _ = _run(optim.multi_transform(opts, table), params, 2)
    b, _ = _run(optim.multi_transform(opts, tree_labels), params, 2)
    for (p, x), (_, y) in zip(tree.flatten_with_paths(a)[0], tree.flatten_with_paths(b)[0]):
        assert torch.equal(x, y), p
    sgd_only, _ = _run(optim.sgd(0.1), {"blocks": params["blocks"]}, 2)
    for p, x in tree.flatten_with_paths(a["blocks"])[0]:
        assert torch.equal(x, dict(tree.flatten_with_paths(sgd_only["blocks"])[0])[p])


def test_masked_runs_inner_on_the_selection_and_passes_the_rest_through() -> None:
    params = _params(2)
    grads = _grads(params, 0)
    inner = optim.adamw(1e-2, weight_decay=0.1)
    opt = optim.masked(inner, ["blocks.attn.*", "head.*"])
    state = opt.init(params)
    assert sorted(tree.paths(state.exp_avg)) == ["blocks.attn.bq", "blocks.attn.wq", "head.weight"]
    updates, _ = opt.update(grads, state, params)
    chosen = {"blocks": {"attn": params["blocks"]["attn"]}, "head": params["head"]}
    want, _ = inner.update(
        tree.subset(grads, lambda p: p.startswith(("blocks.attn", "head"))),
        inner.init(chosen),
        chosen,
    )
    for p, u in tree.flatten_with_paths(updates)[0]:
        if p.startswith(("blocks.attn", "head")):
            assert torch.equal(u, dict(tree.flatten_with_paths(want)[0])[p]), p
        else:  # passed through as it came
            assert u is dict(tree.flatten_with_paths(grads)[0])[p], p
    # the same selection as a predicate and as a tree of bools
    by_pred = optim.masked(inner, lambda p: p.startswith(("blocks.attn", "head")))
    by_tree = optim.masked(
        inner, tree.map_with_path(lambda p, _: p.startswith(("blocks.attn", "head")), params)
    )
    for o in (by_pred, by_tree):
        u, _ = o.update(grads, o.init(params), params)
        for (p, a), (_, b) in zip(
            tree.flatten_with_paths(u)[0], tree.flatten_with_paths(updates)[0]
        ):
            assert torch.equal(a, b), p


def test_weight_decay_on_weights_only_equals_torch_groups() -> None:
    """AdamW whose decay spares the biases and norms: two labels, as two torch parameter groups
    (decay 0.1 and 0)."""
    params = _params(3)
    decayed = lambda p: p.rsplit(".", 1)[-1].startswith("w") or p == "embed.tokens"  # noqa: E731
    opt = optim.multi_transform(
        {
            "decay": optim.adamw(1e-2, weight_decay=0.1),
            "no_decay": optim.adamw(1e-2, weight_decay=0.0),
        },
        lambda p: "decay" if decayed(p) else "no_decay",
    )
    got, _ = _run(opt, params, 3)
    want = _torch_groups(
        params,
        {"decay": {"lr": 1e-2, "weight_decay": 0.1}, "no_decay": {"lr": 1e-2, "weight_decay": 0.0}},
        lambda p: "decay" if decayed(p) else "no_decay",
        3,
    )
    for p, x in tree.flatten_with_paths(got)[0]:
        torch.testing.assert_close(x, want[p], rtol=0, atol=1e-12, msg=p)


COMPOSITIONS = {
    "dp2-zero1": ({"dp": 2}, lambda ref, m: cf.zero(cf.shard(ref, m), stage=1)),
    "dp2-zero3": ({"dp": 2}, lambda ref, m: cf.zero(cf.shard(ref, m), stage=3)),
    "tp2": ({"tp": 2}, lambda ref, m: cf.shard(ref, m, plan=cf.models.gpt.tp_plan)),
    "pp2": ({"pp": 2}, lambda ref, m: cf.pipeline(ref, 2, microbatches=2)),
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_under_transforms_equal_to_one_device(name) -> None:
    cfg = cf.models.gpt.Config(vocab_size=32, n_layer=2, n_head=2, d_model=8, max_seq_len=8)
    params = tree.map(lambda x: x.double(), cf.models.gpt.init(cfg))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    opt = optim.multi_transform(
        {"train": optim.adamw(1e-2), "frozen": optim.set_to_zero()},
        {"embed.*": "frozen", "*": "train"},
    )
    ref = cf.train_step(cf.models.gpt.loss(cfg), opt)

    mesh_shape, compose = COMPOSITIONS[name]

    def main(mesh):
        step = compose(ref, mesh)
        cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
        state = step(step.init(params), batches[0])[0]
        final = cf.full_state(state)
        # the groups' states, gathered to the single-device layout and cut again
        again = step.place_state(final)
        for (p, a), (_, b) in zip(
            tree.flatten_with_paths(again.opt_state)[0], tree.flatten_with_paths(state.opt_state)[0]
        ):
            assert not isinstance(a, torch.Tensor) or torch.equal(local_piece(a), local_piece(b)), p
        assert tree.structure(again.opt_state) == tree.structure(state.opt_state)
        single = ref(ref.init(params), batches[0])[0]
        for (p, a), (_, b) in zip(
            tree.flatten_with_paths(final.opt_state)[0],
            tree.flatten_with_paths(single.opt_state)[0],
        ):
            assert not isinstance(a, torch.Tensor) or torch.allclose(a, b, rtol=1e-9, atol=1e-12), p
        return final.params["embed"]

    for embed in cf.launch(main, mesh=mesh_shape):
        for p, x in tree.flatten_with_paths(embed)[0]:
            assert torch.equal(x, params["embed"][p]), p


def test_refusals_name_the_value_and_the_fix() -> None:
    params = _params()
    with pytest.raises(ValueError, match=r"label 'typo', which is not one of \['a'\]"):
        optim.multi_transform({"a": optim.sgd(0.1)}, lambda p: "typo").init(params)
    with pytest.raises(
        ValueError, match=r"no pattern of \['blocks\.\*'\] matches the parameter 'embed.tokens'"
    ):
        optim.multi_transform({"a": optim.sgd(0.1)}, {"blocks.*": "a"}).init(params)
    with pytest.raises(TypeError, match="non-empty dict of labels"):
        optim.multi_transform({}, lambda p: "a")
    with pytest.raises(TypeError, match=r"transforms\['a'\] is 3"):
        optim.multi_transform({"a": 3}, lambda p: "a")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"the mask 'nothing\.\*' selects none of the parameters"):
        optim.masked(optim.sgd(0.1), "nothing.*").init(params)
    with pytest.raises(TypeError, match="the mask must be a path pattern"):
        optim.masked(optim.sgd(0.1), 3)
    with pytest.raises(ValueError, match="not shaped like the parameters"):
        optim.masked(optim.sgd(0.1), {"embed": {"tokens": True}}).init(params)
    with pytest.raises(TypeError, match="masked: inner must be a GradientTransformation"):
        optim.masked("adam", "*")  # type: ignore[arg-type]
