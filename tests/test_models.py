"""The three models on their own: configs, keyed init, apply vs loss, input checks, tp plans."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
from colfunc import models, nn, tree
from colfunc.core import context

MODULES = [models.gpt, models.llama, models.opt]
IDS = ["gpt", "llama", "opt"]


def _small(module: Any, **kw: Any) -> Any:
    sizes = dict(vocab_size=23, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
    if module is models.llama:
        sizes["n_kv_heads"] = 2
    return module.Config(**(sizes | kw))


def _batch(cfg: Any, B: int, T: int, seed: int, ignore: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < ignore] = -100
    labels[0, -1] = 0  # at least one counted label
    return {"input_ids": ids, "labels": labels}


# --- configs ------------------------------------------------------------------------------------


def test_gpt_tiny_is_the_default_training_model() -> None:
    cfg = models.gpt.Config.tiny()
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.max_seq_len) == (
        256, 4, 4, 128, 128,
    )  # fmt: skip
    assert cfg.d_ff == 4 * 128 and cfg.norm_eps == 1e-5
    assert models.gpt.Config() == cfg
    small = models.gpt.Config.small()
    assert (small.n_layer, small.d_model, small.n_head, small.max_seq_len) == (6, 384, 6, 256)


def test_llama_tiny_groups_its_heads() -> None:
    cfg = models.llama.Config.tiny()
    assert cfg.n_kv_heads is not None and cfg.n_kv_heads < cfg.n_head
    assert not cfg.tie_embeddings
    assert models.llama.Config(n_head=4).n_kv_heads == 4  # None means one kv head per query head


@pytest.mark.parametrize("module", MODULES, ids=IDS)
@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 0), ("n_layer", 0), ("n_head", -1), ("d_model", 0), ("max_seq_len", 0),
     ("d_ff", 0), ("n_layer", 2.0), ("n_layer", True), ("norm_eps", 0.0)],
)  # fmt: skip
def test_config_rejects_bad_sizes(module: Any, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{field}.*{value!r}"):
        module.Config(**{field: value})


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_config_rejects_heads_that_do_not_divide_the_width(module: Any) -> None:
    with pytest.raises(ValueError, match=r"n_head=3.*d_model=128"):
        module.Config(n_head=3, d_model=128)


def test_llama_config_rejects_bad_grouping_and_rope() -> None:
    with pytest.raises(ValueError, match=r"n_kv_heads=3.*n_head=4"):
        models.llama.Config(n_head=4, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"n_kv_heads.*0"):
        models.llama.Config(n_kv_heads=0)
    with pytest.raises(ValueError, match="even head dim"):
        models.llama.Config(n_head=4, d_model=12)
    with pytest.raises(ValueError, match="rope_theta"):
        models.llama.Config(rope_theta=0.0)
    with pytest.raises(ValueError, match="tie_embeddings"):
        models.llama.Config(tie_embeddings=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_config_is_frozen_and_keyword_only(module: Any) -> None:
    cfg = module.Config.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 2
    with pytest.raises(TypeError):
        module.Config(256)


# --- init ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_init_is_keyed_by_seed_and_path(module: Any) -> None:
    cfg = _small(module)
    params = module.init(cfg, seed=3)
    flat = dict(tree.flatten_with_paths(params)[0])
    assert {p: tuple(x.shape) for p, x in flat.items()} == module.param_shapes(cfg)
    std_out = 0.02 / math.sqrt(2 * cfg.n_layer)
    residual_out = {"blocks.attn.wo", "blocks.mlp.w_out", "blocks.mlp.w_down"}
    for path, x in flat.items():
        assert x.dtype == torch.float32, path
        if path.startswith("blocks."):
            assert x.shape[0] == cfg.n_layer, path
        leaf = path.rsplit(".", 1)[-1]
        if path.endswith("weight") and ("ln" in path or "norm" in path):
            assert torch.equal(x, torch.ones_like(x)), path
        elif leaf == "bias" or leaf.startswith("b"):
            assert torch.equal(x, torch.zeros_like(x)), path
        else:  # recomputed from (seed, path) alone
            std = std_out if path in residual_out else 0.02
            assert torch.equal(x, cf.random.normal(3, path, tuple(x.shape), std)), path
    again = dict(tree.flatten_with_paths(module.init(cfg, seed=3))[0])
    other = dict(tree.flatten_with_paths(module.init(cfg, seed=4))[0])
    assert all(torch.equal(again[p], x) for p, x in flat.items())
    assert not torch.equal(other["blocks.attn.wq"], flat["blocks.attn.wq"])


def test_llama_head_is_separate_unless_tied() -> None:
    untied = models.llama.init(_small(models.llama))
    tied = models.llama.init(_small(models.llama, tie_embeddings=True))
    assert untied["head"]["weight"].shape == (32, 23)  # [in, out]
    assert "head" not in tied


# --- apply and loss -----------------------------------------------------------------------------


@pytest.mark.parametrize("module", MODULES, ids=IDS)
@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 16), seed=st.integers(0, 1000))
def test_loss_is_cross_entropy_of_apply(module: Any, B: int, T: int, seed: int) -> None:
    cfg = _small(module)
    params = module.init(cfg, seed=seed)
    batch = _batch(cfg, B, T, seed)
    logits = module.apply(params, batch["input_ids"], cfg)
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == torch.float32
    loss_fn = module.loss(cfg)
    assert isinstance(loss_fn, cf.Layered)
    loss = loss_fn(params, batch)
    ref = F.cross_entropy(
        logits[:, :-1].reshape(-1, cfg.vocab_size),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
    )
    if T == 1:  # nothing to predict inside a one-token sequence: the mean of nothing
        assert loss.isnan() and ref.isnan()
    else:
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_model_is_causal(module: Any) -> None:
    cfg = _small(module)
    params = module.init(cfg, seed=1)
    ids = _batch(cfg, 2, 12, 0)["input_ids"]
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % cfg.vocab_size
    a, b = module.apply(params, ids, cfg), module.apply(params, changed, cfg)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


class _CountScans:
    """A context frame that sees every scan_layers call, as remat, ZeRO-3 and pipeline do."""

    def __init__(self) -> None:
        self.blocks: list[Any] = []

    def scan_layers(self, block: Any, h: Any, blocks: Any, xs: Any, inner: Any) -> Any:
        self.blocks.append(blocks)
        return inner(block, h, blocks, xs)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_apply_and_loss_run_the_blocks_through_scan_layers(module: Any) -> None:
    cfg = _small(module)
    params = module.init(cfg)
    batch = _batch(cfg, 1, 8, 0)
    frame = _CountScans()
    with context(frame):
        module.apply(params, batch["input_ids"], cfg)
        module.loss(cfg)(params, batch)
    assert len(frame.blocks) == 2 and all(b is params["blocks"] for b in frame.blocks)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_gradients_reach_every_parameter(module: Any) -> None:
    cfg = _small(module)
    params = tree.map(lambda x: x.requires_grad_(), module.init(cfg))
    module.loss(cfg)(params, _batch(cfg, 2, 8, 0, ignore=0.0)).backward()
    for path, x in tree.flatten_with_paths(params)[0]:
        assert x.grad is not None and x.grad.abs().sum() > 0, path


def test_bf16_params_give_bf16_logits_close_to_fp32() -> None:
    cfg = _small(models.gpt)
    params = models.gpt.init(cfg, seed=2)
    ids = _batch(cfg, 2, 8, 0)["input_ids"]
    ref = models.gpt.apply(params, ids, cfg)
    low = models.gpt.apply(tree.map(lambda x: x.bfloat16(), params), ids, cfg)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=0.05)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_bad_input_ids_are_refused(module: Any) -> None:
    cfg = _small(module)
    params = module.init(cfg)
    with pytest.raises(ValueError, match=r"torch.int32"):
        module.apply(params, torch.zeros(1, 4, dtype=torch.int32), cfg)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        module.apply(params, torch.zeros(4, dtype=torch.long), cfg)
    with pytest.raises(ValueError, match=r"17.*max_seq_len=16"):
        module.apply(params, torch.zeros(1, 17, dtype=torch.long), cfg)
    with pytest.raises(ValueError, match=r"labels.*\(1, 4\).*\(1, 5\)"):
        module.loss(cfg)(
            params, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 5, dtype=torch.long)}
        )  # fmt: skip


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_token_ids_outside_the_vocabulary_and_missing_fields_are_named(module: Any) -> None:
    """Not a raw IndexError or KeyError: the field, the id and vocab_size; -100 labels pass."""
    cfg = _small(module)  # vocab_size=23
    params = module.init(cfg)
    loss = module.loss(cfg)
    ok = _batch(cfg, 2, 8, seed=0)
    assert torch.isfinite(loss(params, ok))  # (it has -100 labels)
    for field, value in (("input_ids", 23), ("input_ids", -1), ("labels", 23), ("labels", -5)):
        bad = {k: v.clone() for k, v in ok.items()}
        bad[field][1, 3] = value
        with pytest.raises(
            ValueError,
            match=rf"{field} holds the token id {value}, outside the vocabulary.*vocab_size=23",
        ):
            loss(params, bad)
    with pytest.raises(ValueError, match=r"input_ids holds the token id 99"):
        module.apply(params, torch.full((1, 4), 99), cfg)
    for missing in ("input_ids", "labels"):
        with pytest.raises(ValueError, match=rf"the batch has no '{missing}'"):
            loss(params, {k: v for k, v in ok.items() if k != missing})


# --- tensor-parallel plans ----------------------------------------------------------------------


def _shard(params: Any, plan: dict[str, cf.P], rank: int, degree: int) -> Any:
    """This rank's slice of every parameter the plan splits over "tp" (the rest whole)."""

    def local(path: str, x: torch.Tensor) -> torch.Tensor:
        specs = [spec for pattern, spec in plan.items() if tree.match(pattern, path)]
        if not specs:
            return x
        (spec,) = specs
        assert len(spec) == x.dim(), (path, spec)
        return x.chunk(degree, dim=spec.index("tp"))[rank]

    return tree.map_with_path(local, params)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
