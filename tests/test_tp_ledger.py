"""Tensor parallelism communicates as Megatron-LM does, byte for byte.

One ``forward_backward`` of a tiny GPT and LLaMA under ``cf.shard(step, mesh, tp_plan)`` on the
threads backend, with and without sequence parallelism, records in the ledger exactly the bytes
per (op, axis) of the closed-form count below, in strict mode (no op falls back), and gives the
single-device loss and gradients.

The count (legend: B batch, T sequence, S = T - 1 positions the head sees, since the models drop
the last one before it, N = B * S rows of the loss, D width, L layers, n = tp; fp32, 4 bytes):

Without sequence parallelism (Shoeybi et al. 2019, section 3), per layer, all of [B, T, D]:
  forward   one all_reduce after the attention output projection and one after the MLP output
            projection (row parallel: their outputs are Partial sums over the ranks' heads or
            MLP columns);
  backward  one all_reduce of the input gradient of the column-parallel q/k/v group (q, k and v
            add up first, so it is one, not three) and one of the MLP input's.
  Weights never move and their gradients are computed on their own shards: no all_gather.
  Vocabulary-parallel embedding: one all_reduce of [B, T, D] in the forward (each rank looks up
  the ids it holds), none in the backward. The vocabulary-parallel head is column parallel: one
  all_reduce of its input gradient, [B, S, D]. Vocabulary-parallel cross-entropy: three
  all_reduces of [N, 1] (the row max and the sum of exponentials in the forward, the row sum of
  the log-softmax backward; Megatron's third, the target's logit, here rides into the loss as a
  Partial sum), and one of the scalar loss.

With sequence parallelism (Korthikanti et al. 2022, section 4.2.2), per layer, all of
[B, T, D] on the wire: each all_reduce becomes an all_gather before a column-parallel layer and a
reduce_scatter after a row-parallel one, 2 + 2 in the forward and their mirror 2 + 2 in the
backward. The head gathers the sequence before it and reduce-scatters its input gradient (its
input, [B, S, D], padded to the chunks of T: [B, T, D] on the wire). The embedding follows
Megatron-core's LanguageModelEmbedding: with learned positions (GPT) the token embedding is
all-reduced, the positions added and the sum scattered (a local slice), whose transpose is an
all_gather in the backward; without them (LLaMA, rotary) one reduce_scatter, transposed to an
all_gather. Norm parameters see their rank's part of the sequence only, so their gradients are
all-reduced, [D] each (GPT: weight and bias, LLaMA: weight; 2L + 1 norms). Megatron all-reduces
the row-parallel biases' gradients too; here those biases are added before the reduce_scatter
(on one rank, as part of the Partial sum), so their gradients come out whole, without one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colfunc as cf
import colfunc.sharding as cs
from colfunc import models, optim

pytestmark = pytest.mark.timeout(300)

F32 = 4


def megatron_bytes(
    model: str, *, B: int, T: int, D: int, L: int, n: int, sequence_parallel: bool
) -> dict[tuple[str, str], int]:
    """Bytes one rank sends per (op, axis) in one forward and backward; see the module docs."""
    S, N = T - 1, B * (T - 1)

    # ring accounting per collective, as the ledger counts it (floored per call)
    def all_reduce(nbytes: int) -> int:
        return 2 * (n - 1) * nbytes // n

    def all_gather(nbytes: int) -> int:  # also reduce_scatter: (n - 1) / n of the whole
        return (n - 1) * nbytes // n

    act, head, row = B * T * D * F32, B * S * D * F32, N * F32
    loss = 3 * all_reduce(row) + all_reduce(F32)  # cross-entropy rows, then the scalar loss
    if not sequence_parallel:
        # embedding 1, forward 2 per layer, backward 2 per layer; the head's input gradient
        return {("all_reduce", "tp"): (1 + 4 * L) * all_reduce(act) + all_reduce(head) + loss}
    rotary = model == "llama"  # no position embedding: the embedding reduce-scatters
    norms = (2 * L + 1) * (1 if rotary else 2)
    return {
        # per layer 2 forward + 2 backward; the head; the embedding's backward
        ("all_gather", "tp"): (4 * L + 2) * all_gather(act),
        # per layer 2 forward + 2 backward; the head's input gradient; LLaMA's embedding
        ("reduce_scatter", "tp"): (4 * L + 1 + rotary) * all_gather(act),
        # GPT's embedding; the norms' parameter gradients; the loss
        ("all_reduce", "tp"): (0 if rotary else all_reduce(act))
        + norms * all_reduce(D * F32)
        + loss,
    }


def _config(model: str, n_layer: int, tp: int) -> Any:
    common = dict(vocab_size=64, n_layer=n_layer, n_head=4, d_model=32, max_seq_len=16)
    if model == "gpt":
        return models.gpt.Config(**common)
    # as many key/value heads as ranks: grouped-query attention on tp=2, one group per head on 4
    return models.llama.Config(**common, n_kv_heads=tp)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "llama"])
@settings(max_examples=3, deadline=None)
@given(
    n_layer=st.integers(1, 2),
    # a batch of one keeps a sequence split through [1, T, D] -> [T, D], so q, k and v each
    # gather their own view of it (three all_gathers where Megatron's fused q/k/v has one)
    batch=st.integers(2, 3),
    seq=st.sampled_from([8, 16]),
)
def test_ledger_is_megatron(
    model: str, tp: int, sequence_parallel: bool, n_layer: int, batch: int, seq: int
) -> None:
    module = getattr(models, model)
    cfg = _config(model, n_layer, tp)
    params = module.init(cfg, seed=n_layer)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    step = cf.train_step(module.loss(cfg), optim.sgd(1e-2))
    want_loss, want_grads = step.forward_backward(params, data, {})

    def fn(mesh: cs.Mesh) -> Any:
        s = cf.shard(step, mesh, module.tp_plan, sequence_parallel=sequence_parallel)
        state = s.init(params)
        with cs.recording(mesh) as led, cs.strict():
            loss, grads = s.forward_backward(state.params, data, {})
        sent = led.as_dict()
        return sent, cs.fallback_counts(mesh), loss, cf.tree.map(lambda g: g.full_tensor(), grads)

    cs.reset_fallback_counts()
    want = megatron_bytes(
        model, B=batch, T=seq, D=cfg.d_model, L=n_layer, n=tp, sequence_parallel=sequence_parallel
    )
    for sent, fallbacks, loss, grads in cf.launch(fn, mesh={"tp": tp}):
        assert sent == want
        assert fallbacks == {}
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        cf.testing.assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


def test_the_count_is_megatrons_on_a_known_case() -> None:
    """The formula itself, on one case worked by hand: GPT, one layer, B = 4, T = 128, D = 32,
    tp = 2 (the activation [B, T, D] is 64 KiB, of which an all_reduce sends all and an
    all_gather half)."""
    act = 4 * 128 * 32 * F32
    head = 4 * 127 * 32 * F32
    loss = 3 * 508 * F32 + F32
    assert megatron_bytes("gpt", B=4, T=128, D=32, L=1, n=2, sequence_parallel=False) == {
        ("all_reduce", "tp"): 5 * act + head + loss
    }
    assert megatron_bytes("gpt", B=4, T=128, D=32, L=1, n=2, sequence_parallel=True) == {
        ("all_gather", "tp"): 6 * act // 2,
        ("reduce_scatter", "tp"): 5 * act // 2,
        ("all_reduce", "tp"): act + 6 * 32 * F32 + loss,
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_dropping_the_last_position_keeps_the_sequence_split(tp: int) -> None:
    """``x[:, :-1]`` of activations split on the sequence in equal chunks stays split (the last
    rank drops its last position), and so does its gradient: no communication either way, where
    the head of a sequence-parallel model would otherwise gather the whole sequence."""
    g = torch.Generator().manual_seed(3)
    x, cot = torch.randn(2, 8, 4, generator=g), torch.randn(2, 7, 4, generator=g)
    leaf = x.clone().requires_grad_()
    (leaf[:, :-1] * cot).sum().backward()

    def fn(mesh: cs.Mesh) -> Any:
        xs = cs.distribute(x, mesh, [cs.Shard(1)]).requires_grad_()
        with cs.recording(mesh) as led, cs.strict():
            y = xs[:, :-1]
            (y * cs.distribute(cot, mesh, [cs.Shard(1)])).sum().backward()
        sent = led.as_dict()
        return sent, y.placements, xs.grad.placements, y.full_tensor(), xs.grad.full_tensor()

    for sent, y_pl, grad_pl, y, grad in cf.launch(fn, mesh={"tp": tp}):
        assert sent == {} and y_pl == grad_pl == (cs.Shard(1),)
        assert torch.equal(y, x[:, :-1]) and torch.equal(grad, leaf.grad)
