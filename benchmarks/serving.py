"""Serving latency and throughput through ``colfunc serve``'s HTTP API, as vLLM measures them.

A random GPT-2 of about 19M parameters (6 layers, width 512; a 128-token ASCII vocabulary with the
byte tokenizer, so every token is one streamed character) is served on 127.0.0.1 by the same app
``colfunc serve`` runs; a client on this process's event loop sends requests with Poisson arrivals
at each given rate (``inf``: all at once), prompts of 16-256 characters and outputs of 16-128
tokens, streaming. Definitions are those of vLLM's ``benchmark_serving``:

- TTFT: from sending a request to its first streamed token;
- TPOT: per request, ``(latency - TTFT) / (output tokens - 1)``;
- ITL: the gaps between successive streamed tokens, all requests pooled;
- throughput: output tokens (and requests) per second of the whole run.

Client and server share this machine's cores, as they would on one host.

    python benchmarks/serving.py [--requests 32] [--rates 1,2,4,inf]
    colfunc bench serving
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import threading
import time

import httpx
import uvicorn

import colfunc as cf
from colfunc.inference import ByteTokenizer, Engine
from colfunc.inference.server import EngineLoop, build_app

NAME = "bench-gpt"


def _serve(engine: Engine) -> tuple[uvicorn.Server, str]:
    app = build_app(EngineLoop(engine), NAME)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def _one(client: httpx.AsyncClient, prompt: str, n: int) -> dict[str, float | list[float]]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
    body["temperature"] = 0
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                stamps += [time.perf_counter()] * len(text)  # one character per token
    latency = stamps[-1] - t0
    ttft = stamps[0] - t0
    return {
        "ttft": ttft,
        "tpot": (latency - ttft) / max(len(stamps) - 1, 1),
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": float(len(stamps)),
    }


async def _run(url: str, rate: float, count: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [
        "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(16, 256)))
        for _ in range(count)
    ]
    outs = [rng.randint(16, 128) for _ in range(count)]
    gaps = [0.0 if rate == float("inf") else rng.expovariate(rate) for _ in range(count)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(prompts, outs, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, p, n)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]

    ttft = [float(r["ttft"]) for r in results]  # type: ignore[arg-type]
    tpot = [float(r["tpot"]) for r in results]  # type: ignore[arg-type]
    itl = [x for r in results for x in r["itl"]]  # type: ignore[union-attr]
    tokens = sum(float(r["tokens"]) for r in results)  # type: ignore[arg-type]
    return {
        "ttft50": statistics.median(ttft),
        "ttft99": pct(ttft, 99),
        "tpot50": statistics.median(tpot),
        "tpot99": pct(tpot, 99),
        "itl50": statistics.median(itl),
        "itl99": pct(itl, 99),
        "tok_s": tokens / duration,
        "req_s": count / duration,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rates", default="1,2,4,inf")
    args = parser.parse_args()
    cfg = cf.models.gpt.Config(vocab_size=128, n_layer=6, n_head=8, d_model=512, max_seq_len=512)
    engine = Engine(cf.models.gpt, cfg, cf.models.gpt.init(cfg), tokenizer=ByteTokenizer())
    engine.generate(["warm up"], None)
    server, url = _serve(engine)
    print(f"{args.requests} requests per rate; times in ms")
    print(
        "| rate req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | tok/s | req/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        for k, rate in enumerate(float(r) for r in args.rates.split(",")):
            m = asyncio.run(_run(url, rate, args.requests, seed=k))
            ms = {key: v * 1e3 for key, v in m.items() if key not in ("tok_s", "req_s")}
            print(
                f"| {rate:g} | {ms['ttft50']:.0f} | {ms['ttft99']:.0f} | {ms['tpot50']:.1f} | "
                f"{ms['tpot99']:.1f} | {ms['itl50']:.1f} | {ms['itl99']:.1f} | "
                f"{m['tok_s']:.0f} | {m['req_s']:.2f} |"
            )
    finally:
        server.should_exit = True


if __name__ == "__main__":
    main()
