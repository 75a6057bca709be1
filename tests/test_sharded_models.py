"""GPT and LLaMA on tensor-parallel ShardedTensor parameters equal the single-device model.

Parameters are sharded by each model's ``tp_plan`` on a ``tp`` axis; the loss and every
gradient (through ``loss.backward()`` and through ``torch.func.grad``) must match the plain model
within 1e-5, in strict mode (an op without a rule would raise), and the gradients must come back
with the parameters' placements.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import colfunc.sharding as cs
from colfunc import tree
from colfunc.core import P
from colfunc.models import gpt, llama
from colfunc.sharding import Mesh, Replicate, Shard, distribute, launch

pytestmark = pytest.mark.timeout(180)

CONFIGS = {
    "gpt": (gpt, gpt.Config(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_seq_len=16)),
    "llama_gqa": (
        llama,
        llama.Config(vocab_size=96, n_layer=2, n_head=4, n_kv_heads=2, d_model=32, max_seq_len=16),
    ),
    "llama_mha": (
        llama,
        llama.Config(vocab_size=96, n_layer=2, n_head=4, n_kv_heads=4, d_model=32, max_seq_len=16),
    ),
}


def _plan(module: Any, path: str) -> P:
    return next(
        (spec for pattern, spec in module.tp_plan.items() if tree.match(pattern, path)), P()
    )


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return {"input_ids": ids, "labels": labels}


def _expected_grad_placements(module: Any, path: str, param: Any) -> tuple[Any, ...]:
    # embedding_dense_backward sees the gradient and the ids, not the table: with replicated
    # activations it returns the whole table's gradient, replicated (one local slice away from
    # the table's split). GPT ties the table to the head, whose gradient is split, so its sum is.
    if path == "embed.tokens" and module is llama:
        return (Replicate(),)
    return param.placements


@pytest.mark.parametrize(
    ("name", "tp"), [("gpt", 2), ("gpt", 4), ("llama_gqa", 2), ("llama_mha", 4)]
)
def test_tensor_parallel_model_equals_single_device(name: str, tp: int) -> None:
    module, cfg = CONFIGS[name]
    params, batch, loss_fn = module.init(cfg, seed=0), _batch(cfg.vocab_size), module.loss(cfg)
    leaves = tree.map(lambda x: x.clone().requires_grad_(), params)
    want = loss_fn(leaves, batch)
    want.backward()
    want_grads = dict(tree.flatten_with_paths(tree.map(lambda x: x.grad, leaves))[0])

    def fn(mesh: Mesh) -> Any:
        sharded = tree.map_with_path(
            lambda p, x: distribute(x, mesh, _plan(module, p)).requires_grad_(), params
        )
        with cs.strict():
            loss = loss_fn(sharded, batch)
            loss.backward()
        grads = tree.map(lambda x: x.grad, sharded)
        return (
            loss.full_tensor(),
            {
                p: (g.placements, _expected_grad_placements(module, p, x), g.full_tensor())
                for (p, g), x in zip(tree.flatten_with_paths(grads)[0], tree.leaves(sharded))
            },
            {p: x.placements for p, x in tree.flatten_with_paths(sharded)[0]},
        )

    results = launch(fn, mesh={"tp": tp})
    for loss, grads, placed in results:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        assert (
            sum(any(isinstance(p, Shard) for p in pl) for pl in placed.values()) >= 5
        )  # the plan splits
        for path, (got_pl, want_pl, g) in grads.items():
            assert got_pl == want_pl, path
            torch.testing.assert_close(g, want_grads[path], rtol=1e-5, atol=1e-6, msg=path)


def test_torch_func_grad_of_a_sharded_model() -> None:
    module, cfg = CONFIGS["llama_gqa"]
    params, batch, loss_fn = module.init(cfg, seed=1), _batch(cfg.vocab_size), module.loss(cfg)
    want = torch.func.grad(loss_fn)(params, batch)

    def fn(mesh: Mesh) -> Any:
        sharded = tree.map_with_path(lambda p, x: distribute(x, mesh, _plan(module, p)), params)
        with cs.strict():
            grads = torch.func.grad(loss_fn)(sharded, batch)
        return tree.map(lambda g: g.full_tensor(), grads), cs.fallback_counts()

    cs.reset_fallback_counts()
    for grads, counts in launch(fn, mesh={"tp": 2}):
        assert counts == {}
        for (path, g), w in zip(tree.flatten_with_paths(grads)[0], tree.leaves(want)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=path)


def test_llama_with_fewer_key_value_heads_than_ranks_stays_exact() -> None:
    """2 key/value heads over 4 ranks cannot split by heads: attention runs replicated (gathered
    projections), still without fallbacks and with the single-device result."""
    module, cfg = CONFIGS["llama_gqa"]
    params, batch, loss_fn = module.init(cfg, seed=2), _batch(cfg.vocab_size), module.loss(cfg)
    want = loss_fn(params, batch)

    def fn(mesh: Mesh) -> torch.Tensor:
        sharded = tree.map_with_path(lambda p, x: distribute(x, mesh, _plan(module, p)), params)
        with cs.strict():
            return loss_fn(sharded, batch).full_tensor()

    for loss in launch(fn, mesh={"tp": 4}):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
