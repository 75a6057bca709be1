"""The decoder families against ``transformers``: a training step and the engine's generation.

For each family (LLaMA, Mistral, Qwen 2, Qwen 3, Phi-3, OLMo 2, Gemma 2, Gemma 3, SmolLM 3,
GPT-NeoX, GPT-2, OPT) a random ``transformers`` model of about 20M parameters (8 layers, width
256, 4 query heads sharing 2 key/value heads (GPT-2 and OPT: 4 heads, tied), vocabulary 32000, Mistral, Phi-3 and the Gemmas' sliding layers with a window
of 64, shorter than the 128-token batches; Gemma 2 soft-capped, SmolLM 3 with every fourth
layer without rotary positions) is loaded into
colfunc with ``hf.from_hf``; both sides run in the same process, interleaved, in fp32 on this
machine's CPU threads:

- ``train``: one step on the same batch (8 x 128 tokens): ``cf.train_step(family.loss(cfg),
  optim.adamw)`` against the module's forward and backward and ``torch.optim.AdamW(fused=True)``
  (``attn_implementation="sdpa"``, its default). The median over steps of ours/theirs (goal: at
  most 1.0); the first step's losses are checked to agree (1e-4).
- ``generate``: 16 requests (prompts of 16-96 tokens, 32 new tokens each, greedy): the engine
  against ``transformers``' own continuous batching (``generate_batch``); output tokens/s, the
  ratio ours/theirs (goal: at least 1.0). The engine's tokens are checked against ``generate``'s
  for two prompts.

- ``module`` (``--parts module``): for LLaMA and Qwen 2, which colfunc also runs through their own
  ``transformers`` module (``hf.from_hf(m, model_impl="hf")``), that path against the native
  one, interleaved: the training step's median time ratio module/native and the engine's
  generation time ratio module/native on the requests above (goal: at most 1.25 each); the
  first step's losses and the greedy tokens are checked to agree.

    python benchmarks/models.py [--families llama,mistral] [--steps 6] [--threads N]
    python benchmarks/models.py --parts families      # the training steps only
    python benchmarks/models.py --parts module
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers

import colfunc as cf
from colfunc import hf, optim
from colfunc.inference import Engine, SamplingParams

SIZE = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "phi3": ("Phi3Config", {"sliding_window": 64}),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 64}),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 64},
    ),
    "smollm3": ("SmolLM3Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    # (the hand-ported families, their configs' own names for the same size, tied, no dropout)
    "gpt2": (
        "GPT2Config",
        {
            "n_layer": 8,
            "n_embd": 256,
            "n_head": 4,
            "n_positions": 512,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "opt": (
        "OPTConfig",
        {
            "ffn_dim": 1024,
            "word_embed_proj_dim": 256,
            "tie_word_embeddings": True,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
}
OWN_NAMES = {"gpt2"}  # configs that take none of SIZE's names
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(name: str) -> Any:
    config_class, extra = FAMILIES[name]
    if name in OWN_NAMES:
        ids = {k: SIZE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
        c = getattr(transformers, config_class)(**ids, **extra)
    else:
        c = getattr(transformers, config_class)(**{**SIZE, **extra})
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(c)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _train(name: str, m: Any, steps: int) -> tuple[float, float, int]:
    """(median ours/theirs, loss gap at the first step, parameters)."""
    cfg, params = hf.from_hf(m)
    family = cf.models.of_config(cfg)
    step = cf.train_step(family.module.loss(cfg), optim.adamw(**HYPER), donate=True)
    state = step.init(params)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), fused=True, **HYPER)
    g = torch.Generator().manual_seed(1)
    ratios, gap = [], 0.0
    for i in range(steps + 1):
        ids = torch.randint(1, SIZE["vocab_size"], (8, 128), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        opt.step()
        t_theirs = time.perf_counter() - t0
        if i == 0:  # the same weights: the same loss
            gap = abs(float(metrics["loss"]) - loss.item())
        else:  # (the first step of each side warms up)
            ratios.append(t_ours / t_theirs)
    m.eval()
    return statistics.median(ratios), gap, sum(p.numel() for p in m.parameters())


def _generate(m: Any) -> tuple[float, float, float, bool]:
    """(ours tok/s, theirs tok/s, ratio, greedy tokens equal)."""
    cfg, params = hf.from_hf(m)
    family = cf.models.of_config(cfg)
    engine = Engine(family.module, cfg, params, max_num_seqs=16, max_num_batched_tokens=1024)
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(16, 97, (16,), generator=g).tolist()
    prompts = [torch.randint(1, SIZE["vocab_size"], (k,), generator=g).tolist() for k in lens]
    new = 32
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    got = engine.generate(prompts, greedy)
    t_ours = time.perf_counter() - t0
    with torch.inference_mode():
        gc = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
        t0 = time.perf_counter()
        m.generate_batch(inputs=prompts, generation_config=gc, warmup=False)
        t_theirs = time.perf_counter() - t0
        want = cf.testing.hf_greedy(m, prompts[:2], new)
    same = [o.outputs[0].token_ids for o in got[:2]] == want
    total = new * len(prompts)
    return total / t_ours, total / t_theirs, t_theirs / t_ours, same


def _module_vs_native(m: Any, steps: int) -> tuple[float, float, float, bool]:
    """(train module/native, loss gap, generation time module/native, greedy tokens equal)."""
    sides = [hf.from_hf(m), hf.from_hf(m, model_impl="hf")]
    steps_ = []
    for cfg, params in sides:
        module = cf.models.of_config(cfg).module
        step = cf.train_step(module.loss(cfg), optim.adamw(**HYPER), donate=True)
        steps_.append([step, step.init(params)])
    g = torch.Generator().manual_seed(1)
    ratios, gap = [], 0.0
    for i in range(steps + 1):
        ids = torch.randint(1, SIZE["vocab_size"], (8, 128), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        times, losses = [], []
        for pair in steps_:
            t0 = time.perf_counter()
            pair[1], metrics = pair[0](pair[1], batch)
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
        if i == 0:
            gap = abs(losses[0] - losses[1])
        else:
            ratios.append(times[1] / times[0])
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(16, 97, (16,), generator=g).tolist()
    prompts = [torch.randint(1, SIZE["vocab_size"], (k,), generator=g).tolist() for k in lens]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engines = [
        Engine(cf.models.of_config(c).module, c, p, max_num_seqs=16, max_num_batched_tokens=1024)
        for c, p in sides
    ]
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    gen_times: list[list[float]] = [[], []]
    tokens = []
    for _ in range(2):  # interleaved, twice
        for k, engine in enumerate(engines):
            engine.generate(prompts[:2], warm)
            t0 = time.perf_counter()
            out = engine.generate(prompts, greedy)
            gen_times[k].append(time.perf_counter() - t0)
            tokens.append([o.outputs[0].token_ids for o in out])
    gen = min(gen_times[1]) / min(gen_times[0])
    return statistics.median(ratios), gap, gen, tokens[0] == tokens[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per family")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--parts",
        default="families,generate",
        help="families[,generate] (train steps and "
        "generation), module, or both; families alone: the training steps only",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if "module" in args.parts:
        print("| family | train module/native | first-step loss gap | generate module/native | "
              "greedy equal |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | --- |")
        for name in ("llama", "qwen2"):
            ratio, gap, gen, same = _module_vs_native(_model(name), args.steps)
            print(f"| {name} | {ratio:.3f} | {gap:.1e} | {gen:.3f} | {same} |")
        if "families" not in args.parts:
            return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ", end="")
    print(f"{torch.get_num_threads()} threads; fp32; batch 8 x 128 tokens")
    print("| family | params | train ours/theirs | first-step loss gap | ours tok/s | "
          "generate_batch tok/s | ours/theirs | greedy equal |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.families.split(","):
        # transformers' continuous batching compiles its cache update once per process; a family
        # whose attention calls it differently (GPT-NeoX's) needs it compiled afresh
        torch._dynamo.reset()
        m = _model(name)
        ratio, gap, n = _train(name, m, args.steps)
        if "generate" not in args.parts:  # (--parts families: the training steps alone)
            print(f"| {name} | {n / 1e6:.1f}M | {ratio:.3f} | {gap:.1e} | - | - | - | - |")
            continue
        ours, theirs, speed, same = _generate(m)
        print(
            f"| {name} | {n / 1e6:.1f}M | {ratio:.3f} | {gap:.1e} | {ours:.1f} | {theirs:.1f} | "
            f"{speed:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
