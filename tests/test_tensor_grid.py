"""2D, 2.5D and 3D tensor parallelism: equal to one device, with the papers' traffic and memory.

Every mode runs the unchanged GPT and LLaMA on the threads backend and must give the
single-device losses and parameters (fp64, Adam with clipping, 1e-9). A single linear layer in
each mode is checked against dense maths; the ledger's bytes per layer against the closed forms
of SUMMA (2D, 2.5D) and of the 3D matmul; parameter and activation bytes per rank against
Ψ/P; the rank layout of every group against ColossalAI's legacy initialisers' formulas.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import core, models, optim, parallel
from colfunc.nn.plans import grid_axes, tensor_plans
from colfunc.sharding import Mesh, distribute, placements_from_spec
from colfunc.transforms import grid

pytestmark = pytest.mark.timeout(300)

MODELS = {"gpt": models.gpt, "llama": models.llama}
# (mode, size, depth): the sizes
MODES = [("2d", 4, None), ("2.5d", 8, 2), ("2.5d", 4, 1), ("3d", 8, None)]
ADAM_CLIP = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))


def _mesh(mode: str, size: int, depth: int | None, **outer: int) -> dict[str, int]:
    return {"dp": 1, **outer, **grid_axes(mode, size, depth)}


def _problem(name: str, n_layer: int = 2, dtype: torch.dtype = torch.float64) -> Any:
    model = MODELS[name]
    cfg = model.Config(vocab_size=64, n_layer=n_layer, n_head=4, d_model=32, max_seq_len=32)
    params = cf.tree.map(lambda x: x.to(dtype), model.init(cfg, seed=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    return model, cfg, params, batches


def _equivalent(name: str, mode: str, mesh: dict[str, int], composition: dict[str, Any]) -> None:
    model, cfg, params, batches = _problem(name)
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    comp = {"order": ("shard",), **composition, "tensor_mode": mode}

    def main(m: Mesh) -> Any:
        step = cf.testing.compose(ref, m, comp, plan=model.tp_plans[mode])
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.sharding.reset_fallback_counts()
    cf.launch(main, mesh=mesh, timeout=200)
    assert cf.sharding.fallback_counts() == {}, "a grid mode fell back to gathering"


# --- one linear layer ---------------------------------------------------------------------------

# the activation layouts of the module docs' table, written out independently
_IN = {
    ("2d", "column"): cf.P("tp_row", None, "tp_col"),
    ("2.5d", "column"): cf.P(("tp_dep", "tp_row"), None, "tp_col"),
    ("3d", "column"): cf.P(("tp_y", "tp_x"), None, "tp_z"),
    ("3d", "row"): cf.P(("tp_z", "tp_x"), None, "tp_y"),
}
_IN[("2d", "row")], _IN[("2.5d", "row")] = _IN[("2d", "column")], _IN[("2.5d", "column")]
_OUT = {**_IN, ("3d", "column"): _IN[("3d", "row")], ("3d", "row"): _IN[("3d", "column")]}


@pytest.mark.parametrize(("mode", "size", "depth"), MODES)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_one_linear_forward_and_backward_match_dense(mode, size, depth, kind) -> None:
    B, T, K, N = 8, 3, 8, 12
    g = torch.Generator().manual_seed(0)
    x, w, b, gy = (
        torch.randn(s, generator=g, dtype=torch.float64)
        for s in ((B, T, K), (K, N), (N,), (B, T, N))
    )
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ((xr @ wr + br) * gy).sum().backward()
    names = {"column": ("w",), "row": ()}, {"column": (), "row": ("w",)}
    plan = tensor_plans(
        column=names[0][kind],
        row=names[1][kind],
        column_bias=("b",) if kind == "column" else (),
        hidden=("b",) if kind == "row" else (),
        stacked="blocks.",
    )[mode]

    def main(mesh: Mesh) -> Any:
        layout = grid.GridLayout.make(mode, mesh)
        wp = distribute(w, mesh, placements_from_spec(mesh, plan["w"], 2)).requires_grad_()
        bp = distribute(b, mesh, placements_from_spec(mesh, plan["b"], 1)).requires_grad_()
        xp = distribute(x, mesh, placements_from_spec(mesh, _IN[(mode, kind)], 3))
        xp.requires_grad_()
        with cf.sharding.recording(mesh) as led, core.context(grid.GridLinear(layout)):
            y = cf.nn.linear(xp, wp, bp)
        assert y.placements == placements_from_spec(mesh, _OUT[(mode, kind)], 3)
        ops = {op for op, _ in led.as_dict()}
        # the mode's matmul ran: SUMMA's broadcasts, or 3D's gathers and reduce-scatter
        assert ops == ({"broadcast"} if mode != "3d" else {"all_gather", "reduce_scatter"})
        # each element of y lives on exactly one rank: the local products sum to the loss
        (y.to_local() * distribute(gy, mesh, y.placements).to_local()).sum().backward()
        return (
            y.full_tensor(),
            xp.grad.full_tensor(),
            wp.grad.full_tensor(),
            bp.grad.full_tensor(),
        )

    for got in cf.launch(main, mesh=_mesh(mode, size, depth)):
        for a, e in zip(got, (x @ w + b, xr.grad, wr.grad, br.grad)):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


# --- whole models ------------------------------------------------------------------------------


# LLaMA on the 8-rank grids (about 8 s each) runs with -m slow; GPT covers them by default
@pytest.mark.parametrize(
    ("name", "mode", "size", "depth"),
    [
        pytest.param(n, *m, marks=pytest.mark.slow if n == "llama" and m[1] == 8 else ())
        for m in MODES
        for n in sorted(MODELS)
    ],
)
def test_every_mode_equals_single_device_fp64(name, mode, size, depth) -> None:
    # 2.5D at depth 1 is 2D's maths: run it under selective remat, which caches the matmuls'
    # outputs inside SUMMA's steps and refuses any that are modified in place
    selective = {"remat": "save_matmuls", "order": ("shard", "remat")}
    _equivalent(name, mode, _mesh(mode, size, depth), selective if depth == 1 else {})


@st.composite
def _grid_compositions(draw: Any) -> tuple[str, dict[str, int], dict[str, Any]]:
    mode, size, depth, dp = draw(
        st.sampled_from(
            [("2d", 4, None, 1), ("2d", 4, None, 2), ("2.5d", 4, 1, 2), ("3d", 8, None, 1)]
        )
    )
    comp = draw(cf.testing.compositions(mesh_strategy=st.just({"dp": dp})))
    comp.pop("mesh")
    comp["sequence_parallel"] = False
    return mode, _mesh(mode, size, depth, dp=dp), comp


@pytest.mark.parametrize(
    "name", [n if n == "gpt" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)]
)
@settings(max_examples=2, deadline=None)
@given(drawn=_grid_compositions())
def test_grid_modes_compose_in_any_order(name, drawn) -> None:
    """Data parallel, ZeRO 0-3, remat and amp, applied in a drawn order around each mode."""
    mode, mesh, comp = drawn
    _equivalent(name, mode, mesh, comp)


def test_the_seed_config_pipeline_2_with_2p5d_depth_1_size_4() -> None:
    """``parallel = dict(pipeline=2, tensor=dict(mode='2.5d', depth=1, size=4))`` (ColossalAI's
    example), built by the config path, equals one device."""
    pc = parallel.parse({"pipeline": 2, "tensor": {"mode": "2.5d", "depth": 1, "size": 4}})
    assert pc.pipeline == {"stages": 2, "microbatches": 2}
    assert pc.mesh_shape == {"dp": 1, "pp": 2, "tp_dep": 1, "tp_row": 2, "tp_col": 2}
    model, cfg, params, batches = _problem("llama")
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)

    def main(mesh: Mesh) -> Any:
        step = parallel.build(ref, mesh, pc, parallel.model_plan(model, pc))
        return cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)

    cf.launch(main, mesh=pc.mesh_shape, timeout=200)


# --- traffic -----------------------------------------------------------------------------------


def _step_ledger(mode: str, size: int, depth: int | None, n_layer: int) -> dict[Any, int]:
    model, cfg, params, batches = _problem("gpt", n_layer, torch.float32)
    ref = cf.train_step(model.loss(cfg), optim.sgd(0.1))

    def main(mesh: Mesh) -> Any:
        step = cf.shard(ref, mesh, model.tp_plans[mode], tensor_mode=mode)
        state = step.init(params)
        with cf.sharding.recording(mesh) as led:
            step(state, batches[0])
        return led.as_dict()

    out = cf.launch(main, mesh=_mesh(mode, size, depth))
    assert all(o == out[0] for o in out), "every rank sends the same bytes"
    return out[0]


def _closed_form(mode: str, size: int, depth: int | None) -> dict[tuple[str, str], int]:
    """Bytes one rank sends per transformer layer of the tiny GPT in the mode's matmuls, by the
    papers' algorithms (M rows = B*T, s bytes per element; a linear is K -> N):

    SUMMA (q x q; 2.5D: each depth's M/d rows), forward q broadcasts of X's and W's blocks,
    backward ``dX = dY W^T`` (broadcast W, reduce to the owner) and ``dW = X^T dY`` (broadcast X,
    reduce): along rows ``tp_col`` 2 (q-1) M K s / (d q²) of broadcasts and (q-1) M K s / (d q²)
    of reduces; along columns ``tp_row`` 2 (q-1) K N s / q² and (q-1) K N s / q².

    3D (q³), c = (q-1) s / q³: forward all_gather X over the input axis (M K c), W over tp_x
    (K N c), reduce_scatter over the output axis (M N c); backward all_gather dY (M N c) and again
    X and W, reduce_scatter dX (M K c) and dW (K N c). Column-parallel layers take tp_y in and
    tp_z out, row-parallel ones the other way.
    """
    cfg = models.gpt.Config(vocab_size=64, n_layer=1, n_head=4, d_model=32, max_seq_len=32)
    D, Fw, M, s = cfg.d_model, cfg.d_ff, 8 * 16, 4
    assert Fw is not None
    column = [(D, D)] * 3 + [(D, Fw)]
    row = [(D, D), (Fw, D)]
    out: dict[tuple[str, str], float] = {}

    def add(op: str, axis: str, n: float) -> None:
        out[(op, axis)] = out.get((op, axis), 0) + n

    if mode in ("2d", "2.5d"):
        d = depth or 1
        q = math.isqrt(size // d)
        for K, N in column + row:
            add("broadcast", "tp_col", 2 * (q - 1) * M * K * s / (d * q * q))
            add("reduce", "tp_col", (q - 1) * M * K * s / (d * q * q))
            add("broadcast", "tp_row", 2 * (q - 1) * K * N * s / (q * q))
            add("reduce", "tp_row", (q - 1) * K * N * s / (q * q))
    else:
        q = round(size ** (1 / 3))
        c = (q - 1) * s / q**3
        for kinds, inp, outp in ((column, "tp_y", "tp_z"), (row, "tp_z", "tp_y")):
            for K, N in kinds:
                add("all_gather", inp, 2 * M * K * c)
                add("reduce_scatter", inp, M * K * c)
                add("all_gather", outp, M * N * c)
                add("reduce_scatter", outp, M * N * c)
                add("all_gather", "tp_x", 2 * K * N * c)
                add("reduce_scatter", "tp_x", K * N * c)
    return {k: int(v) for k, v in out.items()}


@pytest.mark.parametrize(("mode", "size", "depth"), MODES)
def test_traffic_per_layer_is_the_papers_closed_form(mode, size, depth) -> None:
    one, two = (_step_ledger(mode, size, depth, n) for n in (1, 2))
    per_layer = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
    expected = _closed_form(mode, size, depth)
    matmul_ops = {op for op, _ in expected}
    measured = {k: v for k, v in per_layer.items() if k[0] in matmul_ops and v}
    assert measured == expected


# --- memory ------------------------------------------------------------------------------------


def _local_bytes(tree: Any) -> int:
    total = 0
    for x in cf.tree.leaves(tree):
        local = x.to_local() if hasattr(x, "to_local") else x
        total += local.numel() * local.element_size()
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(("mode", "size", "depth"), MODES)
def test_weights_take_psi_over_p_per_rank(name, mode, size, depth) -> None:
    """Every column- and row-parallel weight takes 1/P of its bytes per rank (2.5D: 1/q², held
    on every depth as in Tesseract); the vectors along the width take 1/q."""
    model, cfg, params, _ = _problem(name, dtype=torch.float32)
    plan = model.tp_plans[mode]
    matrices = [p for p, spec in plan.items() if len(spec) == 3 and spec[1] is not None]
    q = round(size ** (1 / 3)) if mode == "3d" else math.isqrt(size // (depth or 1))
    split = size if mode != "2.5d" else q * q

    def main(mesh: Mesh) -> Any:
        placed = cf.shard(
            cf.train_step(model.loss(cfg), optim.sgd(0.1)), mesh, plan, tensor_mode=mode
        ).init(params)
        flat = dict(cf.tree.flatten_with_paths(placed.params)[0])
        return {p: _local_bytes(flat[p]) for p in flat}

    flat_ref = dict(cf.tree.flatten_with_paths(params)[0])
    for per_rank in cf.launch(main, mesh=_mesh(mode, size, depth)):
        for path in matrices:
            assert per_rank[path] * split == _local_bytes(flat_ref[path]), path
        assert sum(per_rank.values()) < _local_bytes(params) / q


def _block_activations(mode: str | None, size: int, depth: int | None) -> list[int]:
    """Bytes each rank holds for the backward of the stacked blocks at the end of the forward
    pass (cf.memory.track: live bytes entering ``post`` minus those leaving ``pre``)."""
    cfg = models.gpt.Config(vocab_size=64, n_layer=2, n_head=8, d_model=64, max_seq_len=64)
    params = models.gpt.init(cfg, seed=0)
    ids = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    base = models.gpt.loss(cfg)

    def main(mesh: Mesh) -> int:
        seen: dict[str, int] = {}
        tracker: list[Any] = []

        def pre(p: Any, b: Any) -> Any:
            out = base.pre(p, b)
            seen["pre"] = tracker[0].live
            return out

        def post(p: Any, carry: Any, b: Any) -> Any:
            seen["post"] = tracker[0].live
            return base.post(p, carry, b)

        loss_fn = cf.layered(pre, base.block, post, name="gpt", divisors=base.divisors)
        step = cf.train_step(loss_fn, optim.sgd(0.1))
        if mode is not None:
            step = cf.shard(step, mesh, models.gpt.tp_plans[mode], tensor_mode=mode)
        state = step.init(params)
        with cf.memory.track(state) as t:
            tracker.append(t)
            step.forward_backward(state.params, batch, {})
        return seen["post"] - seen["pre"]

    return cf.launch(main, mesh=_mesh(mode, size, depth) if mode else {"dp": 1})


def test_block_activations_fall_as_one_over_p() -> None:
    """Against one device (1D's activations are whole on every rank): 1/q² for 2D, 1/(d q²) for
    2.5D, 1/q³ for 3D, within 10%."""
    one = _block_activations(None, 1, None)[0]
    for mode, size, depth in (("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None)):
        per_rank = max(_block_activations(mode, size, depth))
        assert per_rank <= one / size * 1.1, (mode, per_rank, one)


# --- rank layouts ------------------------------------------------------------------------------


def _colossal_2d(world: int, tp: int) -> dict[str, set[tuple[int, ...]]]:
    """ColossalAI's ``Initializer_2D_Row`` and ``_Col`` groups (legacy/context)."""
    q, num_group = math.isqrt(tp), world // tp
    row = {tuple(i * tp + j * q + k for k in range(q)) for i in range(num_group) for j in range(q)}
    col = {tuple(i * tp + j + k * q for k in range(q)) for i in range(num_group) for j in range(q)}
    return {"PARALLEL_2D_ROW": row, "PARALLEL_2D_COL": col}


def _colossal_2p5d(world: int, tp: int, dep: int) -> dict[str, set[tuple[int, ...]]]:
    q, num_group = math.isqrt(tp // dep), world // tp
    groups: dict[str, set[tuple[int, ...]]] = {
        "PARALLEL_2P5D_ROW": set(),
        "PARALLEL_2P5D_COL": set(),
        "PARALLEL_2P5D_DEP": set(),
    }
    for h in range(num_group):
        for j in range(q):
            for k in range(dep):
                groups["PARALLEL_2P5D_ROW"].add(
                    tuple(h * tp + i + q * (j + q * k) for i in range(q))
                )
        for i in range(q):
            for k in range(dep):
                groups["PARALLEL_2P5D_COL"].add(
                    tuple(h * tp + i + q * (j + q * k) for j in range(q))
                )
        for i in range(q):
            for j in range(q):
                groups["PARALLEL_2P5D_DEP"].add(
                    tuple(h * tp + i + q * (j + q * k) for k in range(dep))
                )
    return groups


def _colossal_3d(world: int, tp: int) -> dict[str, set[tuple[int, ...]]]:
    q, num_group = round(tp ** (1 / 3)), world // tp
    groups: dict[str, set[tuple[int, ...]]] = {
        "PARALLEL_3D_INPUT": set(),
        "PARALLEL_3D_WEIGHT": set(),
        "PARALLEL_3D_OUTPUT": set(),
    }
    for h in range(num_group):
        for a in range(q):
            for b in range(q):
                groups["PARALLEL_3D_INPUT"].add(
                    tuple(h * q**3 + a + q * (j + q * b) for j in range(q))
                )
                groups["PARALLEL_3D_WEIGHT"].add(
                    tuple(h * q**3 + i + q * (a + q * b) for i in range(q))
                )
                groups["PARALLEL_3D_OUTPUT"].add(
                    tuple(h * q**3 + a + q * (b + q * k) for k in range(q))
                )
    return groups


@pytest.mark.parametrize(
    ("mode", "size", "depth", "names"),
    [
        ("2d", 4, None, {"tp_col": "PARALLEL_2D_ROW", "tp_row": "PARALLEL_2D_COL"}),
        ("2d", 9, None, {"tp_col": "PARALLEL_2D_ROW", "tp_row": "PARALLEL_2D_COL"}),
        (
            "2.5d",
            8,
            2,
            {
                "tp_col": "PARALLEL_2P5D_ROW",
                "tp_row": "PARALLEL_2P5D_COL",
                "tp_dep": "PARALLEL_2P5D_DEP",
            },
        ),
        (
            "2.5d",
            18,
            2,
            {
                "tp_col": "PARALLEL_2P5D_ROW",
                "tp_row": "PARALLEL_2P5D_COL",
                "tp_dep": "PARALLEL_2P5D_DEP",
            },
        ),
        (
            "3d",
            8,
            None,
            {
                "tp_y": "PARALLEL_3D_INPUT",
                "tp_x": "PARALLEL_3D_WEIGHT",
                "tp_z": "PARALLEL_3D_OUTPUT",
            },
        ),
        (
            "3d",
            27,
            None,
            {
                "tp_y": "PARALLEL_3D_INPUT",
                "tp_x": "PARALLEL_3D_WEIGHT",
                "tp_z": "PARALLEL_3D_OUTPUT",
            },
        ),
    ],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_rank_layout_is_colossalais(mode, size, depth, names, dp) -> None:
    mesh = Mesh({"dp": dp, **grid_axes(mode, size, depth)})
    world = dp * size
    colossal = {
        "2d": lambda: _colossal_2d(world, size),
        "2.5d": lambda: _colossal_2p5d(world, size, depth),
        "3d": lambda: _colossal_3d(world, size),
    }[mode]()
    for axis, their in names.items():
        assert set(mesh.groups(axis)) == colossal[their], axis


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "size", "depth", "match"),
    [
        ("2d", 8, None, "square size .* got 8; the nearest are 4 or 9"),
        ("2d", 2, None, "the nearest are 1 or 4"),
        ("2.5d", 8, 3, r"size = depth \* q\^2, got size=8 with depth=3; .* nearest are 3 or 12"),
        ("2.5d", 12, 2, "nearest are 8 or 18"),
        ("3d", 9, None, "cube size .* got 9; the nearest are 8 or 27"),
        ("4d", 4, None, "must be one of"),
        ("2d", 4, 2, "depth is for mode '2.5d'"),
    ],
)
def test_bad_sizes_name_the_nearest_valid_ones(mode, size, depth, match) -> None:
    with pytest.raises(ValueError, match=match):
        grid_axes(mode, size, depth)
    with pytest.raises(ValueError, match=match):
        tensor = {"mode": mode, "size": size} | ({"depth": depth} if depth else {})
        parallel.parse({"tensor": tensor})


def _shard_error(mode: str, size: int, plan: Any, cfg: Any, batch_rows: int = 8) -> str:
    model = models.gpt
    params = model.init(cfg, seed=0)
    ids = torch.zeros((batch_rows, 16), dtype=torch.long)

    def main(mesh: Mesh) -> str:
        try:
            step = cf.shard(
                cf.train_step(model.loss(cfg), optim.sgd(0.1)), mesh, plan, tensor_mode=mode
            )
            step(step.init(params), {"input_ids": ids, "labels": ids})
        except ValueError as e:
            return str(e)
        return "no error"

    return cf.launch(main, mesh=_mesh(mode, size, None))[0]


def test_heads_widths_batches_and_plans_that_do_not_fit_are_named() -> None:
    ok = models.gpt.Config(vocab_size=64, n_layer=1, n_head=4, d_model=32, max_seq_len=32)
    odd_heads = models.gpt.Config(vocab_size=64, n_layer=1, n_head=3, d_model=36, max_seq_len=32)
    msg = _shard_error("2d", 4, models.gpt.tp_plans["2d"], odd_heads)
    assert "n_head=3, not divisible by q=2 of tensor mode '2d'" in msg and "1 or 9" in msg
    odd_width = models.gpt.Config(vocab_size=64, n_layer=1, n_head=2, d_model=18, max_seq_len=32)
    msg = _shard_error("3d", 8, models.gpt.tp_plans["3d"], odd_width)
    assert "size 18" in msg and "the nearest sizes that divide it: 1 or 27" in msg
    msg = _shard_error("3d", 8, models.gpt.tp_plans["3d"], ok, batch_rows=6)
    assert "6 rows" in msg and "multiple of 4" in msg
    msg = _shard_error("2d", 4, models.gpt.tp_plan, ok)
    assert "uses axis 'tp'" in msg and "tp_plans['2d']" in msg


def test_a_model_without_grid_plans_is_named() -> None:
    pc = parallel.parse({"tensor": {"mode": "2d", "size": 4}})
    with pytest.raises(ValueError, match=r"tp_plans\['2d'\].*lacks"):
        parallel.model_plan(models.opt, pc)
    assert parallel.model_plan(models.gpt, pc) == models.gpt.tp_plans["2d"]


def test_one_d_plans_are_megatrons() -> None:
    """The 1D plan derived from the description is the hand-written Megatron layout."""
    assert models.gpt.tp_plan["blocks.attn.wq"] == cf.P(None, None, "tp")
    assert models.gpt.tp_plan["blocks.attn.wo"] == cf.P(None, "tp", None)
    assert models.gpt.tp_plan["blocks.mlp.b_in"] == cf.P(None, "tp")
    assert models.gpt.tp_plan["embed.tokens"] == cf.P("tp", None)
    assert "blocks.ln1.*" not in models.gpt.tp_plan  # replicated in 1D
    assert models.llama.tp_plan["head.weight"] == cf.P(None, "tp")


# --- gloo processes and the CLI ------------------------------------------------------------------


def _gloo_case(mesh: Mesh) -> Any:
    mode = "2d" if "tp_row" in mesh.axis_names else "3d"
    model, cfg, params, batches = _problem("gpt")
    ref = cf.train_step(model.loss(cfg), ADAM_CLIP)
    step = cf.shard(ref, mesh, model.tp_plans[mode], tensor_mode=mode)
    step = cf.remat(cf.zero(step, 3 if mode == "2d" else 1), "full")
    losses = cf.testing.assert_equivalent(step, ref, params, batches, rtol=1e-9, atol=1e-12)
    return losses, cf.sharding.fallback_counts(mesh)


@pytest.mark.slow  # 8 gloo processes each, about 22 s on 2 cores
@pytest.mark.parametrize(
    "mesh",
    [{"dp": 2, "tp_row": 2, "tp_col": 2}, {"dp": 1, "tp_z": 2, "tp_y": 2, "tp_x": 2}],
    ids=["dp2-2d-zero3-remat", "3d-zero1-remat"],
)
def test_composed_2d_and_3d_on_gloo_processes(mesh) -> None:
    results = cf.launch(_gloo_case, mesh=mesh, backend="gloo", timeout=240)
    assert len(results) == 8
    for losses, fallbacks in results:
        assert fallbacks == {} and losses == results[0][0]


CONFIG = """
from colfunc.config import DataConfig, OptimConfig, TrainConfig
from colfunc.models import llama
model = llama.Config(vocab_size=256, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
optim = OptimConfig(lr=1e-3)
data = DataConfig(corpus={corpus!r}, batch_size=8, seq_len=16)
train = TrainConfig(steps=4, log_every=2, eval_every=4, eval_batches=1, sample_tokens=4, out_dir={out!r})
parallel = {parallel!r}
"""


@pytest.mark.slow  # two training runs (threads, then 4 gloo processes): about 55 s
def test_colfunc_train_and_run_take_a_2d_config(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"m{i}.py").write_text(f"def f{i}(a):\n    return a + {i}\n" * 10)
    cfg = tmp_path / "grid.py"
    section = {"tensor": {"mode": "2d", "size": 4}}
    cfg.write_text(CONFIG.format(corpus=str(corpus), out=str(tmp_path / "runs"), parallel=section))
    for name, command in (
        ("threads", [sys.executable, "-m", "colfunc", "train", str(cfg)]),
        ("gloo", [sys.executable, "-m", "colfunc", "run", "-n", "4", "train", str(cfg)]),
    ):
        proc = subprocess.run(
            [*command, "--name", name, "--no-progress"], capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "'tp_row': 2, 'tp_col': 2" in proc.stdout
        assert (tmp_path / "runs" / name / "metrics.jsonl").exists()
