"""Mixtures of experts with dense layers between the sparse ones: Qwen2-MoE's and Qwen3-MoE's
``mlp_only_layers`` and ``decoder_sparse_step``, colfunc's ``Config.dense_layers``.

On tiny random ``transformers`` models with drawn patterns: which layers are dense is
``transformers``' own choice, and the logits and the loss with the load-balancing term (over the
sparse layers only) equal ``transformers``' within 1e-5; one AdamW step equals
``transformers`` + ``torch.optim.AdamW`` (fp64), the slices no layer reads staying zeros; the
exported folder holds exactly ``transformers``' keys and loads back bit for bit; the engine's
greedy tokens equal ``generate``'s (one device and tp2); expert parallelism with tp, with a
pipeline whose stages hold different kinds of layers, and with ZeRO-3 and the experts homed on
the host equal one device (fp64 AdamW, 1e-9).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_expert_parallel import _step_main
from test_moe import _batch, _fp64, _hf

import colfunc as cf
from colfunc import hf, models, optim, tree
from colfunc.inference import Engine, SamplingParams
from colfunc.models import decoder
from colfunc.sharding import launch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

pytestmark = pytest.mark.timeout(600)


def _sparse_in(model: Any) -> tuple[int, ...]:
    """The layers ``transformers`` built with a sparse block."""
    return tuple(
        i for i, layer in enumerate(model.model.layers) if "Sparse" in type(layer.mlp).__name__
    )


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["qwen2_moe", "qwen3_moe"]),
    n=st.integers(2, 4),
    only=st.sets(st.integers(0, 3), max_size=2),
    step=st.integers(1, 3),
    seed=st.integers(0, 50),
)
def test_dense_layers_are_transformers_own_and_compute_the_same(
    name: str, n: int, only: set[int], step: int, seed: int
) -> None:
    pattern = dict(num_hidden_layers=n, mlp_only_layers=sorted(only), decoder_sparse_step=step)
    model = _hf(name, seed, output_router_logits=True, router_aux_loss_coef=0.05, **pattern)
    sparse = _sparse_in(model)
    if not sparse:  # every layer dense: refused by name
        with pytest.raises(ValueError, match=r"with no sparse layer .*load it as its dense"):
            hf.from_hf(model)
        return
    cfg, params = hf.from_hf(model)
    assert cfg.sparse_layers == sparse and set(cfg.dense_layers) == set(range(n)) - set(sparse)
    module = models.of_config(cfg).module
    batch = _batch(seed)
    with torch.no_grad():
        out = model(**batch)
        logits = module.apply(params, batch["input_ids"], cfg)
        torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-5)
        loss = module.loss(cfg)(params, batch)
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)  # (aux: sparse layers only)


def test_one_adamw_step_equals_transformers_and_unused_slices_stay_zero() -> None:
    pattern = dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    model = _hf("qwen2_moe", seed=2, **pattern).double().train()
    cfg, params = hf.from_hf(model)
    assert cfg.dense_layers == (0, 2, 3)
    batch = _batch(2)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)  # (see test_moe)
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    model(**batch).loss.backward()
    opt.step()
    step = cf.train_step(models.qwen2_moe.loss(cfg), optim.adamw(**hyper))
    state, _ = step(step.init(params), batch)
    want = dict(tree.flatten_with_paths(hf.from_hf(model)[1])[0])
    got = dict(tree.flatten_with_paths(state.params)[0])
    assert got.keys() == want.keys()
    unused = 0
    for path, x in got.items():
        torch.testing.assert_close(x, want[path], rtol=0, atol=1e-5, msg=path)
        for i in decoder.unused_layers(cfg, path):  # zeros before and after the step
            assert not params_at(params, path)[i].any() and not x[i].any(), (path, i)
            unused += 1
    assert unused == 3 * 1 + 8 * 3  # the dense MLP in layer 1; the 8 sparse ones in 0, 2, 3
    fresh, lazy = models.qwen2_moe.init(cfg), models.qwen2_moe.init(cfg, abstract=True)
    for (path, x), (_, y) in zip(
        tree.flatten_with_paths(fresh)[0], tree.flatten_with_paths(cf.random.materialize(lazy))[0]
    ):
        assert torch.equal(x, y), path
        for i in range(cfg.n_layer) if path.startswith("blocks.mlp.") else ():
            assert bool(x[i].any()) == (i not in decoder.unused_layers(cfg, path)), (path, i)


def params_at(params: Any, path: str) -> torch.Tensor:
    return dict(tree.flatten_with_paths(params)[0])[path]


def test_export_writes_each_layer_its_own_mlp(tmp_path: Path) -> None:
    model = _hf("qwen3_moe", seed=4, num_hidden_layers=3, mlp_only_layers=[1])
    cfg, params = hf.from_hf(model)
    hf.save(tmp_path / "ours", cfg, params)
    model.save_pretrained(tmp_path / "theirs")
    keys = []
    for side in ("ours", "theirs"):
        with safetensors.safe_open(str(tmp_path / side / "model.safetensors"), "pt") as f:
            keys.append(set(f.keys()))
    assert keys[0] == keys[1] and "model.layers.1.mlp.gate_proj.weight" in keys[0]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert _sparse_in(back) == (0, 2)
    ids = _batch(5)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6
        )
    for again in (hf.from_hf(back)[1], hf.load(f"hf:{tmp_path / 'ours'}")[1]):  # bit for bit
        pairs = zip(tree.flatten_with_paths(params)[0], tree.flatten_with_paths(again)[0])
        for (p, x), (_, y) in pairs:
            assert torch.equal(x, y), p


def test_the_engine_gives_generates_greedy_tokens() -> None:
    model = _hf("qwen2_moe", seed=7, num_hidden_layers=3, mlp_only_layers=[0, 2])
    cfg, params = hf.from_hf(model)
    prompts = [[1, 2, 3, 4], [50, 9, 30, 31, 32, 7, 7, 8, 40, 41, 2, 3]]
    want = cf.testing.hf_greedy(model, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(models.qwen2_moe, cfg, params, block_size=4, num_blocks=32)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == want

    def main(mesh: cf.Mesh):  # the dense MLP split over tp as the experts are
        tp = Engine(models.qwen2_moe, cfg, params, mesh=mesh, block_size=4, num_blocks=32)
        return [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)]

    for tokens in launch(main, mesh={"tp": 2}):
        assert tokens == want


@pytest.mark.parametrize(
    ("case", "name", "pattern"),
    [
        pytest.param("ep2_tp2", "qwen3_moe", dict(mlp_only_layers=[1]), marks=pytest.mark.slow),
        ("ep2_pp2", "qwen2_moe", dict(mlp_only_layers=[0, 1])),  # a stage of dense layers only
        pytest.param(
            "dp2_ep2_zero3_offload",
            "qwen2_moe",
            dict(decoder_sparse_step=2),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_expert_parallel_steps_equal_one_device(case: str, name: str, pattern: Any) -> None:
    from test_expert_parallel import CASES

    cfg, params, _ = _fp64(name, num_hidden_layers=4, **pattern)
    assert cfg.dense_layers
    main = functools.partial(_step_main, case, cfg, params)
    _, mesh, _, backend = CASES[case]
    for losses in launch(main, mesh=mesh, backend=backend):
        assert len(losses) == 2


def test_bad_dense_layers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"dense_layers must be a tuple of layer indices in \[0, 4\), got \(4,\)"):  # fmt: skip
        models.qwen2_moe.Config(n_layer=4, n_experts=4, dense_layers=(4,))
    with pytest.raises(ValueError, match=r"dense_layers=\(0,\) names .* with n_experts=0"):
        decoder.Config(dense_layers=(0,))
    with pytest.raises(ValueError, match=r"dense_layers=\(1, 0\) leaves no layer sparse"):
        models.qwen3_moe.Config(n_layer=2, n_experts=4, dense_layers=(1, 0))
    with pytest.raises(ValueError, match=r"dense_layers=\(0,\): not a variation this family has"):
        models.mixtral.Config(n_experts=4, dense_layers=(0,))
    config = transformers.Qwen2MoeConfig(num_hidden_layers=2, decoder_sparse_step=0)
    with pytest.raises(ValueError, match=r"decoder_sparse_step must be an int >= 1, got 0"):
        models.qwen2_moe.family.hf.read_config(config)
    assert models.qwen2_moe.Config(n_layer=3, dense_layers=(2, 0, 2)).dense_layers == (0, 2)
