"""A domain LLM in the manner of Colossal-LLaMA, end to end on local data, on the CPU.

The "pre-trained" model is a tiny LLaMA trained briefly on Python source code with a BPE
tokenizer of that code; the new domain is the standard library's docstrings. The stages
(colfunc.recipes.domain_llm):

1. extend the tokenizer with a BPE vocabulary trained on the docstrings;
2. expand the model's vocabulary (new rows: the mean of their old sub-token rows);
3. continue pre-training on a bucketed mix of the code and the docstrings;
4. fine-tune on chat examples made from the docstrings (prompts masked, examples packed);
5. evaluate: perplexity per corpus before and after, and a multiple-choice test scored by the
   first token of each choice.

    python examples/colossal_llama/recipe.py --out runs/domain-llm [--steps 300] [--sft-steps 100]
        [--sft-lora RANK]  # the chat fine-tuning with LoRA adapters (saved in peft's format)

The figures go to OUT/figures.json (and the tokenizer and model to OUT/).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import time
from pathlib import Path

import torch

import colfunc as cf
from colfunc import checkpoint, models, optim, testing
from colfunc.recipes import domain_llm as rec

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CODE = ("json", "email", "csv", "textwrap", "string", "calendar")
DOCS = ("collections", "functools", "itertools", "pathlib", "argparse", "logging", "shutil", "os")


def _code() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE)


def _docstrings() -> list[tuple[str, str]]:
    import importlib

    out = []
    for m in DOCS:
        for name, obj in inspect.getmembers(importlib.import_module(m)):
            doc = inspect.getdoc(obj) if not name.startswith("_") else None
            if doc and len(doc) > 40:
                out.append((f"{m}.{name}", doc))
    return out


def _train(cfg, params, batches, steps: int, lr: float, lora: int = 0):  # type: ignore[no-untyped-def]
    step = cf.train_step(models.llama.loss(cfg), optim.adamw(lr, weight_decay=0.0), donate=True)
    if lora:  # rank-`lora` adapters of every attention and MLP weight, the base frozen
        step = cf.lora(step, rank=lora, alpha=2.0 * lora)
    state = step.init(params)
    losses = []
    it = iter(batches)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(batches)
            batch = next(it)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.params, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300, help="pre-training steps per stage")
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument(
        "--sft-lora", type=int, default=0, help="fine-tune on chat with LoRA adapters of this rank"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=False)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    seq, bs = 64, 8

    # the starting point: a code tokenizer and a model pre-trained on code
    base = testing.save_bpe_tokenizer(out / "base_tokenizer", 512, "</s>", TEMPLATE)
    code = torch.tensor(base.encode(_code(), add_special_tokens=False))
    cfg = models.llama.Config(
        vocab_size=len(base), n_layer=2, n_head=4, n_kv_heads=2, d_model=64, d_ff=160,
        max_seq_len=seq, tie_embeddings=False,
    )  # fmt: skip
    params = models.llama.init(cfg, seed=args.seed)
    windows = rec.BucketedMix({"code": code}, buckets=1, seq_len=seq, batch_size=bs, seed=args.seed)
    params, pre = _train(cfg, params, list(windows), args.steps, 3e-3)

    # 1-2: the new domain's tokens, and room for them in the model
    docs = _docstrings()
    tok, added = rec.extend_tokenizer(base, [d for _, d in docs], vocab_size=1024)
    tok.save_pretrained(out / "tokenizer")
    cfg, params = rec.expand_vocabulary(models.llama, cfg, params, base, tok)
    rng = random.Random(args.seed)
    rng.shuffle(docs)
    held, train_docs = docs[:40], docs[40:]
    corpora = {
        "code": torch.tensor(tok.encode(_code(), add_special_tokens=False)),
        "docs": torch.tensor(
            tok.encode("\n\n".join(d for _, d in train_docs), add_special_tokens=False)
        ),
    }
    held_out = {
        "code": corpora["code"][-8 * seq :],
        "docs": torch.tensor(tok.encode("\n\n".join(d for _, d in held), add_special_tokens=False)),
    }
    before = {c: rec.perplexity(models.llama, cfg, params, t, seq) for c, t in held_out.items()}

    # 3: continual pre-training on the bucketed mix
    mix = rec.BucketedMix(corpora, buckets=4, seq_len=seq, batch_size=bs, seed=args.seed)
    params, cpt = _train(cfg, params, list(mix), args.steps, 2e-3)

    # 4: chat fine-tuning: "what does NAME do?" -> the docstring's first sentence
    def talk(name: str, doc: str) -> list[dict[str, str]]:
        first = doc.split(".")[0][:120] + "."
        return [
            {"role": "user", "content": f"What does {name} do?"},
            {"role": "assistant", "content": first},
        ]

    examples = [rec.chat_example(tok, talk(n, d)) for n, d in train_docs]
    packed = rec.pack(examples, seq_len=seq, pad_id=tok.eos_token_id)
    sft_batches = [
        {k: v[i : i + bs] for k, v in packed.items()}
        for i in range(0, len(packed["input_ids"]), bs)
    ]
    if args.sft_lora:  # LoRA: the adapters saved as peft reads them, then merged in
        adapted, sft = _train(cfg, params, sft_batches, args.sft_steps, 1e-3, args.sft_lora)
        config = cf.adapters.LoraConfig(rank=args.sft_lora, alpha=2.0 * args.sft_lora)
        cf.adapters.save_adapter(out / "sft_adapter", cfg, adapted, config)
        params = cf.adapters.merge(adapted, config)
    else:
        params, sft = _train(cfg, params, sft_batches, args.sft_steps, 1e-3)

    # 5: evaluation
    after = {c: rec.perplexity(models.llama, cfg, params, t, seq) for c, t in held_out.items()}
    items = []
    for _name, doc in held:
        words = doc.split()
        if len(words) < 6:
            continue
        others = [d.split()[3] for _, d in rng.sample(docs, 8) if len(d.split()) > 3]
        choices = [" " + words[5]]
        for w in others:
            firsts = {tok.encode(c, add_special_tokens=False)[0] for c in choices}
            if tok.encode(" " + w, add_special_tokens=False)[0] not in firsts and len(choices) < 4:
                choices.append(" " + w)
        if len(choices) == 4:
            k = rng.randrange(4)
            choices[0], choices[k] = choices[k], choices[0]
            items.append({"prompt": " ".join(words[:5]), "choices": choices, "answer": k})
    score = rec.multiple_choice(models.llama, cfg, params, tok, items)
    checkpoint.save(out / "model", {"params": params}, {"llama": repr(cfg)})
    figures = {
        "added_tokens": len(added),
        "vocab_size": cfg.vocab_size,
        "perplexity_before": before,
        "perplexity_after": after,
        "multiple_choice": score,
        "multiple_choice_items": len(items),
        "losses": {"pretrain": pre[-1:], "continual": cpt[-1:], "sft": sft[-1:]},
        "sft_lora_rank": args.sft_lora,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
