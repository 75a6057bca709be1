"""Inference throughput: the colfunc engine against ``transformers``, same model and weights.

A fixed synthetic workload (default 64 requests, prompts of 16-256 random tokens) on a random
GPT-2 of about 23M parameters (6 layers, width 512, vocabulary 8192), greedy, in fp32, on this
machine's CPU threads. Two comparisons, each side run in the same process, interleaved
(``--repeats`` times; the median ratio is the figure):

- ``static``: outputs of 16-128 tokens per request; ``transformers`` ``generate`` on static
  batches of 16 (left-padded prompts, each batch run to its longest output, as a static batch
  must). Goal: at least 3x.
- ``continuous``: every output 64 tokens (``generate_batch`` takes one ``max_new_tokens`` for all);
  ``transformers``' own continuous batching, ``generate_batch`` (paged attention, ``sdpa_paged``).
  Goal: at least 1x.

- ``speculative``: the engine with speculative decoding against itself without, on a repetitive
  workload: 8 prompts, each a phrase of 24 random tokens said four times, 128 greedy output
  tokens each, one request at a time and all 8 together; the tokens are checked equal, and the
  median speed-up and the acceptance rate reported. Two kinds of drafts: prompt lookup
  (``Ngram(5)``; goal: at least 1.5x) and a draft model (``DraftModel``, 4 drafts a step): the
  model's own first layer with its embeddings and head (random weights have no smaller
  model that agrees with them; a trained pair such as a 0.5B and a 7B model of one family is
  what the option is for).

Output tokens/s counts the tokens each request asked for. The engine's greedy tokens are checked
against ``generate``'s for the first batch, so the two compute the same thing.

    python benchmarks/inference.py [--requests 64] [--threads N] [--repeats 3]
                                   [--parts static,continuous,speculative]
    colfunc bench inference
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
import transformers

import colfunc as cf
from colfunc import hf
from colfunc.inference import DraftModel, Engine, SamplingParams
from colfunc.inference.speculative import Ngram


def _model(n_layer: int, d_model: int, vocab: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    c = transformers.GPT2Config(
        n_layer=n_layer,
        n_head=8,
        n_embd=d_model,
        vocab_size=vocab,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    m = transformers.GPT2LMHeadModel(c).eval()
    m.generation_config.eos_token_id = None  # every request runs to its length
    m.generation_config.pad_token_id = 0
    return m


def _workload(n: int, vocab: int, outputs: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 257, (n,), generator=g).tolist()
    outs = torch.randint(outputs[0], outputs[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lens], outs


def _ours(engine: Engine, prompts: list[list[int]], outs: list[int]) -> tuple[float, list]:
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in outs]
    t0 = time.perf_counter()
    got = engine.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in got]


@torch.inference_mode()
def _static(m: transformers.GPT2LMHeadModel, prompts: list[list[int]], outs: list[int]) -> tuple:
    t0, tokens = time.perf_counter(), []
    for i in range(0, len(prompts), 16):
        batch, want = prompts[i : i + 16], outs[i : i + 16]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        got = m.generate(ids, attention_mask=mask, max_new_tokens=max(want), do_sample=False)
        tokens += [row[width : width + k].tolist() for row, k in zip(got, want)]
    return time.perf_counter() - t0, tokens


@torch.inference_mode()
def _continuous(m: transformers.GPT2LMHeadModel, prompts: list[list[int]], new: int) -> float:
    cfg = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
    t0 = time.perf_counter()
    m.generate_batch(inputs=prompts, generation_config=cfg, warmup=False)
    return time.perf_counter() - t0


def _truncated(cfg: Any, params: Any, layers: int) -> DraftModel:
    """The model's first ``layers`` blocks with its embeddings, final norm and head: a draft
    that shares the target's vocabulary and weights (a self-speculative draft), 4 tokens a step."""
    blocks = torch.utils._pytree.tree_map(lambda t: t[:layers], params["blocks"])
    return DraftModel(cf.models.gpt, dataclasses.replace(cfg, n_layer=layers),
                      {**params, "blocks": blocks}, 4)  # fmt: skip


