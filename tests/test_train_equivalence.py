"""Training equivalence against an outside reference: Hugging Face GPT-2 with torch.optim.AdamW.

Three steps of ``cf.train_step(gpt.loss(cfg), optim.adamw(...))`` from the weights of a
``GPT2LMHeadModel`` must give that model's parameters after three steps of the usual PyTorch loop
(``loss.backward()``, ``AdamW.step()``) on the same batches.

Adam divides each update by the gradient's own running magnitude, so for the entries whose true
gradient is zero or nearly so (the attention key bias has an exactly zero gradient: softmax is
invariant to adding one number to a whole row of scores) fp32 rounding noise in the gradient
becomes an update of size up to ``lr``. Any two correct fp32 implementations differ there by
about ``lr``; so the fp32 check uses ``lr = 1e-4`` (3 steps then differ by at most ~2e-6), and the
fp64 check, where the noise is gone, uses a large ``lr`` and a tight bound.
"""

from __future__ import annotations

import pytest
import torch

import colfunc as cf
from colfunc import hf, optim

transformers = pytest.importorskip("transformers")


def _hf_gpt2(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


def _batches(n: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (3, 17), generator=g)
        labels = ids.clone()
        labels[0, 5:9] = -100  # ignored positions take part in neither loss nor gradient
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize(
    ("dtype", "lr", "atol"), [(torch.float32, 1e-4, 1e-5), (torch.float64, 3e-3, 1e-7)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_three_adamw_steps_match_hugging_face_gpt2(
    seed: int, dtype: torch.dtype, lr: float, atol: float
) -> None:
    model = _hf_gpt2(seed, dtype)
    cfg, params = hf.from_hf(model)
    batches = _batches(3, cfg.vocab_size, seed)
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    step = cf.train_step(cf.models.gpt.loss(cfg), optim.adamw(**kwargs))  # type: ignore[arg-type]
    state = step.init(params)
    ours = []
    for batch in batches:
        state, metrics = step(state, batch)
        ours.append(float(metrics["loss"]))

    torch_opt = torch.optim.AdamW(model.parameters(), **kwargs)  # type: ignore[arg-type]
    theirs = []
    for batch in batches:
        torch_opt.zero_grad()
        logits = model(input_ids=batch["input_ids"]).logits
        # the shifted cross-entropy in the logits' own dtype (transformers' loss narrows fp64
        # logits to fp32, which would put fp32 rounding into the fp64 comparison)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )
        loss.backward()
        torch_opt.step()
        theirs.append(float(loss.detach()))

    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    got = hf.to_hf(cfg, state.params)
    assert set(got) <= set(expected)
    for key, value in got.items():
        diff = (value - expected[key]).abs().max().item()
        assert diff <= atol, f"{key}: max abs diff {diff:.3g} after 3 steps ({dtype})"