@pytest.mark.parametrize("degree", [2, 4])
def test_tp_plan_is_megatron(module: Any, degree: int) -> None:
    """Column-parallel in, row-parallel out: the ranks' partial sub-layer outputs sum to the
    whole (with the output bias added once), and the vocabulary split covers the embedding."""
    cfg = _small(module, n_kv_heads=4) if module is models.llama else _small(module)
    params = module.init(cfg, seed=1)
    params = tree.map(lambda x: x + 0.1 * torch.randn_like(x), params)  # nonzero biases
    plan = module.tp_plan
    assert all(
        any(tree.match(pat, p) for p in tree.paths(params)) or pat == "head.weight" for pat in plan
    )
    assert not any(
        tree.match(pat, "blocks.attn.bo") or tree.match(pat, "blocks.mlp.b_out") for pat in plan
    )

    E = cfg.d_model // cfg.n_head
    x_BTD = torch.randn(2, 6, cfg.d_model)
    rope = nn.rope_tables(6, E, 10000.0) if module is models.llama else None
    layer0 = tree.map(lambda t: t[0], params["blocks"])
    ffn = (
        (lambda h, p: nn.swiglu(h, p))
        if module is models.llama
        else (lambda h, p: nn.mlp(h, p, torch.relu))
    )

    def without_out_bias(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in p.items() if k not in ("bo", "b_out")}

    attn_parts, ffn_parts, tokens = [], [], []
    for r in range(degree):
        local = _shard(params, plan, r, degree)
        local0 = tree.map(lambda t: t[0], local["blocks"])
        attn_parts.append(
            nn.self_attention(x_BTD, without_out_bias(local0["attn"]), head_dim=E, rope=rope)
        )
        ffn_parts.append(ffn(x_BTD, without_out_bias(local0["mlp"])))
        tokens.append(local["embed"]["tokens"])
    attn = nn.self_attention(x_BTD, layer0["attn"], head_dim=E, rope=rope)
    bo = layer0["attn"].get("bo", 0)
    torch.testing.assert_close(sum(attn_parts) + bo, attn, rtol=1e-5, atol=1e-5)
    b_out = layer0["mlp"].get("b_out", 0)
    torch.testing.assert_close(
        sum(ffn_parts) + b_out, ffn(x_BTD, layer0["mlp"]), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(torch.cat(tokens), params["embed"]["tokens"])
    assert all(t.shape[0] < cfg.vocab_size for t in tokens)  # split over the vocabulary dim


def test_llama_tp_plan_splits_kv_heads_with_their_query_groups() -> None:
    cfg = _small(models.llama, n_head=4, n_kv_heads=2)
    params = models.llama.init(cfg, seed=2)
    E = cfg.d_model // cfg.n_head
    x_BTD = torch.randn(1, 5, cfg.d_model)
    rope = nn.rope_tables(5, E, cfg.rope_theta)
    layer0 = tree.map(lambda t: t[0], params["blocks"])
    parts = []
    for r in range(2):
        local0 = tree.map(lambda t: t[0], _shard(params, models.llama.tp_plan, r, 2)["blocks"])
        parts.append(nn.self_attention(x_BTD, local0["attn"], head_dim=E, rope=rope))
    torch.testing.assert_close(
        sum(parts), nn.self_attention(x_BTD, layer0["attn"], head_dim=E, rope=rope)
    )