def _speculative(cfg: Any, params: Any, vocab: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, vocab, (24,), generator=g).tolist() * 4 for _ in range(8)]
    kw = dict(max_num_seqs=8, max_num_batched_tokens=2048)
    plain = Engine(cf.models.gpt, cfg, params, **kw)
    kinds = {"prompt lookup, Ngram(5)": Ngram(5), "draft model, 1 of the layers": None}
    kinds["draft model, 1 of the layers"] = _truncated(cfg, params, 1)
    outs = [128] * len(prompts)
    _ours(plain, prompts[:1], [4])
    for kind, how in kinds.items():
        spec = Engine(cf.models.gpt, cfg, params, speculative=how, **kw)
        _ours(spec, prompts[:1], [4])
        for label, batches in (
            ("one at a time", [[p] for p in prompts]),
            ("8 together", [prompts]),
        ):
            ratios, same = [], True
            before = spec.stats()
            for _ in range(repeats):  # interleaved
                t_plain = t_spec = 0.0
                for batch in batches:
                    t, a = _ours(plain, batch, outs[: len(batch)])
                    t_plain += t
                    t, b = _ours(spec, batch, outs[: len(batch)])
                    t_spec += t
                    same = same and a == b
                ratios.append(t_plain / t_spec)
            s = spec.stats()
            drafted = s["draft_tokens"] - before["draft_tokens"]
            rate = (s["accepted_tokens"] - before["accepted_tokens"]) / max(drafted, 1)
            print(
                f"speculative, {kind} ({label}, 8 x 128 tokens): median "
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) of "
                f"{len(ratios)} (goal >= 1.5); greedy tokens equal: {same}; drafts accepted "
                f"{rate:.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side")
    parser.add_argument("--parts", default="static,continuous,speculative")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    m = _model(args.layers, args.width, args.vocab)
    cfg, params = hf.from_hf(m)
    n_params = sum(p.numel() for p in m.parameters()) / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPT-2 {n_params:.1f}M")
    engine = Engine(cf.models.gpt, cfg, params, max_num_seqs=64, max_num_batched_tokens=2048)
    if "speculative" in args.parts:
        _speculative(cfg, params, args.vocab, args.repeats)
    if "static" not in args.parts:
        return

    prompts, outs = _workload(args.requests, args.vocab, (16, 128))
    _ours(engine, prompts[:2], [4, 4])  # warm up (and build the C++ decode attention)
    useful, ratios, same = sum(outs), [], True
    for r in range(args.repeats):  # interleaved: ours, theirs, ours, theirs, ...
        t_ours, ours = _ours(engine, prompts, outs)
        t_hf, theirs = _static(m, prompts, outs)
        same = same and ours[:16] == theirs[:16]
        ratios.append(t_hf / t_ours)
        print(
            f"  static run {r}: ours {useful / t_ours:8.1f} tok/s, transformers generate "
            f"(batches of 16) {useful / t_hf:8.1f} tok/s: {t_hf / t_ours:.2f}x"
        )
    print(
        f"static    ({args.requests} requests, outputs 16-128): median {statistics.median(ratios):.2f}x "
        f"of {len(ratios)} (goal >= 3); greedy tokens equal: {same}"
    )
    new, ratios = 64, []
    total = new * len(prompts)
    for r in range(args.repeats):
        t_ours, _ = _ours(engine, prompts, [new] * len(prompts))
        t_cb = _continuous(m, prompts, new)
        ratios.append(t_cb / t_ours)
        print(
            f"  continuous run {r}: ours {total / t_ours:8.1f} tok/s, transformers generate_batch "
            f"{total / t_cb:8.1f} tok/s: {t_cb / t_ours:.2f}x"
        )
    print(
        f"continuous({args.requests} requests, outputs {new}): median "
        f"{statistics.median(ratios):.2f}x of {len(ratios)} (goal >= 1)"
    )
    s = engine.stats()
    print(f"engine: {s['preemptions']} preemptions, {s['blocks_total']} blocks")


if __name__ == "__main__":
    main()
