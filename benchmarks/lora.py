"""LoRA fine-tuning: ``cf.lora`` against peft, its memory against full fine-tuning, and the
widest base that trains under a fixed device budget.

- ``step``: a random ``transformers`` LLaMA of about 20M parameters (8 layers, width 256, 4
  query heads sharing 2 key/value heads, vocabulary 32000, fp32), rank-16 adapters (alpha 32) on
  every attention and MLP weight. Ours: ``cf.lora(cf.train_step(llama.loss(cfg),
  optim.adamw))``; theirs: ``peft.get_peft_model`` and ``torch.optim.AdamW(fused=True)`` over its
  trainable parameters, both on the same batch (8 x 128 tokens), interleaved step by step in one
  process. The median of ours/theirs over the timed steps (goal: at most 1.0); the first step's
  losses are checked to agree.
- ``memory``: the same model, LoRA against full fine-tuning with colfunc: the state's bytes
  (``cf.memory.report``: parameters, optimizer) and the peak bytes a step allocates
  (``cf.memory.track``: activations and gradients).
- ``largest``: the smallest device budget of a step of an 8-layer LLaMA (MLP 8/3 wide, batch
  2 x 512) under ``cf.offload("auto")`` with ``cf.remat``, by ``cf.memory.predict`` (its layers
  streamed one at a time), for widths 1024 to 8192, full fine-tuning against LoRA and QLoRA
  (``base_dtype="nf4"``); and the widest that fits a device budget of 2 GiB.

    python benchmarks/lora.py [--parts step,memory,largest] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import peft
import torch
import transformers

import colfunc as cf
from colfunc import hf, models, optim, tree

SIZE = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False,
)  # fmt: skip
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
RANK, ALPHA = 16, 32.0
TARGETS = ["blocks.attn.w*", "blocks.mlp.w*"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZE))


def _batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, SIZE["vocab_size"], (8, 128), generator=g)
    return {"input_ids": ids, "labels": ids}


def step_part(steps: int) -> None:
    m = _model()
    cfg, params = hf.from_hf(m)
    step = cf.lora(
        cf.train_step(models.llama.loss(cfg), optim.adamw(**HYPER), donate=True),
        RANK, ALPHA, TARGETS,
    )  # fmt: skip
    state = step.init(params)
    pm = peft.get_peft_model(
        m, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS)
    )
    peft.set_peft_model_state_dict(
        pm, cf.adapters.to_peft(cfg, state.params, cf.adapters.config_of(step))
    )
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], fused=True, **HYPER)
    g = torch.Generator().manual_seed(1)
    ratios, gap = [], 0.0
    for i in range(steps + 1):
        batch = _batch(g)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pm(**batch).loss
        loss.backward()
        opt.step()
        t_theirs = time.perf_counter() - t0
        if i == 0:
            gap = abs(float(metrics["loss"]) - loss.item())
        else:
            ratios.append(t_ours / t_theirs)
    trained = sum(x.numel() for p, x in tree.flatten_with_paths(state.params)[0] if ".lora." in p)
    print(
        f"step    llama {sum(x.numel() for x in tree.leaves(params)) / 1e6:.1f}M, rank {RANK} "
        f"({trained / 1e6:.2f}M trained): ours/peft median {statistics.median(ratios):.3f} "
        f"(runs {', '.join(f'{r:.3f}' for r in ratios)}); first-step loss gap {gap:.1e}"
    )


def memory_part() -> None:
    cfg, params = hf.from_hf(_model())
    g = torch.Generator().manual_seed(1)
    batch = _batch(g)
    plain = cf.train_step(models.llama.loss(cfg), optim.adamw(**HYPER), donate=True)
    rows = []
    for name, step in (("full", plain), ("lora", cf.lora(plain, RANK, ALPHA, TARGETS))):
        state = step.init(params)
        state, _ = step(state, batch)  # (the first step makes the optimizer's moments)
        with cf.memory.track(state) as t:
            state, _ = step(state, batch)
        r = cf.memory.report(state)
        rows.append((name, r.params, r.optimizer, t.peak))
    for name, p, o, peak in rows:
        print(
            f"memory  {name:4s}: params {p / 2**20:7.1f} MiB, optimizer {o / 2**20:7.1f} MiB, "
            f"step peak (activations, gradients) {peak / 2**20:7.1f} MiB"
        )
    full, lora = rows
    print(
        f"memory  lora/full: optimizer {lora[2] / full[2]:.3f}, step peak {lora[3] / full[3]:.3f}, "
        f"state + peak {(lora[1] + lora[2] + lora[3]) / (full[1] + full[2] + full[3]):.3f}"
    )


def _cfg(width: int) -> Any:
    ff = (8 * width // 3 + 127) // 128 * 128
    return models.llama.Config(
        vocab_size=32000, n_layer=8, n_head=width // 64, n_kv_heads=width // 64,
        d_model=width, d_ff=ff, max_seq_len=1024,
    )  # fmt: skip


def _smallest(name: str, width: int, batch: tuple[int, int]) -> int:
    """The least device budget (bytes) the step runs in, its layers streamed one at a time."""
    cfg = _cfg(width)
    plain = cf.train_step(models.llama.loss(cfg), optim.adamw(**HYPER))
    if name != "full":
        plain = cf.lora(plain, RANK, ALPHA, TARGETS, base_dtype=name.partition("-")[2] or None)
    step = cf.remat(cf.offload(plain, "auto", "1GiB"), "full")
    return cf.memory.predict(cfg, step, batch, 1).smallest_budget  # (1 B: the floor only)


def largest_part(budget: int = 2 * 2**30, batch: tuple[int, int] = (2, 512)) -> None:
    widths = (1024, 2048, 4096, 8192)
    for name in ("full", "lora", "lora-nf4"):
        floors = {w: _smallest(name, w, batch) for w in widths}
        fits = [w for w in widths if floors[w] <= budget]
        n = sum(torch.Size(s).numel() for s in models.llama.param_shapes(_cfg(max(fits))).values())
        print(
            f"largest {name:8s}: smallest device budget by width "
            + ", ".join(f"{w}: {floors[w] / 2**20:.0f} MiB" for w in widths)
            + f"; widest within {budget / 2**30:.0f} GiB: {max(fits)} ({n / 1e9:.2f}B parameters)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="step,memory,largest")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    if "step" in parts:
        step_part(args.steps)
    if "memory" in parts:
        memory_part()
    if "largest" in parts:
        largest_part()


if __name__ == "__main__":
    main()
